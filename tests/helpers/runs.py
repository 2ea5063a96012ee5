"""Composing the Hydra config as the CLIs do, and reading what a run wrote."""

import json
from pathlib import Path

from hydra import compose, initialize_config_module

from mindmoe.conf.schema import register_configs

REPO = Path(__file__).resolve().parents[2]


def compose_config(overrides):
    """The config ``mindmoe-train <overrides>`` would run with (no run directory, no Hydra job)."""
    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def metrics_rows(run_dir) -> list:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(run_dir) -> dict:
    """Per-step training loss; a step logged twice (before a kill and after resume) keeps the last."""
    return {row["step"]: row["loss"] for row in metrics_rows(run_dir) if "loss" in row}
