"""Per-device memory of a training layout, and the search for layouts that fit (``mindmoe-plan``).

Everything is computed from the config (parameter shapes from :mod:`model.param_count`); nothing is
allocated. Sizes are bytes; "GB" in config keys means GiB (2**30 bytes), the unit HBM is sold in.

Layout. ``devices = dp * tp * pp``. Attention, dense FFN, shared experts and embeddings are split
over ``tp`` (Megatron tensor parallelism *with sequence parallelism*, so activations are split too)
and over ``pp`` pipeline stages (contiguous blocks of layers, the first ``L % pp`` stages one layer
longer; stage 0 holds the input embedding, the last stage the final norm and the LM head, and a
copy of the embedding when it is tied and ``pp > 1``). Norms and the router are replicated over
``tp``. Routed experts are split over ``ep`` ranks taken from the ``dp * tp`` ranks of a stage
(MoE parallel folding, expert tensor parallelism 1): ``ep`` divides both ``dp * tp`` and the
expert count, and each expert is replicated over ``edp = dp * tp / ep`` ranks, which reduce its
gradients and (ZeRO) shard its optimizer state. Every layout is checked for the worst pipeline stage.

Precision (fixed; what GLM-scale pretraining uses): bf16 weights, fp32 master weights, fp32 Adam
``m`` and ``v``, gradients in ``plan.grad_dtype`` (fp32 by default, as Megatron does for bf16 runs).
With ``P = split / tp + replicated + experts / ep`` the parameters a device of a stage holds,
``S = split / (tp * dp) + replicated / dp + experts / (ep * edp)`` its share when sharded over its
data-parallel groups, and ``g`` = 4 (fp32) or 2 (bf16) bytes per gradient:

- weights     ``2 * P``
- gradients   ``g * P``; with ``zero=2`` ``g * S``
- optimizer   ``12 * P`` (master 4 + m 4 + v 4); with ``zero>=1`` ``12 * S`` (ZeRO-1, Rajbhandari
  et al. 2020; Megatron's distributed optimizer)

Activations (bf16, bytes per token of a micro-batch, then ``* seq_len * micro_batch / tp``): the
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count,
``34 h + 5 a s`` per layer, re-derived term by term for this network (no dropout, RMSNorm, GQA,
SwiGLU, MoE). ``h`` hidden, ``q = heads * head_dim``, ``kv = kv_heads * head_dim``, ``f`` dense
FFN width, ``f_e`` expert width, ``f_s = shared * f_e``, ``E`` experts, ``r`` expert copies per
token (``top_k * capacity_factor`` with capacity dispatch, ``top_k`` dropless), ``a`` query heads:

- attention ``4h`` (norm input, qkv input) ``+ 2(q + 2kv)`` (q, k, v after RoPE) ``+ 2q`` (o_proj
  input) ``+ 2(q + kv)`` if QK-norm (its inputs) ``+`` scores: ``4a`` (fp32 log-sum-exp) with flash
  attention, else ``2 a s`` (the stored softmax, Korthikanti's ``5as`` without the dropout terms)
- dense FFN ``4h`` (norm input, FFN input) ``+ 6f`` (gate, up, silu(gate)*up)
- MoE FFN ``4h + 8E`` (fp32 router logits and scores) ``+ r (4h + 6 f_e)`` (each dispatched copy:
  expert input, gate, up, product, expert output) ``+ 6 f_s`` (shared experts)
- last stage ``4h + 4V`` (final norm input, LM-head input, fp32 logits for the loss)

Check: MHA with a 4h GeLU MLP, dropout masks added back, gives Korthikanti's ``34h + 5as``.
Full recomputation keeps only each layer's input ``2h`` and rebuilds one layer at a time in the
backward pass, so a stage holds ``in_flight * layers * 2h`` plus its largest layer's full set.
1F1B pipelining keeps ``in_flight = min(pp - stage, micro-batches per step)`` micro-batches alive.

Communication buffers (a fixed estimate, bf16): two gradient buckets of ``plan.grad_bucket_mb``
MiB when gradients are reduced (``dp > 1`` or ``edp > 1``); all-to-all send and receive buffers for one MoE layer
``2 * tokens/tp * r * h * 2`` when ``ep > 1``; sequence-parallel all-gather and reduce-scatter
buffers ``2 * tokens * h * 2`` when ``tp > 1``; pipeline send/receive of activations and their
gradients ``4 * tokens/tp * h * 2`` when ``pp > 1``. A layout fits when the sum is at most
``device_memory_gb - reserved_gb`` (runtime workspace, HCCL, fragmentation).
"""

from dataclasses import dataclass
from math import gcd, prod
from typing import Dict, List, Optional

from mindmoe.launch.config import (
    GRAD_BYTES,
    PlanConfig,
    validate_plan_config,  # noqa: F401 (launch/plan_cli.py imports it from here)
)
from mindmoe.model.config import ModelConfig
from mindmoe.model.param_count import layer_index, parameter_category, parameter_shapes

GIB = 2**30
MIB = 2**20
#: Bytes per parameter: bf16 weights; fp32 master weights + Adam m and v.
WEIGHT_BYTES, OPTIMIZER_BYTES, ACT_BYTES = 2, 12, 2


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    ep: int
    zero: int = 1
    recompute: bool = False

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def edp(self) -> int:
        """Replicas of each expert (its gradient-reduction and optimizer-sharding group)."""
        return self.dp * self.tp // self.ep


@dataclass(frozen=True)
class Batch:
    seq_len: int
    micro_batch: int
    global_batch: int


@dataclass
class StageMemory:
    """Bytes on one device of pipeline stage ``stage``."""

    stage: int
    layers: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    comm: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.comm


@dataclass
class Plan:
    layout: Layout
    stages: List[StageMemory]
    micro_batches: int
    tokens_per_step: int
    #: Bytes a device may use: ``device_memory_gb - reserved_gb``.
    budget: float = 0.0

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.budget

    @property
    def bubble(self) -> float:
        """Idle share of a 1F1B step, ``(pp - 1) / (m + pp - 1)``."""
        pp = self.layout.pp
        return (pp - 1) / (self.micro_batches + pp - 1)


def layout_errors(cfg: ModelConfig, layout: Layout, batch: Batch) -> List[str]:
    """Why ``layout`` cannot run ``cfg`` (empty when it can)."""
    errors = []
    if min(layout.dp, layout.tp, layout.pp, layout.ep) < 1:
        return ["every parallel degree (parallel.dp, parallel.ep, plan.tp, plan.pp) must be >= 1"]
    if min(batch.seq_len, batch.micro_batch, batch.global_batch) < 1:
        return ["data.seq_len, data.micro_batch_size and data.global_batch_size must be >= 1"]
    if cfg.num_heads % layout.tp or cfg.num_kv_heads % layout.tp:
        errors.append(
            f"plan.tp={layout.tp} must divide model.num_heads={cfg.num_heads} and model.num_kv_heads={cfg.num_kv_heads}"
        )
    if batch.seq_len % layout.tp:
        errors.append(f"plan.tp={layout.tp} must divide data.seq_len={batch.seq_len} (sequence parallelism)")
    if layout.pp > cfg.num_layers:
        errors.append(f"plan.pp={layout.pp} exceeds model.num_layers={cfg.num_layers}")
    if cfg.num_experts % layout.ep or (layout.dp * layout.tp) % layout.ep:
        errors.append(
            f"parallel.ep={layout.ep} must divide model.num_experts={cfg.num_experts} and "
            f"parallel.dp*plan.tp={layout.dp * layout.tp}"
        )
    if batch.global_batch % (layout.dp * batch.micro_batch):
        errors.append(
            f"data.global_batch_size={batch.global_batch} must be a multiple of "
            f"parallel.dp*data.micro_batch_size={layout.dp * batch.micro_batch}"
        )
    return errors


def stage_layers(num_layers: int, pp: int) -> List[range]:
    """Contiguous layer blocks; the first ``num_layers % pp`` stages get one more layer."""
    base, extra = divmod(num_layers, pp)
    blocks, start = [], 0
    for stage in range(pp):
        size = base + (stage < extra)
        blocks.append(range(start, start + size))
        start += size
    return blocks


def stage_parameters(cfg: ModelConfig, pp: int) -> List[Dict[str, int]]:
    """Per stage: parameters split over tp (``split``), replicated over tp (``replicated``), experts."""
    stage_of_layer = {layer: stage for stage, block in enumerate(stage_layers(cfg.num_layers, pp)) for layer in block}
    stages = [{"split": 0, "replicated": 0, "experts": 0} for _ in range(pp)]
    for name, shape in parameter_shapes(cfg).items():
        layer = layer_index(name)
        if layer >= 0:
            holders = [stage_of_layer[layer]]
        elif name.startswith("embed_tokens."):
            # A tied embedding is also the LM head: the last stage keeps a copy (Megatron does).
            holders = [0, pp - 1] if cfg.tie_word_embeddings and pp > 1 else [0]
        else:
            holders = [pp - 1]
        category = parameter_category(name)
        kind = "experts" if category == "experts" else "replicated" if category in ("norms", "router") else "split"
        for stage in holders:
            stages[stage][kind] += prod(shape)
    return stages


def activation_bytes_per_token(cfg: ModelConfig, moe: bool, seq_len: int, flash_attention: bool) -> int:
    """Bytes one token leaves alive in one decoder layer until its backward (module docstring)."""
    hidden, head_dim = cfg.hidden_size, cfg.resolved_head_dim
    q_width, kv_width = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    attention = 4 * hidden + 2 * (q_width + 2 * kv_width) + 2 * q_width
    if cfg.qk_norm:
        attention += 2 * (q_width + kv_width)
    attention += 4 * cfg.num_heads if flash_attention else 2 * cfg.num_heads * seq_len
    if not moe:
        return attention + 4 * hidden + 6 * cfg.intermediate_size
    copies = expert_copies(cfg)
    shared_width = cfg.num_shared_experts * cfg.moe_intermediate_size
    ffn = 4 * hidden + 8 * cfg.num_experts + copies * (4 * hidden + 6 * cfg.moe_intermediate_size) + 6 * shared_width
    return attention + ffn


def expert_copies(cfg: ModelConfig) -> float:
    """Expert inputs per token: top_k, padded by the capacity factor when tokens can be dropped."""
    return cfg.top_k * (cfg.capacity_factor if cfg.dispatch == "capacity" else 1.0)


def plan_layout(
    cfg: ModelConfig,
    layout: Layout,
    batch: Batch,
    plan: PlanConfig,
    stage_params: Optional[List[Dict[str, int]]] = None,
) -> Plan:
    """Per-device memory of every pipeline stage of ``layout`` (formulas in the module docstring).

    ``stage_params`` is :func:`stage_parameters` for ``layout.pp``, when the caller already has it.
    """
    errors = layout_errors(cfg, layout, batch)
    if errors:
        raise ValueError("; ".join(errors))
    if stage_params is None:
        stage_params = stage_parameters(cfg, layout.pp)
    dp, tp, pp, ep, edp = layout.dp, layout.tp, layout.pp, layout.ep, layout.edp
    grad_bytes = GRAD_BYTES[plan.grad_dtype]
    micro_batches = batch.global_batch // (dp * batch.micro_batch)
    tokens = batch.seq_len * batch.micro_batch
    local_tokens = tokens / tp
    hidden = cfg.hidden_size
    stages = []
    for stage, (params, block) in enumerate(zip(stage_params, stage_layers(cfg.num_layers, pp))):
        held = params["split"] / tp + params["replicated"] + params["experts"] / ep
        sharded = params["split"] / (tp * dp) + params["replicated"] / dp + params["experts"] / (ep * edp)
        weights = WEIGHT_BYTES * held
        grads = grad_bytes * (sharded if layout.zero >= 2 else held)
        optimizer = OPTIMIZER_BYTES * (sharded if layout.zero >= 1 else held)

        in_flight = min(pp - stage, micro_batches)
        per_layer = [
            activation_bytes_per_token(cfg, layer >= cfg.first_k_dense, batch.seq_len, plan.flash_attention)
            for layer in block
        ]
        if layout.recompute:
            per_token = in_flight * len(block) * ACT_BYTES * hidden + max(per_layer, default=0)
        else:
            per_token = in_flight * sum(per_layer)
        if stage == pp - 1:
            per_token += 4 * hidden + 4 * cfg.vocab_size
        activations = local_tokens * per_token

        comm = 0.0
        if dp > 1 or edp > 1:
            comm += 2 * plan.grad_bucket_mb * MIB
        if ep > 1:
            comm += 2 * local_tokens * expert_copies(cfg) * hidden * ACT_BYTES
        if tp > 1:
            comm += 2 * tokens * hidden * ACT_BYTES
        if pp > 1:
            comm += 4 * local_tokens * hidden * ACT_BYTES
        stages.append(StageMemory(stage, len(block), weights, grads, optimizer, activations, comm))
    return Plan(
        layout,
        stages,
        micro_batches,
        batch.global_batch * batch.seq_len,
        budget=(plan.device_memory_gb - plan.reserved_gb) * GIB,
    )


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_layouts(cfg: ModelConfig, devices: int, batch: Batch, plan: PlanConfig) -> List[Plan]:
    """Every valid layout of exactly ``devices`` that fits, smallest first.

    Tried: ``tp`` up to ``plan.max_tp``, every ``pp``, every ``ep`` dividing ``gcd(E, dp*tp)``,
    recompute off and on; ``plan.zero`` as configured. Smallest = fewest devices per model
    replica of the dense part (``tp * pp``), then no recompute before recompute, then the
    smallest ``ep`` (least all-to-all traffic), then the lowest memory.
    """
    fitting = []
    params_by_pp = {}
    for tp in divisors(devices):
        if tp > plan.max_tp:
            break
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            if pp <= cfg.num_layers and pp not in params_by_pp:
                params_by_pp[pp] = stage_parameters(cfg, pp)
            for ep in divisors(gcd(cfg.num_experts, dp * tp)):
                for recompute in (False, True):
                    layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=plan.zero, recompute=recompute)
                    if layout_errors(cfg, layout, batch):
                        continue
                    candidate = plan_layout(cfg, layout, batch, plan, params_by_pp[pp])
                    if candidate.fits:
                        fitting.append(candidate)
    fitting.sort(key=lambda p: (p.layout.tp * p.layout.pp, p.layout.recompute, p.layout.ep, p.worst.total))
    return fitting
