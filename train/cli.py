"""``mindmoe-train``: the Hydra entry point (overrides like ``train.max_steps=40``)."""

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from mindmoe.conf.schema import register_configs

register_configs()


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
def _main(cfg) -> None:
    from mindmoe.train.init_model import explicit_model_keys
    from mindmoe.train.loop import run
    from mindmoe.train.resume import TrainingStopped

    hydra_cfg = HydraConfig.get()
    try:
        run(cfg, Path(hydra_cfg.runtime.output_dir), explicit_model_keys(hydra_cfg.overrides.task))
    except (ValueError, FileNotFoundError, FloatingPointError) as error:
        print(f"mindmoe-train: error: {error}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as stopped:
        print(f"mindmoe-train: stopped: {stopped}", file=sys.stderr)
        sys.exit(3)


def main() -> None:
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        from mindmoe.launch.msrun import WORKER_BANNER

        # mindmoe-launch maps the pid msrun reports for a failed worker to this rank's log.
        print(WORKER_BANNER.format(rank=os.environ.get("RANK_ID", "?"), pid=os.getpid()), flush=True)
    _main()


if __name__ == "__main__":
    main()
