"""Dynamic loss scaling of the compiled train step (train/step.py) for ``train.dtype=fp16``."""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops


def loss_scaling(loss_scale):
    """``(scale_loss, unscale, adjust_scale, state parameters)`` for a ``train.precision.LossScale`` or None.

    Dynamic loss scaling (Micikevicius et al. 2018): the loss is multiplied by the scale before
    backward so small fp16 gradients do not flush to zero; gradients are divided by it before
    clipping (the loss that is reported and checked is the one before scaling). A non-finite step
    halves the scale (not below 1), ``window`` finite steps in a row double it. Without it all
    three are identities and no state exists.
    """
    if loss_scale is None:

        def scale_loss(loss):
            return loss

        def unscale(grads):
            return grads

        def adjust_scale(finite):
            return finite

        return scale_loss, unscale, adjust_scale, []
    scale = Parameter(Tensor(np.float32(loss_scale.initial)), name="loss_scale.scale", requires_grad=False)
    good_steps = Parameter(Tensor(np.float32(0.0)), name="loss_scale.good_steps", requires_grad=False)
    window = float(loss_scale.window)

    def scale_loss(loss):
        return loss * scale

    def unscale(grads):
        inv_scale = 1.0 / scale
        return tuple(g * inv_scale for g in grads)

    def adjust_scale(finite):
        counted = (good_steps + 1.0) * finite.astype(ms.float32)
        grow = counted >= window
        kept_scale = ops.select(grow, scale * 2.0, scale)
        ops.assign(scale, ops.select(finite, kept_scale, ops.maximum(scale * 0.5, 1.0)))
        ops.assign(good_steps, ops.select(grow, ops.zeros_like(counted), counted))
        return finite

    return scale_loss, unscale, adjust_scale, [scale, good_steps]
