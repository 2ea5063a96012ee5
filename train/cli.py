"""``mindmoe-train``: the Hydra entry point (overrides like ``train.max_steps=40``).

Exit codes (:mod:`conf.exit_codes`): 0 done, 2 configuration or input error (also a run that diverged,
``train.max_bad_steps``), 3 stopped by SIGTERM/SIGINT after the checkpoint of that step was written.
"""

import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from mindmoe.conf.exit_codes import reports_errors
from mindmoe.conf.schema import register_configs
from mindmoe.launch.msrun import WORKER_BANNER

register_configs()


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
@reports_errors("mindmoe-train")
def _main(cfg) -> None:
    from mindmoe.train.init_model import explicit_model_keys
    from mindmoe.train.loop import run

    hydra_cfg = HydraConfig.get()
    run(cfg, Path(hydra_cfg.runtime.output_dir), explicit_model_keys(hydra_cfg.overrides.task))


def main() -> None:
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        # mindmoe-launch maps the pid msrun reports for a failed worker to this rank's log.
        print(WORKER_BANNER.format(rank=os.environ.get("RANK_ID", "?"), pid=os.getpid()), flush=True)
    _main()


if __name__ == "__main__":
    main()
