"""Tiny DeepSeek Sparse Attention models (model/dsa.py) for the tests that compare them with NumPy or with their own
serving graphs: MLA with query compression and interleaved RoPE, an indexer of 8 heads, O(1) random weights."""

import numpy as np
from mindspore import Tensor

from mindmoe.model.config import ModelConfig
from tests.helpers.mla_models import tiny_mla_config


def tiny_dsa_config(topk: int, **overrides) -> ModelConfig:
    """:func:`tiny_mla_config` with interleaved RoPE, one dense layer first, and an indexer of 8 heads of width 8
    keeping ``topk`` keys (8 heads make exact ties of the ReLU'd sums rare)."""
    fields = dict(rope_interleaved=True, first_k_dense=1, dsa=dict(index_n_heads=8, index_head_dim=8, index_topk=topk))
    fields.update(overrides)
    return tiny_mla_config(**fields)


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
