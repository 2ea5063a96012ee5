"""The state side of a plan by ``parallel.zero`` stage, and the bytes a rank's collectives carry per step.

With ``trained`` the trained elements a rank holds (routed experts: its ``1/ep`` of them) and ``owned`` its share
of them under ZeRO (:func:`owned_elements`: each replicated tensor split over the shard group, ``parallel.shard_size``
or every device; each expert tensor over its replicas in the group), per rank, in bytes:

| stage | weights | gradients | optimizer | accumulation (several micro-batches) | update copies |
|---|---|---|---|---|---|
| 0 | stored | ``4 trained`` | ``8 trained`` | ``4 trained`` | ``4 trained`` clipped + ``4 trained`` summed |
| 1 | stored | ``4 trained`` | ``12 owned`` (moments, working copy) | ``4 trained`` | ``4 owned`` + ``4 tensor`` |
| 2 | stored | ``4 layer + 4 owned`` | ``12 owned`` | ``4 owned`` | ``4 tensor`` |
| 3 | ``4 owned`` + frozen | ``4 layer + 4 owned`` | ``8 owned`` (no copy) | ``4 owned`` | ``4 tensor`` |

``tensor``: the largest trained tensor's range (an upper bound: over the fewer of its ranks). ZeRO clips range
by range inside the update and reads the accumulated sums in place (train/step.py): one scaled gradient at a
time.

``layer``: the trained elements of the largest decoder layer or MTP depth (or of the embedding or head, if
larger), whose whole gradients exist until their reduce-scatter inside the backward. Stage 3 also holds
whole weights gathered from their ranges (:func:`gathered_bytes`). Communication buffers: a reduced copy of the
gradients (stages 0-1: ``4 trained``; 2-3: ``4 layer``), plus the expert exchange (launch/plan.py).

With ``train.dtype`` bf16/fp16 the trained weights are stored in it (``c`` bytes; stage 3: ``c owned``) and their
fp32 masters are the ranges (``12 owned`` at every stage; one process without ZeRO: ``12 trained``); several
processes without ZeRO are refused, as the trainer refuses them. The 16 bytes per parameter of ZeRO (arXiv 1910.02054)
bound every layout from below (:func:`lower_bound_devices`).
"""

from dataclasses import dataclass
from types import SimpleNamespace

from mindmoe.launch.plan_activations import routed_rows_per_token
from mindmoe.launch.plan_params import RankParameters
from mindmoe.model.config import ModelConfig


@dataclass
class CommVolume:
    """Bytes one rank's collectives carry per step (the tensors they reduce or gather, whole size)."""

    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    all_reduce: float = 0.0
    all_to_all: float = 0.0


def reduces(layout) -> bool:
    """Whether gradients are reduced over ranks: several data-parallel replicas, or expert replicas."""
    return layout.dp > 1 or layout.expert_replicas > 1


def owned_elements(params: RankParameters, layout) -> float:
    """Trained elements whose ranges this rank owns under ZeRO: each rank's share of what the ranks holding a
    tensor (its shard group; the expert replicas in it for routed experts) keep once."""
    dense = params.trained - params.trained_experts
    return dense / layout.shard_ranks + params.trained_experts / layout.expert_shard_ranks


def state_memory(params: RankParameters, layout, micro_batches: int, setup) -> dict:
    """Weights, gradients, optimizer state, accumulation, update copies, gathered weights and gradient buffers of
    a rank (bytes by :class:`launch.plan.RankMemory` field), by ``parallel.zero`` stage (module docstring)."""
    trained, zero = params.trained, layout.zero
    # Half precision (train.dtype): trained weights stored in it, fp32 masters in the ranges (one process: whole).
    half = setup.compute_dtype != "fp32"
    owned = owned_elements(params, layout) if zero else trained
    accumulate = micro_batches > 1
    weights = params.weight_bytes - (4 - setup.compute_bytes) * trained * int(half)
    memory = SimpleNamespace(weights=weights, grads=4 * trained, accumulation=0.0, gathered=0.0)
    # Moments, and (stages 1-2) an fp32 working copy of each owned range; a ZeRO-3 range is its own master unless
    # the weights are half precision.
    memory.optimizer = (8 if zero in (0, 3) and not half else 12) * owned
    # ZeRO clips range by range inside the update and reads the accumulated sums in place (train/step.py): one
    # scaled gradient at a time; stage 1 also holds the reduce-scattered ranges it updates from.
    ranges = min(layout.shard_ranks, layout.expert_shard_ranks) if zero else 1
    memory.update = 4 * params.largest_tensor / ranges * int(setup.clip) + 4 * owned * int(zero == 1)
    if zero == 0:
        memory.update = 4 * trained * int(setup.clip) + 4 * trained * int(accumulate)
    if zero < 2:
        memory.accumulation = 4 * trained * int(accumulate)
        # A reduced copy of the gradients (all-reduce, or ZeRO-1's reduce-scatter input).
        memory.comm = 4 * trained if reduces(layout) else 0.0
        return vars(memory)
    # Stages 2-3: a parameter's whole gradient exists only until its reduce-scatter, inside the backward; count
    # one layer's (the largest) besides the ranges the step goes on with.
    layer = max(params.largest_layer, params.largest_outside)
    memory.grads = 4 * layer + 4 * owned
    memory.accumulation = 4 * owned * int(accumulate)
    memory.comm = 4 * layer if reduces(layout) else 0.0
    if zero == 3:
        stored = setup.compute_bytes if half else 4
        memory.weights = params.weight_bytes - 4 * trained + stored * owned
        memory.gathered = gathered_bytes(params, layout, setup)
    return vars(memory)


def gathered_bytes(params: RankParameters, layout, setup) -> float:
    """ZeRO-3: the whole weights held at once, in the dtype they are stored in. Without ``train.recompute``
    MindSpore keeps each all-gathered weight for the backward of the products that read it: every layer's at the
    end of the forward. With it, one layer at a time (two on Ascend, whose next all-gather overlaps the current
    layer's compute) and the larger of the embedding and the LM head, each gathered outside the layers."""
    per_element = setup.compute_bytes  # gathered in the dtype the weights are stored in
    if not layout.recompute:
        return per_element * params.trained
    layers = 2 if setup.device == "Ascend" else 1
    return per_element * (layers * params.largest_layer + params.largest_outside)


def comm_volume(cfg: ModelConfig, params: RankParameters, layout, batch, micro_batches: int, setup) -> CommVolume:
    """Bytes of the tensors one rank's collectives reduce or gather per step (whole size, not the ring's
    ``2 (n - 1) / n`` factor): gradients and weights by ``parallel.zero`` stage; the routed rows of the MoE
    layers' expert exchange (forward and backward)."""
    volume = CommVolume()
    trained = 4 * params.trained
    if reduces(layout):
        if layout.zero == 0:
            volume.all_reduce = trained
        elif layout.zero == 1:
            volume.reduce_scatter, volume.all_gather = trained, trained
        else:
            volume.reduce_scatter = trained * micro_batches
            gathers = 1 if layout.zero == 2 else micro_batches * (2 if layout.recompute else 1)
            # Weights travel in the dtype they are stored in.
            volume.all_gather = params.trained * setup.compute_bytes * gathers
        if layout.zero and layout.shard_replicas > 1:
            reductions = micro_batches if layout.zero >= 2 else 1
            volume.all_reduce = 4 * owned_elements(params, layout) * reductions
    if layout.ep > 1:
        rows = routed_rows_per_token(cfg, layout, setup.moe)
        moe_layers = cfg.num_moe_layers + cfg.mtp_layers
        exchanged = 2 * 2 * rows * batch.tokens * cfg.hidden_size * setup.compute_bytes * moe_layers * micro_batches
        if layout.routed:
            volume.all_to_all = exchanged
        else:  # allgather: the group's tokens gathered, the experts' outputs reduce-scattered, forward and backward
            group = 2 * layout.ep * batch.tokens * cfg.hidden_size * setup.compute_bytes * moe_layers * micro_batches
            volume.all_gather += group
            volume.reduce_scatter += group
    return volume


#: Bytes per trained parameter no layout goes below (ZeRO, arXiv 1910.02054): a half-precision weight and gradient, an
#: fp32 master and two fp32 moments, each held once over all devices.
LOWER_BOUND_BYTES_PER_PARAMETER = 16


def lower_bound_devices(total_parameters: int, budget: float) -> int:
    """The fewest devices of ``budget`` usable bytes that hold 16 bytes per parameter once."""
    return max(1, -(-LOWER_BOUND_BYTES_PER_PARAMETER * total_parameters // int(budget)))
