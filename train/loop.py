"""The entry of ``mindmoe-train``: check the config tree, then train (:class:`train.trainer.Trainer`)."""

from pathlib import Path

import mindspore as ms

from mindmoe.train.precision import validate_precision


def validate_run_config(cfg) -> None:
    """Checks across sections that the dataclasses alone cannot express, naming the key."""
    data, train = cfg.data, cfg.train
    if data.micro_batch_size < 1 or data.global_batch_size % data.micro_batch_size:
        raise ValueError(
            f"data.global_batch_size={data.global_batch_size} must be a positive multiple of "
            f"data.micro_batch_size={data.micro_batch_size}"
        )
    for key in ("max_steps", "log_every", "save_every"):
        if getattr(train, key) < 1:
            raise ValueError(f"train.{key}={getattr(train, key)} must be >= 1")
    if not 0 <= train.warmup_ratio < 1:
        raise ValueError(f"train.warmup_ratio={train.warmup_ratio} must be in [0, 1)")
    validate_precision(train, ms.get_context("device_target"))
    if train.max_bad_steps < 1:
        raise ValueError(f"train.max_bad_steps={train.max_bad_steps} must be >= 1")
    if train.on_corrupt_checkpoint not in ("error", "previous"):
        raise ValueError(f"train.on_corrupt_checkpoint={train.on_corrupt_checkpoint!r} must be 'error' or 'previous'")
    if train.resume not in ("auto", "none") and not Path(train.resume).expanduser().exists():
        raise ValueError(f"train.resume={train.resume!r}: not 'auto', 'none' or an existing checkpoint directory")


def run(cfg, run_dir: Path, explicit_model_keys=()) -> dict:
    """Train as configured, writing everything into ``run_dir``; returns the final summary.

    ``explicit_model_keys``: the ``model.*`` fields set on the command line, which are the only
    model keys that apply on top of a ``model.pretrained`` config.json. Under msrun every worker
    runs this with the same config and run dir; rank 0 alone writes ``metrics.jsonl``, TensorBoard
    events and checkpoints.
    """
    # Imported here: mindmoe-launch checks a config with validate_run_config without loading the trainer.
    from mindmoe.train.trainer import Trainer

    validate_run_config(cfg)
    return Trainer(cfg, run_dir, explicit_model_keys).train()
