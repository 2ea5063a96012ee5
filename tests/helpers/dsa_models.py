"""Tiny DeepSeek Sparse Attention models (model/dsa.py) for the tests that compare them with NumPy or with their own
serving graphs: MLA with query compression and interleaved RoPE, an indexer of 8 heads, O(1) random weights."""

import numpy as np
from mindspore import Tensor

from mindmoe.model.config import ModelConfig


def tiny_dsa_config(topk: int, **overrides) -> ModelConfig:
    """MLA (values narrower than queries/keys: 6 vs 8 + 4), 4 experts top-2 after one dense layer, and an indexer of
    8 heads of width 8 keeping ``topk`` keys (8 heads make exact ties of the ReLU'd sums rare)."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_type="mla",
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_interleaved=True,
        first_k_dense=1,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=16,
        intermediate_size=32,
        dsa=dict(index_n_heads=8, index_head_dim=8, index_topk=topk),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def randomize(model, seed: int = 0) -> None:
    """O(1) random weights (norm gains around 1, LayerNorm biases too; router correction biases left at 0), so
    attention is far from uniform and the indexer's scores spread."""
    rng = np.random.default_rng(seed)
    for param in model.get_parameters():
        if param.name.endswith("e_score_correction_bias"):
            continue
        scale = 0.5 if len(param.shape) > 1 else 0.3
        base = 1.0 if param.name.endswith("norm.weight") else 0.0
        param.set_data(Tensor((base + rng.normal(0, scale, param.shape)).astype(np.float32)))
