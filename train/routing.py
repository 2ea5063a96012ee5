"""Router state that changes once per optimizer step, outside the gradient.

- Aux-loss-free balancing: ``b_e += rate * sign(mean_load - load_e)`` per MoE layer, from the
  *effective* routing of the whole global batch (after locking and capacity dropping).
- Gradient isolation, ``expert_update`` mode: expert e's optimizer update is multiplied by
  ``1 - (1 - lambda) * f_e``, f_e = share of e's routed assignments in the step made by locked
  tokens. Scaling the update, not the gradient, is what survives Adam: Adam divides a
  uniformly scaled gradient's scale away.

Both take the step's summed ``routing_stats [L, 3, E]`` (rows chosen, kept, locked_kept).
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

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


def _compile_update_scaling(expert_params, snapshots, first_experts, decay: float):
    """``(take_snapshot, scale_updates)``: keep the expert tensors before the optimizer; afterwards scale
    each expert's update by ``1 - (1 - decay) * locked share``."""

    @ms.jit
    def take_snapshot():
        for layer_params, layer_snapshots in zip(expert_params, snapshots):
            for param, snapshot in zip(layer_params, layer_snapshots):
                ops.assign(snapshot, param)
        return ops.zeros((), ms.float32)

    @ms.jit
    def scale_updates(locked_share_LE):
        for layer_idx, (layer_params, layer_snapshots) in enumerate(zip(expert_params, snapshots)):
            multiplier_E = 1.0 - (1.0 - decay) * locked_share_LE[layer_idx]
            first = first_experts[layer_idx]
            for param, snapshot in zip(layer_params, layer_snapshots):
                multiplier_e = multiplier_E[first : first + param.shape[0]]
                multiplier = multiplier_e.reshape((-1,) + (1,) * (len(param.shape) - 1)).astype(param.dtype)
                ops.assign(param, snapshot + multiplier * (param - snapshot))
        return locked_share_LE.sum()

    return take_snapshot, scale_updates


class RouterStepUpdates:
    """Holds the compiled per-step updates of one model; inactive parts cost nothing."""

    def __init__(self, model, cfg: ModelConfig):
        moe_blocks = [layer.mlp for layer in model.layers if layer.is_moe]
        self.updates_bias = cfg.expert_bias and cfg.bias_update_rate > 0 and bool(moe_blocks)
        self.scales_updates = (
            cfg.expert_lock and cfg.isolation_mode == "expert_update" and cfg.isolation_decay < 1.0 and bool(moe_blocks)
        )
        biases = [block.router.e_score_correction_bias for block in moe_blocks] if self.updates_bias else []
        # One entry per MoE layer: that layer's trained 3-D expert tensors (expert on axis 0): the
        # expert weights, or with LoRA the frozen weights' per-expert adapters instead; and the first
        # expert they hold (not 0 when experts are split over ranks, train/expert_parallel.py).
        expert_params = (
            [
                [p for p in block.experts.get_parameters() if len(p.shape) == 3 and p.requires_grad]
                for block in moe_blocks
            ]
            if self.scales_updates
            else []
        )
        self.expert_params = expert_params
        first_experts = [getattr(block.experts, "first_expert", 0) for block in moe_blocks]
        self._snapshots = [
            [
                Parameter(ops.zeros(p.shape, p.dtype), name="update_snapshot." + p.name, requires_grad=False)
                for p in layer_params
            ]
            for layer_params in expert_params
        ]
        self._update_biases = _compile_bias_update(biases, float(cfg.bias_update_rate))
        self._take_snapshot, self._scale_updates = _compile_update_scaling(
            expert_params, self._snapshots, first_experts, float(cfg.isolation_decay)
        )

    def before_optimizer(self) -> None:
        if self.scales_updates:
            self._take_snapshot()

    def after_optimizer(self, routing_stats_L3E: np.ndarray) -> None:
        """Apply both updates from the step's summed statistics (already summed over ranks)."""
        kept_LE = routing_stats_L3E[:, 1]
        if self.updates_bias:
            self._update_biases(Tensor(kept_LE.astype(np.float32)))
        if self.scales_updates:
            locked_share_LE = routing_stats_L3E[:, 2] / np.maximum(kept_LE, 1.0)
            self._scale_updates(Tensor(locked_share_LE.astype(np.float32)))
