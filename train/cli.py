"""``mindmoe-train``: the Hydra entry point (overrides like ``train.max_steps=40``).

Exit codes (:mod:`conf.exit_codes`): 0 done, 2 configuration or input error (also a run that diverged,
``train.max_bad_steps``), 3 stopped by SIGTERM/SIGINT after the checkpoint of that step was written.
"""

import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from mindmoe.conf.exit_codes import reports_errors
from mindmoe.conf.explicit_keys import explicit_keys, model_fields
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


def main() -> None:
    quiet_framework_logs()
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        # mindmoe-launch maps the pid msrun reports for a failed worker to this rank's log.
        print(WORKER_BANNER.format(rank=os.environ.get("RANK_ID", "?"), pid=os.getpid()), flush=True)
    _main()


if __name__ == "__main__":
    main()
