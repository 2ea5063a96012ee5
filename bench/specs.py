"""The benchmark models and batch sizes: a dense and an MoE decoder with equal active parameters.

Both are GLM-4.5 shaped (GQA, q/k/v bias, QK-norm, partial RoPE). The MoE model replaces every
dense SwiGLU of width ``2 I`` by 8 experts of width ``I`` with top-2 routing and no shared expert,
so a token multiplies through the same FFN weights in both (plus the MoE router's ``H x E``).
"""

import dataclasses
from dataclasses import dataclass

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe_config import MoEConfig


@dataclass(frozen=True)
class BenchSize:
    """One benchmark scale: the model shape, the micro-batch and how many steps are timed."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    expert_width: int  # routed expert width I; the dense FFN is 2 I wide
    vocab_size: int
    seq_len: int
    micro_batch: int
    timed_steps: int
    warmup_steps: int
    gemm_size: int
    compile_layers: tuple  # layer counts of compile_scaling
    compile_hidden: int
    data_windows: int  # windows written for data_pipeline
    data_batches: int  # batches read (timed) by data_pipeline


FULL = BenchSize(
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    expert_width=512,
    vocab_size=8192,
    seq_len=512,
    micro_batch=4,
    timed_steps=5,
    warmup_steps=4,  # the compile step, then steps still slower than the rest (MindSpore and PyTorch alike)
    gemm_size=2048,
    compile_layers=(2, 8, 24),
    compile_hidden=128,
    data_windows=512,
    data_batches=64,
)
QUICK = BenchSize(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    expert_width=32,
    vocab_size=256,
    seq_len=32,
    micro_batch=2,
    timed_steps=1,
    warmup_steps=1,
    gemm_size=256,
    compile_layers=(1, 2),
    compile_hidden=32,
    data_windows=32,
    data_batches=8,
)
SIZES = {"full": FULL, "quick": QUICK}

NUM_EXPERTS = 8
TOP_K = 2
CAPACITY_FACTOR = 1.25


def model_config(size: BenchSize, kind: str, num_layers: int = 0, hidden_size: int = 0) -> ModelConfig:
    """``kind`` is ``dense`` or ``moe``; ``num_layers``/``hidden_size`` override the size's (compile_scaling)."""
    hidden = hidden_size or size.hidden_size
    scale = hidden / size.hidden_size
    layers = num_layers or size.num_layers
    base = ModelConfig(
        vocab_size=size.vocab_size,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=size.num_heads,
        num_kv_heads=size.num_kv_heads,
        qkv_bias=True,
        qk_norm=True,
        partial_rotary_factor=0.5,
        max_position_embeddings=max(4096, size.seq_len),
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        num_shared_experts=0,
        moe_intermediate_size=int(size.expert_width * scale),
        intermediate_size=int(TOP_K * size.expert_width * scale),
        score_func="softmax",
    )
    if kind == "dense":
        return dataclasses.replace(base, first_k_dense=layers)
    if kind == "moe":
        return dataclasses.replace(base, first_k_dense=0)
    raise ValueError(f"model kind {kind!r}: expected 'dense' or 'moe'")


#: The MoE policy every bench model trains with: capacity dispatch, the switch aux loss and the z-loss.
BENCH_MOE = MoEConfig(dispatch="capacity", capacity_factor=CAPACITY_FACTOR, aux_loss="switch", z_loss_coeff=1e-3)


def theoretical_train_bytes(num_params: int) -> int:
    """fp32 params + grads + AdamW's two moments: 16 bytes per trained parameter."""
    return 16 * num_params


def activation_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """fp32 bytes of the tensors the train step keeps from forward for backward, from their shapes.

    Per token and layer: input and output of both RMSNorms (4 H); q, k, v, and q, k after QK-norm and
    RoPE; the softmax probabilities (N x the keys a query sees: S x the share of the score matrix the
    causal chunks compute, :func:`model.attention.causal_chunks`); the attention output (N D). The
    FFN keeps gate, up, silu(gate) and their product (4 I); an MoE layer keeps those per expert slot
    (top_k slots per token, times capacity_factor with capacity dispatch) plus each slot's input and
    output row (2 H), the router's logits and probabilities (2 E) and the shared experts' 4 I. Once
    per step: the embedding output (H), the final norm (2 H), the logits and their softmax (2 V) and
    the document-causal mask (N x the keys). A framework that keeps more shows a higher RSS ratio.
    """
    from mindmoe.model.attention import causal_chunks

    chunks = causal_chunks(seq_len)
    keys = seq_len * (chunks + 1) / (2 * chunks)  # chunk c of C sees (c + 1) / C of the keys
    head_dim, hidden = cfg.resolved_head_dim, cfg.hidden_size
    q, kv = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    attention = 4 * hidden + (q + 2 * kv) + (q + kv) + cfg.num_heads * keys + q
    dense_ffn = 4 * cfg.intermediate_size
    slots = cfg.top_k * (BENCH_MOE.capacity_factor if BENCH_MOE.dispatch == "capacity" else 1.0)
    moe_ffn = (
        slots * (4 * cfg.moe_intermediate_size + 2 * hidden)
        + 2 * cfg.num_experts
        + 4 * cfg.moe_intermediate_size * cfg.num_shared_experts
    )
    per_token = (
        cfg.num_layers * attention
        + cfg.first_k_dense * dense_ffn
        + cfg.num_moe_layers * moe_ffn
        + 3 * hidden
        + 2 * cfg.vocab_size
        + cfg.num_heads * keys
    )
    return int(4 * per_token * batch * seq_len)
