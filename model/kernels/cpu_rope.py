"""CPU rotary position embedding kernels (also the formula every device runs when positions differ per sequence).

``x * cos + rotate(x) * sin`` on the rotated channels ``x_rot [..., S, R]``, with ``cos``/``sin``
broadcasting to it (``[S, R]``, or ``[B, 1, S, R]`` when decoding). ``rotate_half`` pairs channel i
with i + R/2 (GLM-4.5, Llama, GPT-NeoX); ``interleaved`` pairs 2i with 2i+1 (GPT-J). The tables of
:func:`mindmoe.model.rope.rope_tables` are laid out to match (halves repeated, or each angle twice).
"""

from mindspore import ops


def _rotate_half(x):
    half = x.shape[-1] // 2
    return ops.concat((-x[..., half:], x[..., :half]), -1)


def _rotate_interleaved(x):
    even = x[..., 0::2]
    odd = x[..., 1::2]
    return ops.stack((-odd, even), -1).reshape(x.shape)


def rope_rotate_half(x_rot, cos, sin):
    """RoPE of every channel of ``x_rot``, halves paired (GPT-NeoX layout)."""
    return x_rot * cos.astype(x_rot.dtype) + _rotate_half(x_rot) * sin.astype(x_rot.dtype)


def rope_interleaved(x_rot, cos, sin):
    """RoPE of every channel of ``x_rot``, neighbours paired (GPT-J layout)."""
    return x_rot * cos.astype(x_rot.dtype) + _rotate_interleaved(x_rot) * sin.astype(x_rot.dtype)


def rope(interleaved: bool):
    """The kernel for the layout: a plain function, traced inline into the caller's graph."""
    return rope_interleaved if interleaved else rope_rotate_half
