"""The benchmark models and batch sizes: a dense and an MoE decoder with equal active parameters.

Both are GLM-4.5 shaped (GQA, q/k/v bias, QK-norm, partial RoPE). The MoE model replaces every
dense SwiGLU of width ``2 I`` by 8 experts of width ``I`` with top-2 routing and no shared expert,
so a token multiplies through the same FFN weights in both (plus the MoE router's ``H x E``).
"""

import dataclasses
from dataclasses import dataclass

from mindmoe.model.config import ModelConfig


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
    activation_probe: bool  # also run the step at half the micro-batch to measure activation memory


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
    warmup_steps=2,
    gemm_size=2048,
    compile_layers=(2, 8, 24),
    compile_hidden=128,
    data_windows=512,
    data_batches=64,
    activation_probe=True,
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
    activation_probe=False,
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
        aux_loss="switch",
        z_loss_coeff=1e-3,
        dispatch="capacity",
        capacity_factor=CAPACITY_FACTOR,
    )
    if kind == "dense":
        return dataclasses.replace(base, first_k_dense=layers)
    if kind == "moe":
        return dataclasses.replace(base, first_k_dense=0)
    raise ValueError(f"model kind {kind!r}: expected 'dense' or 'moe'")


def theoretical_train_bytes(num_params: int) -> int:
    """fp32 params + grads + AdamW's two moments: 16 bytes per trained parameter."""
    return 16 * num_params
