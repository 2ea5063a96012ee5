"""Compute precision, activation recompute and cell reuse of a run (``train.dtype``, ``train.recompute``,
``train.cell_reuse``).

Applied to the model from outside, once, before the first compile. ``bf16``/``fp16`` lower the compute with
MindSpore's ``auto`` AMP level: MatMul-like ops run in the low precision, the ops on its black list (softmax,
log-softmax, reductions, norms) in fp32, with casts inserted at compile time. (Level O1 rewrites the network's
source and fails on this model's module constants; ``auto`` changes the cells in place.) The trained weights are
then stored in that dtype too (:func:`masters`): their fp32 masters, the AdamW moments and the loss stay fp32, the
masters in the optimizer's ranges (train/parallel/zero.py). fp16 also needs dynamic loss scaling, which
:class:`train.step.CompiledStep` does with :class:`LossScale`.

The CPU backend has no bf16 MatMul/Softmax/TopK kernels, so on CPU bf16 is refused; fp16 runs there (slower than
fp32), which is how the half-precision paths are tested.
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


def masters(train):
    """The dtype trained weights are stored in under ``train.dtype`` half precision (their fp32 masters then live
    in the optimizer's ranges, train/parallel/zero.py), or None (fp32: the weights are their own masters)."""
    return None if train.dtype == "fp32" else COMPUTE_DTYPES[train.dtype]
