"""``mindmoe-export``: serving graphs (MindIR) or a HF directory from a checkpoint or a HF directory.

    mindmoe-export checkpoint=<run dir>/checkpoints/step_000200 export.out=exported
    mindmoe-export model.pretrained=/models/glm-4.5-air export.out=exported export.dtype=bf16
    mindmoe-export checkpoint=<...> export.format=hf export.out=hf_dir

Keys: ``export.*`` (conf/export/default.yaml), ``checkpoint``, ``model.pretrained``, ``data.tokenizer``.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from mindmoe.conf.exit_codes import reports_errors
from mindmoe.conf.moved_keys import exit_on_moved_keys
from mindmoe.conf.quiet import quiet_framework_logs
from mindmoe.conf.schema import register_configs

register_configs()


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
@reports_errors("mindmoe-export")
def _main(cfg) -> None:
    from mindmoe.train.export.exporter import run_export

    hydra_cfg = HydraConfig.get()
    out = run_export(cfg, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task), hydra_cfg.runtime)
    print(f"exported ({cfg.export.format}): {out}")


def main() -> None:
    quiet_framework_logs()
    exit_on_moved_keys("mindmoe-export", sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
