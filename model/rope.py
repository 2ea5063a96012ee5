"""Rotary position embedding (RoPE) with scaling, partial rotation, two channel layouts.

``rotate_half`` pairs channel i with i + d/2 (GLM-4.5, Llama, HF ``glm4_moe``);
``interleaved`` pairs 2i with 2i+1 (GPT-J, HF ``glm``/``glm4``). Only the first
``rotary_dim = int(head_dim * partial_rotary_factor)`` channels rotate; the rest pass
through, as in HF ``glm4_moe.apply_rotary_pos_emb``. The scaling types and their
frequencies are in :mod:`model.rope_scaling`.
"""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindmoe.model.kernels import cpu_rope
from mindmoe.model.rope_scaling import default_inv_freq, original_max_position, rope_scaling_config, scaled_inv_freq

__all__ = ["RotaryEmbedding", "apply_rope", "default_inv_freq", "rope_tables"]


def rope_tables(inv_freq: np.ndarray, max_positions: int, interleaved: bool, attention_factor: float = 1.0):
    """cos/sin tables ``[max_positions, rotary_dim]`` laid out for :func:`apply_rope`."""
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    if interleaved:
        angles = np.repeat(angles, 2, axis=-1)
    else:
        angles = np.concatenate([angles, angles], axis=-1)
    return (
        Tensor((np.cos(angles) * attention_factor).astype(np.float32)),
        Tensor((np.sin(angles) * attention_factor).astype(np.float32)),
    )


class RotaryEmbedding(nn.Cell):
    """``construct(positions_S int32) -> (cos [S, rotary_dim], sin [S, rotary_dim])`` fp32 for :func:`apply_rope`.

    Static types (none, linear, ntk, yarn) gather rows of tables precomputed in float64 for
    ``max_positions`` positions (so positions must stay below it). ``dynamic_ntk`` computes the frequencies
    in the graph from
    ``L = max(positions) + 1`` (HF ``dynamic_rope_update``), so one compiled graph, or an exported
    MindIR with dynamic shapes, follows the length of every input instead of a length baked in here.
    """

    def __init__(self, rotary_dim: int, base: float, max_positions: int, scaling, interleaved: bool):
        super().__init__()
        scaling = rope_scaling_config(scaling)
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.dynamic = scaling.type == "dynamic_ntk"
        if self.dynamic:
            # theta'_i = theta_i * alpha^(-2i/(d-2)) is the NTK base change base * alpha^(d/(d-2)) written
            # so that the float64 default frequencies are kept and alpha = 1 gives them back exactly.
            self.default_inv_freq = Tensor(default_inv_freq(rotary_dim, base).astype(np.float32))
            self.ntk_exponents = Tensor((np.arange(0, rotary_dim, 2) / (rotary_dim - 2)).astype(np.float32))
            self.factor = float(scaling.factor)
            self.original = float(original_max_position(scaling, max_positions))
        else:
            inv_freq, attention_factor = scaled_inv_freq(scaling, rotary_dim, base, max_positions)
            self.cos_table, self.sin_table = rope_tables(inv_freq, max_positions, interleaved, attention_factor)

    def construct(self, positions_S):
        if not self.dynamic:
            return ops.gather(self.cos_table, positions_S, 0), ops.gather(self.sin_table, positions_S, 0)
        positions_f = positions_S.astype(ms.float32)
        seq_len = ops.maximum(positions_f.max() + 1.0, self.original)
        alpha = self.factor * seq_len / self.original - (self.factor - 1.0)
        # ops.pow, not exp(log): MindSpore's fp32 CPU exp/log are off by up to 4e-6 (relative), pow by 2e-7.
        inv_freq = self.default_inv_freq * ops.pow(alpha, -self.ntk_exponents)
        angles = positions_f.expand_dims(1) * inv_freq.expand_dims(0)
        if self.interleaved:
            angles = ops.stack((angles, angles), -1).reshape(-1, self.rotary_dim)
        else:
            angles = ops.concat((angles, angles), -1)
        return ops.cos(angles), ops.sin(angles)


def apply_rope(x, cos, sin, interleaved: bool, rotate=None):
    """Rotate the leading ``cos.shape[-1]`` channels of ``x [..., S, head_dim]``; the rest pass through.

    ``cos``/``sin`` are ``[S, rotary_dim]`` (one position table for the whole batch, broadcast over batch
    and heads) or ``[B, 1, S, rotary_dim]`` (a position per sequence, when decoding). ``rotate`` is the
    device's kernel from :func:`mindmoe.model.kernels.rope` (built with the same ``interleaved``); it
    takes the shared table only (Ascend's fused op accepts per-sequence tables for one layout, and not
    for a single query with many heads), so per-sequence tables and ``rotate=None`` use the formula.
    """
    rotary_dim = cos.shape[-1]
    head_dim = x.shape[-1]
    # A split, whose gradient is one concat, not two slices, each of whose gradients is a zero-filled tensor of
    # x's shape (and a full-range slice when every channel rotates).
    x_rot, x_pass = (x, None) if rotary_dim == head_dim else ops.split(x, (rotary_dim, head_dim - rotary_dim), -1)
    x_rot = rotate_channels(x_rot, cos, sin, interleaved, rotate)
    if x_pass is None:
        return x_rot
    return ops.concat((x_rot, x_pass), -1)


def rotate_channels(x_rot, cos, sin, interleaved: bool, rotate=None):
    """RoPE of every channel of ``x_rot``: the device's ``rotate`` kernel for a shared table, else the formula
    (:func:`apply_rope`)."""
    if rotate is not None and cos.ndim == 2:
        return rotate(x_rot, cos, sin)
    if interleaved:
        return cpu_rope.rope_interleaved(x_rot, cos, sin)
    return cpu_rope.rope_rotate_half(x_rot, cos, sin)
