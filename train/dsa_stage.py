"""DeepSeek Sparse Attention's training stages in a run (``dsa.*``; model/dsa_config.py).

A run configured with ``dsa.stage=dense_warmup`` trains only the indexers for ``dsa.warmup_steps``
optimizer steps (every other parameter frozen: not in the optimizer, no gradient, no router bias update), then
continues in ``sparse`` with every parameter. The switch happens right after step ``warmup_steps``, before that
step's checkpoint is written, so a checkpoint's optimizer state always belongs to the stage a resumed run is in:
a run resumed at step ``s`` is in warm-up exactly when ``s < warmup_steps``. At the switch the optimizer is built
again over every parameter: the indexers' moments restart with the others', and its step counter (the learning
rate schedule's position) continues from ``warmup_steps``.
"""

import logging

import numpy as np
from mindspore import Tensor

from mindmoe.model.mla import set_dsa_stage

log = logging.getLogger("mindmoe.train")

#: A parameter of a DSA indexer (model/dsa.py), the only kind that trains during the dense warm-up.
INDEXER_PARAMETER = ".self_attn.indexer."


def stage_at(model, step: int):
    """The DSA stage of a run of ``model`` (its ``dsa_training``) whose last completed step is ``step``; None without
    an indexer."""
    dsa = model.dsa_training
    if not model.config.dsa.enabled:
        return None
    if dsa.stage == "dense_warmup" and step >= dsa.warmup_steps:
        return "sparse"
    return dsa.stage


def switches_after(model, step: int) -> bool:
    """Whether the warm-up ends with ``step`` (the run continues sparse from the next one)."""
    dsa = model.dsa_training
    return model.config.dsa.enabled and dsa.stage == "dense_warmup" and step == dsa.warmup_steps


def enter_stage(model, stage) -> None:
    """Set ``stage`` on every DSA layer of ``model`` and, in a run configured with a warm-up, freeze (warm-up) or
    unfreeze what it trains; the compiled step must be built after this. (A LoRA run, which has its own frozen
    base, cannot be configured with a warm-up: conf/checks.py.)"""
    if stage is None:
        return
    set_dsa_stage(model, stage)
    if model.dsa_training.stage != "dense_warmup":
        return
    warmup = stage == "dense_warmup"
    for param in model.get_parameters():
        if param.name.endswith("e_score_correction_bias"):
            continue  # a buffer, never trained
        param.requires_grad = INDEXER_PARAMETER in param.name or not warmup
    if warmup:
        trained = sum(int(np.prod(p.shape)) for p in model.trainable_params())
        log.info("DSA dense warm-up: only the indexers train (%d parameters)", trained)


def continue_schedule(optimizer, step: int) -> None:
    """Set a rebuilt optimizer's step counter to ``step``, so the learning-rate schedule goes on where it was."""
    counter = optimizer.global_step
    counter.set_data(Tensor(np.full(counter.shape, step, counter.asnumpy().dtype)))
