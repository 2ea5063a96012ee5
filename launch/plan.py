"""Per-rank memory of a layout of the trainer as it is, and the search for layouts that fit (``mindmoe-plan``).

Everything is computed from the config (parameter shapes from :mod:`model.param_count`); nothing is
allocated. Sizes are bytes; "GB" in config keys means GiB (2**30 bytes), the unit HBM is sold in.

Layout: the trainer's ``parallel.dp``, ``parallel.ep``, ``parallel.ep_dispatcher`` and ``train.recompute``
(resolved and checked by :func:`conf.checks.resolve_layout`, as ``mindmoe-launch`` does). Routed experts
are split over the ``ep`` ranks of an expert group; attention, dense FFN, shared experts, router, norms,
embedding and LM head are held whole by every rank. ``allgather``: the ``ep`` ranks of a group read the
same micro-batch (one data-parallel replica, ``devices = dp * ep``) and repeat the non-expert work;
``alltoall``: every rank reads its own micro-batch (``devices = dp``) and sends each routed row to the
rank of its expert. There is no tensor or pipeline parallelism. ``parallel.zero`` 1-3 splits the optimizer state,
then the gradients, then the weights of a tensor over the ranks holding the same copy of it: every rank
(``devices``) for the replicated tensors, the expert replicas for the routed experts.

Stored state per rank (:mod:`launch.plan_params` for the dtypes and what is trained), of every tensor
:func:`model.param_count.parameter_shapes` lists, the ``model.mtp_layers`` depths (``mtp_layers.{k}.*``) and
the DSA indexers included: weights fp32 (with LoRA the frozen matrices in ``lora.base_dtype``, adapters fp32);
gradients, AdamW state, accumulation sums and the update's gradient copies by ``parallel.zero`` stage, and the
whole weights ZeRO-3 all-gathers, in :mod:`launch.plan_state` (``trained`` = every parameter, or the adapters and
``lora.modules_to_save``). ``parallel.shard_size`` splits ranges over a shard group instead of every rank.

Activations, per token of one micro-batch (``T = seq_len * micro_batch_size`` tokens on every rank),
``c`` bytes per element of ``train.dtype``; ``h`` hidden, ``q = heads * head_dim``, ``kv = kv_heads *
head_dim``, ``f`` dense FFN width, ``f_e`` expert width, ``f_s = shared * f_e``, ``E`` experts, ``a``
query heads, ``s`` = seq_len, ``r`` routed rows per token (below):

- attention ``c (2h + 2q + 2kv)`` (norm input, qkv input, q/k/v after RoPE, o_proj input) ``+ c (q + kv)``
  with QK-norm ``+`` scores: ``4a`` (fp32 log-sum-exp) with blockwise attention (Ascend, ``s`` past
  ``BLOCK_SIZE``), else ``c a s`` (the stored softmax); the full-mask path also keeps one fp32
  ``[B, a, s, s]`` mask for all layers, ``4 a s`` per token
- MLA attention (``model.attention_type=mla``, model/mla.py) in place of the GQA widths, the same scores
  and mask: ``c (2h + 2 r_q + 2 r_kv + 2 a d_qk + 2 a d_v)`` with ``r_q`` = q_lora_rank (0 when null: one
  q_proj reads the normed input), ``r_kv`` = kv_lora_rank, ``d_qk`` = qk_nope_head_dim + qk_rope_head_dim,
  ``d_v`` = v_head_dim: norm input, normed input (read by q_a_proj or q_proj, kv_a_proj_with_mqa and the
  indexer), q_a_layernorm input and q_b_proj input, kv_a_layernorm input and kv_b_proj input, queries
  ``[nope, RoPE(rope)]`` per head, keys ``[nope, RoPE(shared rope key)]`` per head (the one rope key
  broadcast to every head), values, o_proj input ``a d_v``. RoPE is linear, so its inputs are not kept
- DSA indexer (``model.dsa``, with ``index_n_heads`` ``n_I`` > 0 and ``dsa.stage`` not ``off``; the model's
  design, :func:`launch.plan_activations.dsa_indexer_bytes_per_token`), per MLA layer: ``c (n_I d_I + 2 d_I +
  n_I)`` (query after RoPE, key before its LayerNorm and after LayerNorm and RoPE, head weights; ``d_I`` =
  index_head_dim). Up to ``BLOCK_SIZE`` positions DSA layers take the whole mask and keep the softmax (above)
  and ``+ 4 n_I s`` (the ReLU'd products of every indexer head, fp32) ``+ 4s`` (fp32 index scores, summed over
  the indexer heads) ``+ 4s`` (selection mask) ``+ 4s`` (the indexer's softmax the KL loss keeps, in
  dense_warmup and sparse alike). Past it, on every device, the ``indexed_attention`` kernel
  (model/kernels/cpu_dsa.py) keeps none of these, no scores and no mask; its backward holds one block of
  queries at a time, once per micro-batch: ``4 B BLOCK_SIZE s (3a + 4 n_I)`` (``B`` the micro-batch;
  ``DSA_BLOCK_TENSORS``). dense_warmup's frozen main model is not modelled: the run goes on in sparse, which
  trains everything
- dense FFN ``c (2h + 3f)`` (norm input, FFN input, gate, up, product)
- MoE FFN ``2 c h + 8E`` (fp32 router logits and scores) ``+ r c (2h + 3 f_e) + 3 c f_s``
- after the last layer ``c h`` (final norm input) and the chunked loss (``model/lm_loss.py``): no
  ``[T, V]`` fp32 tensor beyond one chunk of ``LOSS_CHUNK_BYTES``; the loss holds about
  ``LOSS_BUFFERS`` chunk-sized buffers while it runs, and keeps the gradients it computes in the forward for
  the backward: the rows' ``4h`` per token, and the head's ``4 V h`` when the head trains (over several chunks
  twice more: its running sum in the chunk loop)
- MTP depths (``model.mtp_layers`` = U, model/mtp.py), kept whole also with ``train.recompute`` (it rebuilds
  the main layers only): each depth its MoE layer (above; its input is eh_proj's output) ``+ c (h + 2h + h +
  h)`` (the embedding enorm reads, the ``[2h]`` concatenation eh_proj reads, the block output that
  shared_head.norm and the next depth's hnorm read, the depth's normed rows its loss reads) and one more
  chunked loss's kept bytes (the losses run one after another: one set of chunk buffers); once ``c h``, the
  main model's final-normed rows depth 1's hnorm reads

Routed rows per token ``r`` (grouped dropless experts run on the routed rows only): dropless, one
process or ``allgather``: ``top_k`` (every rank of a group runs its experts over the whole sorted buffer);
dropless ``alltoall``: ``ep * min(top_k, E/ep)`` (each rank receives a fixed worst-case slot from every
rank of its group, :mod:`train.parallel.grouped_exchange`); capacity dispatch: ``top_k * capacity_factor``.
``train.recompute`` keeps each main layer's input ``c h`` and rebuilds one layer at a time. The backward
pass adds the gradients of one layer's activations (``max layer``, MTP blocks included) on top.

Communication buffers (estimates): reduced gradients (:mod:`launch.plan_state`); ``2 r T h c`` for the expert
exchange when ``ep > 1`` (sent and received rows, or the summed expert outputs of ``allgather``). A layout
fits when the sum is at most ``device_memory_gb - reserved_gb`` (runtime workspace, HCCL, fragmentation).

``plan.device=CPU``: the host's memory is the device's, and MindSpore's CPU runtime holds three more
terms, each printed on its own line. None follows from a tensor of mindmoe's code, so each is a named
constant measured on MindSpore 2.9, 2-core x86 (RSS of one ``mindmoe-train`` process sampled through its
phases: built, compiled, stepping; one factor changed at a time around the tiny model at 1,024 tokens):

- optimizer library ``CPU_OPTIMIZER_LIBRARY_BYTES``: train/optim.py imports mindformers (AdamW, the
  LR schedule) when the optimizer is built, after the framework baseline (``import mindspore,
  mindmoe.train.trainer``) that measurements subtract;
- compiled graphs ``CPU_GRAPH_BASE_BYTES + CPU_GRAPH_BYTES_PER_LAYER * layers``: the IR and kernels of
  the ``ms.jit`` step functions of train/step.py (a fused step, or accumulate + apply: the same
  nodes). One copy per decoder layer (MTP blocks counted as layers, not measured): ``lazy_inline`` cell
  reuse fails on CPU. Independent of tokens, positions and width (measured at 1,024 / 2,048 tokens,
  128 / 256 positions, hidden 192 / 384);
- runtime buffers ``4 * CPU_RUNTIME_HIDDEN_ROWS * h`` per token and decoder layer whose activations
  are kept: what the step holds beyond the activations above. model/kernels/cpu_attention.py records
  two causes (an elementwise op with an implicitly broadcast operand keeps its output to the end of the
  graph; kernels run as soon as their inputs exist, so outputs computed early are held); which
  tensors they are was not traced. The bytes followed tokens, layers and ``h`` (at the same FFN and
  expert widths) and not positions, so they are counted in rows of ``h``. With ``train.recompute``
  they are counted for the one rebuilt layer (not measured); MTP blocks are kept layers (not measured).
"""

from dataclasses import dataclass, field, fields
from math import gcd
from typing import List

from mindmoe.conf.checks import resolve_layout
from mindmoe.launch.config import PlanConfig, validate_plan_config  # noqa: F401 (plan_cli imports it from here)
from mindmoe.launch.plan_activations import (  # noqa: F401 (the planner's names: plan_report imports some from here)
    BLOCK_SIZE,
    LOSS_BUFFERS,
    LOSS_CHUNK_BYTES,
    activation_bytes_per_token,
    activation_memory,
    dsa_active,
    full_mask,
    loss_bytes,
    routed_rows_per_token,
)
from mindmoe.launch.plan_params import Trained, rank_parameters
from mindmoe.launch.plan_state import CommVolume, comm_volume, state_memory
from mindmoe.model.config import ModelConfig
from mindmoe.model.moe_config import MoEConfig

GIB = 2**30
#: model/attention.py BLOCKWISE_DEVICES (copied so that a plan imports no MindSpore; tests/unit/test_plan.py checks
#: it and BLOCK_SIZE); BLOCK_SIZE and the loss's constants are in launch/plan_activations.py.
BLOCKWISE_DEVICES = ("Ascend",)
#: Bytes per element of ``train.dtype``.
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: CPU only (module docstring). RSS of ``import mindformers`` above the framework baseline: 0.347 GiB.
CPU_OPTIMIZER_LIBRARY_BYTES = 0.35 * GIB
#: CPU only: RSS added while the step compiles (before it first runs): 0.37 GiB at 2 decoder layers,
#: 0.62 GiB at 4 (0.125 GiB a layer; the rest, embedding, head, loss and optimizer, 0.12 GiB).
CPU_GRAPH_BYTES_PER_LAYER = 0.125 * GIB
CPU_GRAPH_BASE_BYTES = 0.12 * GIB
#: CPU only: fp32 rows of width ``h`` per token and decoder layer held beyond the modelled activations: peak
#: RSS above the baseline less every other term of the plan, in rows. Tiny model, 4 layers: 90 at 2,048
#: tokens, 94 at 1,024; from 2 to 4 layers: 118; from hidden 192 to 384 (same FFN and expert widths): 104;
#: 256 instead of 128 positions changed nothing. A round figure inside that spread.
CPU_RUNTIME_HIDDEN_ROWS = 100


@dataclass(frozen=True)
class Layout:
    dp: int
    ep: int = 1
    dispatcher: str = "allgather"
    recompute: bool = False
    #: ``parallel.zero`` (0-3) and ``parallel.shard_size`` (0: shard over every rank holding a copy).
    zero: int = 0
    shard_size: int = 0

    @property
    def shard_ranks(self) -> int:
        """Ranks a replicated tensor's ranges are split over (ZeRO): the shard group, or every device."""
        return self.shard_size or self.devices

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks a routed expert tensor's ranges are split over (ZeRO): those of its replicas in a shard group."""
        return self.shard_size // self.ep if self.shard_size else self.expert_replicas

    @property
    def shard_replicas(self) -> int:
        """Copies of each range (hybrid sharding): the shard groups."""
        return self.devices // self.shard_ranks

    @property
    def routed(self) -> bool:
        return self.dispatcher == "alltoall" and self.ep > 1

    @property
    def devices(self) -> int:
        return self.dp if self.routed else self.dp * self.ep

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (they reduce those experts' gradients)."""
        return self.dp // self.ep if self.routed else self.dp

    def keys(self) -> str:
        """The trainer's keys of this layout (``mindmoe-launch`` also needs the process count)."""
        dispatcher = f" parallel.ep_dispatcher={self.dispatcher}" if self.ep > 1 else ""
        shard = f" parallel.shard_size={self.shard_size}" if self.shard_size else ""
        return (
            f"parallel.dp={self.dp} parallel.ep={self.ep}{dispatcher} parallel.zero={self.zero}{shard} "
            f"train.recompute={str(self.recompute).lower()}"
        )


@dataclass(frozen=True)
class Batch:
    seq_len: int
    micro_batch: int
    global_batch: int

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch


@dataclass(frozen=True)
class Setup:
    """What the run is, besides its layout: the device it plans for, ``train.dtype``, what is trained."""

    device: str = "Ascend"
    compute_dtype: str = "fp32"
    trained: Trained = Trained()
    #: ``train.grad_clip > 0``: the update reads a clipped copy of the gradients.
    clip: bool = True
    #: ``moe.*``, ``dispatch`` resolved (capacity dispatch buffers ``capacity_factor`` rows per assignment).
    moe: MoEConfig = field(default_factory=lambda: MoEConfig(dispatch="capacity"))
    #: ``dsa.stage``: off plans no indexer activations (the indexer is stored and trained, but does not run).
    dsa_stage: str = "sparse"

    @property
    def compute_bytes(self) -> int:
        return COMPUTE_BYTES[self.compute_dtype]

    def blockwise(self, seq_len: int) -> bool:
        return self.device in BLOCKWISE_DEVICES and seq_len > BLOCK_SIZE


@dataclass
class RankMemory:
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    accumulation: float = 0.0
    update: float = 0.0
    activations: float = 0.0
    loss: float = 0.0
    #: ZeRO-3: whole weights all-gathered from their ranges while layers compute (and their compute-dtype casts).
    gathered: float = 0.0
    comm: float = 0.0
    #: CPU only (module docstring): MindSpore's runtime buffers, compiled graphs, the optimizer's library.
    runtime_buffers: float = 0.0
    graphs: float = 0.0
    library: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass
class Plan:
    layout: Layout
    memory: RankMemory
    micro_batches: int
    tokens_per_step: int
    #: Bytes a device may use: ``device_memory_gb - reserved_gb``.
    budget: float = 0.0
    comm: CommVolume = field(default_factory=CommVolume)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget


def layout_errors(cfg: ModelConfig, layout: Layout, batch: Batch, setup: Setup = None) -> List[str]:
    """Why the trainer would refuse ``layout`` (empty when it takes it), in its own words."""
    if setup is not None and setup.compute_dtype != "fp32" and not layout.zero and layout.devices > 1:
        return [f"train.dtype={setup.compute_dtype} keeps fp32 masters in ZeRO ranges: set parallel.zero to 1, 2 or 3"]
    try:
        resolve_layout(
            layout.devices,
            layout.dp,
            layout.ep,
            cfg.num_experts,
            batch.global_batch,
            batch.micro_batch,
            cfg.num_moe_layers > 0,
            layout.dispatcher,
            layout.shard_size,
            layout.zero,
        )
    except ValueError as error:
        return [str(error)]
    return []


def plan_layout(
    cfg: ModelConfig, layout: Layout, batch: Batch, plan: PlanConfig, setup: Setup = Setup(), params=None
) -> Plan:
    """Per-rank memory of ``layout`` (formulas in the module docstring); ValueError if the trainer refuses it.
    ``params``: :func:`launch.plan_params.rank_parameters` of ``layout.ep`` when the caller has it."""
    errors = layout_errors(cfg, layout, batch, setup)
    if errors:
        raise ValueError("; ".join(errors))
    if params is None:
        params = rank_parameters(cfg, setup.trained, layout.ep)
    micro_batches = batch.global_batch // (layout.dp * batch.micro_batch)
    memory = RankMemory(**state_memory(params, layout, micro_batches, setup))
    memory.activations = activation_memory(cfg, layout, batch, setup)
    head = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    memory.loss = loss_bytes(cfg, batch.tokens, setup.trained.trains_in_full(head))
    if layout.ep > 1:
        rows = routed_rows_per_token(cfg, layout, setup.moe)
        memory.comm += 2 * rows * batch.tokens * cfg.hidden_size * setup.compute_bytes
    if setup.device == "CPU":
        add_cpu_runtime(memory, cfg, layout, batch)
    return Plan(
        layout,
        memory,
        micro_batches,
        batch.global_batch * batch.seq_len,
        budget=(plan.device_memory_gb - plan.reserved_gb) * GIB,
        comm=comm_volume(cfg, params, layout, batch, micro_batches, setup),
    )


def add_cpu_runtime(memory: RankMemory, cfg: ModelConfig, layout: Layout, batch: Batch) -> None:
    """The three CPU runtime terms (module docstring); fp32, the only dtype the trainer runs on CPU."""
    memory.runtime_buffers = batch.tokens * cpu_kept_layers(cfg, layout) * 4 * CPU_RUNTIME_HIDDEN_ROWS * cfg.hidden_size
    memory.graphs = CPU_GRAPH_BASE_BYTES + CPU_GRAPH_BYTES_PER_LAYER * (cfg.num_layers + cfg.mtp_layers)
    memory.library = CPU_OPTIMIZER_LIBRARY_BYTES


def cpu_kept_layers(cfg: ModelConfig, layout: Layout) -> int:
    """Decoder layers whose activations are kept: every main layer, or the one rebuilt with recompute; plus
    the MTP depths' blocks, which ``train.recompute`` does not rebuild."""
    return (1 if layout.recompute else cfg.num_layers) + cfg.mtp_layers


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shard_sizes(devices: int, ep: int) -> List[int]:
    """``parallel.shard_size`` values of a search: 0 (every rank) and each proper divisor of ``devices`` that is a
    multiple of ``ep`` and at least 8 (a node of Ascend devices or more)."""
    return [0] + [d for d in divisors(devices) if d < devices and d % ep == 0 and d >= 8]


def candidate_layouts(
    cfg: ModelConfig, devices: int, recompute_options=(False, True), zero_options=(0, 1, 2, 3), shard_options=None
) -> List[Layout]:
    """Every layout of exactly ``devices`` ranks the trainer has: each ``ep`` dividing ``gcd(E, devices)`` with
    both dispatchers, recompute off and on, each ``parallel.zero`` of ``zero_options`` with each shard size of
    ``shard_options`` (None: :func:`shard_sizes`; only stages 1-3 shard)."""
    eps = divisors(gcd(cfg.num_experts, devices)) if cfg.num_moe_layers else [1]
    layouts = []
    for ep in eps:
        shards = shard_sizes(devices, ep) if shard_options is None else shard_options
        for dispatcher in ("allgather", "alltoall") if ep > 1 else ("allgather",):
            dp = devices if dispatcher == "alltoall" else devices // ep
            for zero in zero_options:
                for shard in shards if zero else (0,):
                    layouts += [Layout(dp, ep, dispatcher, recompute, zero, shard) for recompute in recompute_options]
    return layouts


def planned_candidates(
    cfg: ModelConfig,
    devices: int,
    batch: Batch,
    plan: PlanConfig,
    setup: Setup = Setup(),
    recompute_options=(False, True),
    zero_options=(0, 1, 2, 3),
    shard_options=None,
) -> List[Plan]:
    """The plan of every layout of ``devices`` ranks that the trainer takes (fitting or not), best first.

    Best: fits, then no recompute before recompute (a third less compute), then the smallest ``ep`` (the
    least repeated attention or exchanged rows), then ``alltoall`` before ``allgather`` (more data-parallel
    replicas for the same devices), then the lowest ZeRO stage (the least communication), then the smallest
    shard group (hybrid sharding: gradients cross nodes once, reduced), then the lowest memory.
    """
    by_ep = {}
    plans = []
    for layout in candidate_layouts(cfg, devices, recompute_options, zero_options, shard_options):
        if layout_errors(cfg, layout, batch, setup):
            continue
        if layout.ep not in by_ep:
            by_ep[layout.ep] = rank_parameters(cfg, setup.trained, layout.ep)
        plans.append(plan_layout(cfg, layout, batch, plan, setup, by_ep[layout.ep]))
    plans.sort(
        key=lambda p: (
            not p.fits,
            p.layout.recompute,
            p.layout.ep,
            p.layout.dispatcher != "alltoall",
            p.layout.zero,
            p.layout.shard_ranks,
            p.memory.total,
        )
    )
    return plans


def search_layouts(
    cfg: ModelConfig,
    devices: int,
    batch: Batch,
    plan: PlanConfig,
    setup: Setup = Setup(),
    recompute_options=(False, True),
    zero_options=(0, 1, 2, 3),
    shard_options=None,
) -> List[Plan]:
    """Every layout of ``devices`` ranks that the trainer takes and that fits, best first."""
    candidates = planned_candidates(cfg, devices, batch, plan, setup, recompute_options, zero_options, shard_options)
    return [p for p in candidates if p.fits]
