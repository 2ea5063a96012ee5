"""Rotary position embedding (RoPE) with partial rotation, two channel layouts.

``rotate_half`` pairs channel i with i + d/2 (GLM-4.5, Llama, HF ``glm4_moe``);
``interleaved`` pairs 2i with 2i+1 (GPT-J, HF ``glm``/``glm4``). Only the first
``rotary_dim = int(head_dim * partial_rotary_factor)`` channels rotate; the rest pass
through, as in HF ``glm4_moe.apply_rotary_pos_emb``.
"""
import numpy as np
from mindspore import Tensor, ops
import mindspore as ms


def default_inv_freq(rotary_dim: int, base: float) -> np.ndarray:
    """``theta_i = base^(-2i/d)`` for i in [0, d/2), float64."""
    return 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def rope_tables(inv_freq: np.ndarray, max_positions: int, interleaved: bool):
    """cos/sin tables ``[max_positions, rotary_dim]`` laid out for :func:`apply_rope`."""
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    if interleaved:
        angles = np.repeat(angles, 2, axis=-1)
    else:
        angles = np.concatenate([angles, angles], axis=-1)
    return Tensor(np.cos(angles).astype(np.float32)), Tensor(np.sin(angles).astype(np.float32))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return ops.concat((-x[..., half:], x[..., :half]), -1)


def _rotate_interleaved(x):
    even = x[..., 0::2]
    odd = x[..., 1::2]
    return ops.stack((-odd, even), -1).reshape(x.shape)


def apply_rope(x, cos, sin, interleaved: bool):
    """Rotate the leading ``cos.shape[-1]`` channels of ``x [..., S, head_dim]``.

    ``cos``/``sin`` are ``[S, rotary_dim]`` (broadcast over batch and heads).
    """
    rotary_dim = cos.shape[-1]
    x_rot = x[..., :rotary_dim]
    x_pass = x[..., rotary_dim:]
    rotated = _rotate_interleaved(x_rot) if interleaved else _rotate_half(x_rot)
    x_rot = x_rot * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)
    if x_pass.shape[-1] == 0:
        return x_rot
    return ops.concat((x_rot, x_pass), -1)
