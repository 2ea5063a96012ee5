"""mindformers' AdamW with the per-parameter update done by MindSpore's ``Adam`` kernel.

mindformers' AdamW updates each parameter with about a dozen separate element-wise kernels
(two moment updates, bias corrections, sqrt, divide, decay, assign), each a full pass over the
tensor. MindSpore's ``Adam`` kernel (``ApplyAdam``) does the moment updates, the bias correction
and the step in one vectorised, multi-threaded pass; on CPU it ran ~8x faster than the
``AdamWeightDecay`` kernel (0.6 vs 4.8 ms per million fp32 parameters), whose optimizer phase
had become 8 % of the MoE train step. ``Adam`` has no weight decay, so the decoupled decay is
one multiply before it. With ``t`` the step, ``c1 = 1 - beta1^t``, ``c2 = 1 - beta2^t``:

    mindformers:  p <- p (1 - lr wd) - (lr / c1) m / (sqrt(v / c2) + eps)
    here:         p <- p (1 - lr wd);  p <- p - lr sqrt(c2) / c1 * m / (sqrt(v) + eps')  (Adam kernel)
    with          eps' = eps sqrt(c2)

which is the same update (m, v updated first in both; the Adam step does not depend on p).
State (``exp_avg``, ``exp_avg_sq``, ``global_step``), parameter groups and the learning-rate
schedule are mindformers' own, so checkpoints are interchangeable with the unfused optimizer.
"""

import mindspore as ms
from mindspore import ops
from mindspore.ops import composite as C
from mindspore.ops import functional as F

#: ``(beta1^t, beta2^t, beta1, beta2, eps', lr, weight decay, update scale or None, param, grad, m, v)`` -> param.
fused_update = C.MultitypeFuncGraph("fused_adamw_update")
_adam = ops.Adam()


def _adam_step(beta1_power, beta2_power, beta1, beta2, eps, lr, param, grad, exp_avg, exp_avg_sq):
    return F.depend(
        param,
        _adam(param, exp_avg, exp_avg_sq, beta1_power, beta2_power, lr, beta1, beta2, eps, grad.astype(param.dtype)),
    )


def _update(beta1_power, beta2_power, beta1, beta2, eps, lr, weight_decay, param, grad, exp_avg, exp_avg_sq):
    param = F.depend(param, ops.assign(param, param * (1.0 - lr * weight_decay).astype(param.dtype)))
    return _adam_step(beta1_power, beta2_power, beta1, beta2, eps, lr, param, grad, exp_avg, exp_avg_sq)


def _update_number_decay(
    beta1_power, beta2_power, beta1, beta2, eps, lr, weight_decay, param, grad, exp_avg, exp_avg_sq
):
    if weight_decay != 0:
        param = F.depend(param, ops.assign(param, param * (1.0 - lr * weight_decay).astype(param.dtype)))
    return _adam_step(beta1_power, beta2_power, beta1, beta2, eps, lr, param, grad, exp_avg, exp_avg_sq)


def _scaled_update(
    beta1_power, beta2_power, beta1, beta2, eps, lr, weight_decay, scale, param, grad, exp_avg, exp_avg_sq
):
    """The update times ``scale`` (broadcast over ``param``, e.g. one factor per expert row), decay included,
    with no copy of ``param``: the kernel first updates the moments only (a zero step leaves ``param`` as it
    is), then takes the step of the scaled first moment with betas of 1, which leave its moments unchanged."""
    # Broadcast explicitly: MindSpore 2.9's CPU Mul of a full tensor by an implicitly broadcast [E, 1, 1]
    # operand held about four times the tensor's bytes; an explicit broadcast costs one transient tensor.
    decay_factor = ops.broadcast_to((1.0 - lr * weight_decay * scale).astype(param.dtype), param.shape)
    param = F.depend(param, ops.assign(param, param * decay_factor))
    param = _adam_step(beta1_power, beta2_power, beta1, beta2, eps, lr * 0.0, param, grad, exp_avg, exp_avg_sq)
    scaled_avg = F.depend(exp_avg, param) * ops.broadcast_to(scale.astype(exp_avg.dtype), exp_avg.shape)
    one = ops.ones_like(beta1)
    step = _adam(param, scaled_avg, exp_avg_sq, beta1_power, beta2_power, lr, one, one, eps, grad.astype(param.dtype))
    return F.depend(param, step)


# Arguments: the six step scalars, weight decay (a tensor or a number), the update scale (None: 1), then
# the parameter, its gradient and moments.
_SCALARS = ("Tensor",) * 6
_STATE = ("Tensor",) * 4
for _decay_type in ("Tensor", "Number"):
    fused_update.register(*_SCALARS, _decay_type, "Tensor", *_STATE)(_scaled_update)


@fused_update.register(*_SCALARS, "Tensor", "None", *_STATE)
def _unscaled_update(beta1_power, beta2_power, beta1, beta2, eps, lr, weight_decay, _, param, grad, m, v):
    return _update(beta1_power, beta2_power, beta1, beta2, eps, lr, weight_decay, param, grad, m, v)


@fused_update.register(*_SCALARS, "Number", "None", *_STATE)
def _unscaled_update_number_decay(beta1_power, beta2_power, beta1, beta2, eps, lr, weight_decay, _, param, grad, m, v):
    return _update_number_decay(beta1_power, beta2_power, beta1, beta2, eps, lr, weight_decay, param, grad, m, v)


def fused_adamw_class(base):
    """A subclass of mindformers' ``AdamW`` class ``base`` whose ``construct`` uses the fused kernel.

    ``construct(gradients, update_scales=None)``: ``update_scales``, one entry per parameter (a tensor
    broadcast over it, or None), multiplies each parameter's update (train/routing.py, gradient isolation)."""

    class FusedAdamW(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # A group without decay passes the number 0 instead of its tensor 0 to the update, which then skips the
            # decay's multiply and assign (two kernels per parameter: 114 kernels for the 57 norms and biases of the
            # benchmark's dense step).
            self.static_weight_decay = None
            if self.is_group and not self.dynamic_weight_decay:
                self.static_weight_decay = tuple(
                    decay if flag else 0.0 for decay, flag in zip(self.weight_decay, self.decay_flags)
                )

        def step_scalars(self):
            """Advance ``global_step``; ``(weight decay per parameter, (beta1^t, beta2^t, beta1, beta2, eps', lr))``,
            the first arguments of :data:`fused_update` (a partial returned from here fails MindSpore 2.9's
            graph specialisation when it is applied to other tensors than the parameters)."""
            weight_decay = self.get_weight_decay() if self.static_weight_decay is None else self.static_weight_decay
            lr = self.get_lr()
            self.assignadd(self.global_step, self.global_step_increase_tensor)
            step = self.global_step.astype(ms.float32)
            beta1 = self.beta1.reshape(())
            beta2 = self.beta2.reshape(())
            beta1_power = ops.pow(beta1, step).reshape(())
            beta2_power = ops.pow(beta2, step).reshape(())
            lr = lr.reshape(()).astype(ms.float32)
            eps = self.eps.reshape(()) * ops.sqrt(1.0 - beta2_power)
            if not self.is_group:
                weight_decay = (weight_decay,) * len(self._parameters)
            return weight_decay, (beta1_power, beta2_power, beta1, beta2, eps, lr)

        def construct(self, gradients, update_scales=None):
            weight_decay, (beta1_power, beta2_power, beta1, beta2, eps, lr) = self.step_scalars()
            update = F.partial(fused_update, beta1_power, beta2_power, beta1, beta2, eps, lr)
            if update_scales is None:
                update_scales = (None,) * len(self._parameters)
            result = self.hyper_map(
                update, weight_decay, update_scales, self._parameters, gradients, self.exp_avg, self.exp_avg_sq
            )
            if self.use_parallel:
                self.broadcast_params(result)
            return result

    return FusedAdamW
