"""The entry of ``mindmoe-train``: check the config tree, then train (:class:`train.trainer.Trainer`)."""

from pathlib import Path

import mindspore as ms

from mindmoe.conf.checks import validate_run_config
from mindmoe.train.checkpoints.run_lock import RunLock


def run(cfg, run_dir: Path, explicit_model_keys=()) -> dict:
    """Train as configured, writing everything into ``run_dir``; returns the final summary.

    ``explicit_model_keys``: the ``model.*`` fields set on the command line, which are the only
    model keys that apply on top of a ``model.pretrained`` config.json. Under msrun every worker
    runs this with the same config and run dir; rank 0 alone writes ``metrics.jsonl``, TensorBoard
    events and checkpoints, and holds the run dir's lock (:mod:`train.checkpoints.run_lock`) from the moment it
    knows it is rank 0 until the run ends, however it ends.
    """
    # Imported here: the trainer (MindSpore graph code) loads only when a run starts.
    from mindmoe.train.trainer import Trainer

    validate_run_config(cfg, ms.get_context("device_target"))
    with RunLock(run_dir) as run_lock:
        return Trainer(cfg, run_dir, explicit_model_keys, run_lock).train()
