"""``mindmoe-eval``: validation perplexity of a checkpoint at several context lengths under each RoPE scaling.

    mindmoe-eval checkpoint=<run dir>/checkpoints/step_000200 eval.context_lengths=[128,512,1024]

Prints the table and writes ``long_context.json`` and ``long_context.md`` into ``eval.out``
(default: the Hydra run dir). Keys: ``eval.*`` (conf/eval/default.yaml), ``data.valid_files``.
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
@reports_errors("mindmoe-eval")
def _main(cfg) -> None:
    from mindmoe.train.evaluation.evaluate import evaluate_checkpoint
    from mindmoe.train.evaluation.report import markdown, write_report

    report = evaluate_checkpoint(cfg)
    out_dir = Path(cfg.eval.out) if cfg.eval.out else Path(HydraConfig.get().runtime.output_dir)
    json_path, markdown_path = write_report(report, out_dir)
    print(markdown(report))
    print(f"written: {json_path}, {markdown_path}")


def main() -> None:
    quiet_framework_logs()
    exit_on_moved_keys("mindmoe-eval", sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
