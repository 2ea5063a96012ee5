"""CPU rotary position embedding kernels (also the formula every device runs when positions differ per sequence).

``x * cos + rotate(x) * sin`` on the rotated channels ``x_rot [..., S, R]``, with ``cos``/``sin``
broadcasting to it (``[S, R]``, or ``[B, 1, S, R]`` when decoding). ``rotate_half`` pairs channel i
with i + R/2 (GLM-4.5, Llama, GPT-NeoX); ``interleaved`` pairs 2i with 2i+1 (GPT-J). The tables of
:func:`mindmoe.model.rope.rope_tables` are laid out to match (halves repeated, or each angle twice). The tables
are broadcast to ``x_rot``'s shape before the products: a multiplication that broadcasts an operand itself keeps
16 bytes per output element for the compiled graph's life on CPU.
"""

from mindspore import ops
from mindspore.ops import functional as F

from mindmoe.model.kernels.cpu import expand


def _rotate_half(x):
    # A split: its gradient is one concat, where two slices' are two zero-filled tensors of x's shape and their sum.
    first, second = ops.split(x, x.shape[-1] // 2, -1)
    return ops.concat((-second, first), -1)


def _rotate_interleaved(x):
    even = x[..., 0::2]
    odd = x[..., 1::2]
    return ops.stack((-odd, even), -1).reshape(x.shape)


def _tables_like(x_rot, cos, sin):
    """The tables in ``x_rot``'s dtype, broadcast to its shape when that is static (training; a serving graph's
    dynamic length is left to the multiplication)."""
    cos, sin = cos.astype(x_rot.dtype), sin.astype(x_rot.dtype)
    shape = x_rot.shape
    if not F.isconstant(shape[-2]) or not F.isconstant(shape[0]):
        return cos, sin
    return expand(cos, shape), expand(sin, shape)


def rope_rotate_half(x_rot, cos, sin):
    """RoPE of every channel of ``x_rot``, halves paired (GPT-NeoX layout)."""
    cos, sin = _tables_like(x_rot, cos, sin)
    return x_rot * cos + _rotate_half(x_rot) * sin


def rope_interleaved(x_rot, cos, sin):
    """RoPE of every channel of ``x_rot``, neighbours paired (GPT-J layout)."""
    cos, sin = _tables_like(x_rot, cos, sin)
    return x_rot * cos + _rotate_interleaved(x_rot) * sin


def rope(interleaved: bool):
    """The kernel for the layout: a plain function, traced inline into the caller's graph."""
    return rope_interleaved if interleaved else rope_rotate_half
