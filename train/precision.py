"""Compute precision, activation recompute and cell reuse of a run (``train.dtype``, ``train.recompute``,
``train.cell_reuse``).

Applied to the model from outside, once, before the first compile. Parameters, optimizer
moments and the loss always stay fp32 ("master weights"); ``bf16``/``fp16`` lower the compute
with MindSpore's ``auto`` AMP level: MatMul-like ops run in the low precision, the ops on its
black list (softmax, log-softmax, reductions, norms) in fp32, with casts inserted at compile time.
(Level O1 rewrites the network's source and fails on this model's module constants; ``auto``
changes the cells in place.) fp16 also needs dynamic loss scaling, which
:class:`train.step.CompiledStep` does with :class:`LossScale`.

The CPU backend has no bf16 MatMul/Softmax/TopK kernels and runs fp16 slower than fp32, so on CPU
only fp32 is accepted.
"""

from dataclasses import dataclass

import mindspore as ms

COMPUTE_DTYPES = {"fp32": ms.float32, "bf16": ms.bfloat16, "fp16": ms.float16}


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling: the loss is multiplied by ``scale`` before backward and the gradients
    divided by it; a step with non-finite gradients is skipped and halves the scale, and
    ``window`` finite steps in a row double it."""

    initial: float
    window: int


def apply_precision(model, train):
    """Cast the model's matmuls to ``train.dtype`` and mark layers for recompute; returns the
    :class:`LossScale` the trainer must use (fp16) or None."""
    if train.recompute:
        # Each decoder layer keeps only its input for backward and recomputes the rest.
        for layer in model.layers:
            layer.recompute()
    if train.dtype == "fp32":
        return None
    ms.amp.auto_mixed_precision(model, "auto", dtype=COMPUTE_DTYPES[train.dtype])
    if train.dtype == "fp16":
        return LossScale(initial=float(train.loss_scale), window=int(train.loss_scale_window))
    return None
