"""``mindmoe-train``: the Hydra entry point (overrides like ``train.max_steps=40``).

Exit codes (:mod:`conf.exit_codes`): 0 done, 2 configuration or input error (also a run that diverged,
``train.max_bad_steps``, and a run dir another run holds: :mod:`train.checkpoints.run_lock`), 3 stopped by
SIGTERM/SIGINT after the checkpoint of that step was written.
"""

import os
import sys
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig

from mindmoe.conf.exit_codes import reports_errors
from mindmoe.conf.explicit_keys import explicit_keys, model_fields
from mindmoe.conf.moved_keys import exit_on_moved_keys
from mindmoe.conf.quiet import quiet_framework_logs
from mindmoe.conf.schema import register_configs
from mindmoe.launch.msrun import WORKER_BANNER

register_configs()


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
@reports_errors("mindmoe-train")
def _main(cfg) -> None:
    from mindmoe.train.init_model import warn_keys_without_effect
    from mindmoe.train.loop import run

    hydra_cfg = HydraConfig.get()
    # The command line's keys and those of the chosen recipe / model group, as if typed.
    keys = explicit_keys(hydra_cfg.overrides.task, hydra_cfg.runtime)
    warn_keys_without_effect(cfg, keys)
    run(cfg, Path(hydra_cfg.runtime.output_dir), model_fields(keys))


def run_dir_argument(argv) -> Optional[Path]:
    """The ``hydra.run.dir=`` of a command line (the last one wins, as in Hydra); None when it is not
    given or is an interpolation (the default ``runs/${now:...}``) that only Hydra resolves."""
    value = None
    for arg in argv:
        key, sep, rest = arg.lstrip("+").partition("=")
        if sep and key == "hydra.run.dir":
            value = rest.strip().strip("'\"")
    return None if not value or "${" in value else Path(value).expanduser()


@reports_errors("mindmoe-train")
def check_run_dir(argv) -> None:
    """Before Hydra creates the run dir and writes its config copy and log there: a ``hydra.run.dir`` that
    is (or lies under) a file, or that a running ``mindmoe-train`` holds, ends the command (status 2)."""
    from mindmoe.train.checkpoints.run_lock import LOCK_FILE, busy, lock_holder

    run_dir = run_dir_argument(argv)
    if run_dir is None:
        return
    existing = next((path for path in (run_dir, *run_dir.parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(
            f"hydra.run.dir={run_dir}: {existing} is a file, not a directory; a run dir is a directory "
            "(it is created when absent): choose another path"
        )
    # Under msrun the job's own rank 0 may already hold the lock; rank 0 alone checks it (train.loop).
    holder = None if os.environ.get("MS_ROLE") else lock_holder(run_dir)
    if holder is not None:
        raise busy(run_dir / LOCK_FILE, holder)


def main() -> None:
    quiet_framework_logs()
    exit_on_moved_keys("mindmoe-train", sys.argv[1:])
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        # mindmoe-launch maps the pid msrun reports for a failed worker to this rank's log.
        print(WORKER_BANNER.format(rank=os.environ.get("RANK_ID", "?"), pid=os.getpid()), flush=True)
    check_run_dir(sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
