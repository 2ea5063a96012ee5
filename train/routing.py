"""Router state that changes once per optimizer step, outside the gradient.

- Aux-loss-free balancing: ``b_e += rate * sign(mean_load - load_e)`` per MoE layer, from the
  *effective* routing of the whole global batch (after locking and capacity dropping).
- Gradient isolation, ``expert_update`` mode: expert e's optimizer update (decay included) is
  multiplied by ``1 - (1 - lambda) * f_e``, f_e = share of e's routed assignments in the step made
  by locked tokens. Scaling the update, not the gradient, is what survives Adam: Adam divides a
  uniformly scaled gradient's scale away. The optimizer applies the scales in its own step
  (train/fused_adamw.py), so no copy of the expert weights is kept.

Both take the step's summed ``routing_stats [L, 3, E]`` (rows chosen, kept, locked_kept).
"""

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe.router import updated_bias


def _compile_bias_update(biases, rate: float):
    """Aux-loss-free balancing of every MoE layer's router bias from the step's kept counts ``[L, E]``."""

    @ms.jit
    def update_biases(kept_LE):
        for layer_idx, bias in enumerate(biases):
            ops.assign(bias, updated_bias(bias, kept_LE[layer_idx], rate))
        return kept_LE.sum()

    return update_biases


def _update_scales(row_specs, decay: float, all_reduce):
    """``routing_L3E -> scales``, traced into the step: per optimizer parameter, the ``[experts, 1, 1]``
    multipliers ``1 - (1 - decay) * locked share`` of an expert tensor's rows, None for the others."""

    def scales(routing_L3E):
        # Summed over ranks first; the shares are ratios, so ranks sharing micro-batches need no correction.
        if all_reduce is not None:
            routing_L3E = all_reduce(routing_L3E)
        multiplier_LE = 1.0 - (1.0 - decay) * (routing_L3E[:, 2] / ops.maximum(routing_L3E[:, 1], 1.0))
        return tuple(
            None
            if spec is None
            else multiplier_LE[spec[0], spec[1] : spec[1] + spec[2]].reshape(spec[3]).astype(spec[4])
            for spec in row_specs
        )

    return scales


class RouterStepUpdates:
    """Holds the compiled per-step updates of one model; inactive parts cost nothing."""

    def __init__(self, model, cfg: ModelConfig):
        moe_blocks = [layer.mlp for layer in model.layers if layer.is_moe]
        moe = model.moe_config
        self.updates_bias = cfg.expert_bias and moe.bias_update_rate > 0 and bool(moe_blocks)
        self.scales_updates = (
            moe.expert_lock and moe.isolation_mode == "expert_update" and moe.isolation_decay < 1.0 and bool(moe_blocks)
        )
        self.isolation_decay = float(moe.isolation_decay)
        biases = [block.router.e_score_correction_bias for block in moe_blocks] if self.updates_bias else []
        # One entry per MoE layer: that layer's trained 3-D expert tensors (expert on axis 0): the
        # expert weights, or with LoRA the frozen weights' per-expert adapters instead; and the first
        # expert they hold (not 0 when experts are split over ranks, train/parallel/expert_parallel.py).
        self.expert_params = (
            [
                [p for p in block.experts.get_parameters() if len(p.shape) == 3 and p.requires_grad]
                for block in moe_blocks
            ]
            if self.scales_updates
            else []
        )
        self.first_experts = [getattr(block.experts, "first_expert", 0) for block in moe_blocks]
        self._update_biases = _compile_bias_update(biases, float(moe.bias_update_rate))

    def update_scales(self, params, dist=None):
        """The optimizer's per-parameter update scales as a function of the step's routing statistics
        (``[L, 3, E]`` of this rank's micro-batches), for the compiled step to pass to the optimizer
        (train/fused_adamw.py); None when no update is scaled. ``dist``: sum the statistics over its ranks."""
        if not self.scales_updates:
            return None
        rows = {}
        for layer_idx, layer_params in enumerate(self.expert_params):
            for param in layer_params:
                shape = (param.shape[0],) + (1,) * (len(param.shape) - 1)
                rows[id(param)] = (layer_idx, self.first_experts[layer_idx], param.shape[0], shape, param.dtype)
        all_reduce = ops.AllReduce() if dist is not None and dist.active else None
        return _update_scales([rows.get(id(p)) for p in params], self.isolation_decay, all_reduce)

    def after_optimizer(self, routing_stats_L3E: np.ndarray) -> None:
        """Aux-loss-free balancing from the step's summed statistics (already summed over ranks)."""
        if self.updates_bias:
            self._update_biases(Tensor(routing_stats_L3E[:, 1].astype(np.float32)))
