"""mindformers' AdamW with the per-parameter update done by one fused kernel.

mindformers' AdamW updates each parameter with about a dozen separate element-wise kernels
(two moment updates, bias corrections, sqrt, divide, decay, assign), each a full pass over the
tensor; on CPU that was ~15 % of an MoE train step. MindSpore's ``AdamWeightDecay`` kernel does
the same update in one multi-threaded pass but has no bias correction, so the correction is
folded into its scalars. With ``t`` the step, ``c1 = 1 - beta1^t``, ``c2 = 1 - beta2^t``:

    mindformers:  p <- p (1 - lr wd) - (lr / c1) m / (sqrt(v / c2) + eps)
    kernel:       p <- p - lr' (m / (sqrt(v) + eps') + wd' p)
    with          lr' = lr sqrt(c2) / c1,  eps' = eps sqrt(c2),  wd' = wd lr / lr' = wd c1 / sqrt(c2)

which is the same update (m, v updated first in both). ``wd'`` does not divide by ``lr``, which
is 0 on the first warmup step. State (``exp_avg``, ``exp_avg_sq``,
``global_step``), parameter groups and the learning-rate schedule are mindformers' own, so
checkpoints are interchangeable with the unfused optimizer.
"""
import mindspore as ms
from mindspore import ops
from mindspore.ops import composite as C
from mindspore.ops import functional as F

_fused_update = C.MultitypeFuncGraph("fused_adamw_update")
_adam_weight_decay = ops.AdamWeightDecay()


@_fused_update.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                        "Tensor", "Tensor")
def _update(beta1, beta2, eps, kernel_lr, decay_scale, weight_decay, param, grad, exp_avg, exp_avg_sq):
    decay = weight_decay * decay_scale
    return F.depend(param, _adam_weight_decay(param, exp_avg, exp_avg_sq, kernel_lr, beta1, beta2, eps, decay,
                                              grad.astype(param.dtype)))


@_fused_update.register("Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Number", "Tensor", "Tensor",
                        "Tensor", "Tensor")
def _update_number_decay(beta1, beta2, eps, kernel_lr, decay_scale, weight_decay, param, grad, exp_avg,
                         exp_avg_sq):
    decay = weight_decay * decay_scale
    return F.depend(param, _adam_weight_decay(param, exp_avg, exp_avg_sq, kernel_lr, beta1, beta2, eps, decay,
                                              grad.astype(param.dtype)))


def fused_adamw_class(base):
    """A subclass of mindformers' ``AdamW`` class ``base`` whose ``construct`` uses the fused kernel."""

    class FusedAdamW(base):
        def construct(self, gradients):
            weight_decay = self.get_weight_decay()
            lr = self.get_lr()
            self.assignadd(self.global_step, self.global_step_increase_tensor)
            step = self.global_step.astype(ms.float32)
            beta1 = self.beta1.reshape(())
            beta2 = self.beta2.reshape(())
            correction1 = 1.0 - ops.pow(beta1, step).reshape(())
            sqrt_correction2 = ops.sqrt(1.0 - ops.pow(beta2, step)).reshape(())
            lr = lr.reshape(()).astype(ms.float32)
            kernel_lr = lr * sqrt_correction2 / correction1
            decay_scale = correction1 / sqrt_correction2
            eps = self.eps.reshape(()) * sqrt_correction2
            if self.is_group:
                update = F.partial(_fused_update, beta1, beta2, eps, kernel_lr, decay_scale)
                result = self.hyper_map(update, weight_decay, self._parameters, gradients, self.exp_avg,
                                        self.exp_avg_sq)
            else:
                update = F.partial(_fused_update, beta1, beta2, eps, kernel_lr, decay_scale, weight_decay)
                result = self.hyper_map(update, self._parameters, gradients, self.exp_avg, self.exp_avg_sq)
            if self.use_parallel:
                self.broadcast_params(result)
            return result

    return FusedAdamW
