"""Shared by the RoPE-scaling tests: the published vectors' setup, the rotation checks' head shape, HF's rotary
config for them, and ``RotaryEmbedding`` compiled alone."""

from mindspore import nn
from transformers import Glm4MoeConfig

# Published-formula vectors, setup: base 10000, factor (alpha) 4, original context 2048.
BASE, FACTOR, L_ORIG = 10000.0, 4.0, 2048
# Rotation checks: head_dim 32 with partial rotary 0.5 -> 16 rotated channels, 8 frequencies.
HEAD_DIM, PARTIAL, ROTARY_DIM = 32, 0.5, 16


def hf_rope_config(rope_scaling, max_positions, head_dim=HEAD_DIM, partial=PARTIAL, base=BASE):
    return Glm4MoeConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        partial_rotary_factor=partial,
        rope_theta=base,
        max_position_embeddings=max_positions,
        rope_scaling=rope_scaling,
    )


class RopeTables(nn.Cell):
    """``RotaryEmbedding`` alone, compiled: positions -> (cos, sin)."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def construct(self, positions_S):
        return self.rope(positions_S)
