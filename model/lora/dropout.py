"""Dropout masks of the LoRA adapters, drawn from a counter-based hash so that a resumed run draws exactly
the masks the uninterrupted run would have drawn.

MindSpore 2.9's CPU dropout keeps its generator state inside the kernel, where no checkpoint reaches it:
``ops.dropout`` in a fresh process replays the masks of the first steps, and ``mindspore.set_rng_state``
does not move it; the generator-driven ops (``DropoutExt``, ``RandExt``, ``BernoulliExt``) have no CPU
kernel. So each adapted projection owns a :class:`DropoutStream`, and the mask of one draw is a pure
function of (seed, parameter name, data-parallel rank, draws so far)::

    key     = mix32(mix32(mix32(draws) ^ rank) ^ salt)         salt = crc32("<seed>:<parameter name>")
    row_Z   = mix32(z ^ key) | 1                               z < Z: the rows of the flattened input
    col_F   = mix32(f ^ key ^ 0x80000000) | 1                  f < F: its features
    h_ZF    = row_Z[:, None] * col_F[None, :]
    keep_ZF = h_ZF * h_ZF + h_ZF >= round(p * 2**31) * 2 - 2**31

in exact int32 arithmetic (products wrap; the comparison is signed), so the bits are the same on every
backend; ``mix32`` is the lowbias32 integer hash. The hash runs on the Z + F row and column indices only:
per element there are two multiplications, one addition and one comparison, because MindSpore's CPU
shift kernel and its bitwise kernels with a broadcast operand are 10-50 times slower than its
multiplication (a full hash per element cost more than the rest of a LoRA train step). The per-element
work is the kernel function ``kernels.dropout_keep`` (on CPU one host kernel: MindSpore's int32 element-wise
kernels there keep 16 bytes per element for the life of the graph). Why the masks are still good dropout
masks:

- the row and column factors are lowbias32 of distinct inputs (the 0x80000000 keeps the column inputs
  apart from the row inputs), forced odd: as good as independent and uniform over the odd int32 values;
- the product of a uniform odd factor and a fixed odd factor is uniform over the odd values, and
  ``h * h + h = h * (h + 1)`` maps the odd values one-to-one onto the even ones, so each element is
  dropped with probability exactly ``round(p * 2**31) / 2**31`` (KEEP_BITS of resolution);
- elements of one column differ by their row factor and of one row by their column factor; the
  polynomial finaliser breaks the one regularity the plain product has (rows whose factors have a small
  ratio t would drop alike: ``h' = t * h``); only rows (or columns) of one draw whose factors are equal,
  a chance of 2**-31 per pair, drop alike;
- draws, ranks and projections get unrelated keys, hence unrelated row and column factors.

The only state is the draw counter, advanced in the graph once per training forward; it is saved in the
checkpoint's ``state.json`` and restored on resume (:mod:`train.checkpoints.resume`). The data-parallel rank keys the
stream, so data-parallel ranks drop independently while the ranks of one expert group, which run the same
micro-batch, drop alike. Shape legend (docs/architecture.md): Z rows of a flattened input, F features.
"""

import zlib

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

from mindmoe.model import kernels

#: Resolution of the dropout probability: p is rounded to a multiple of 2**-KEEP_BITS.
KEEP_BITS = 31


def _int32(value: int) -> int:
    """The int32 with the bit pattern of the low 32 bits of ``value``."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


_MUL_1 = _int32(0x7FEB352D)
_MUL_2 = _int32(0x846CA68B)
#: Xored into the key of the column factors: their hash inputs have the top bit set, the rows' do not.
_COLUMNS = _int32(0x80000000)


def _shift_right(x, bits: int):
    """Logical right shift of int32 bit patterns (MindSpore's shift of a signed type is arithmetic)."""
    return ops.bitwise_and(ops.bitwise_right_shift(x, bits), Tensor((1 << (32 - bits)) - 1, ms.int32))


def mix32(x):
    """lowbias32: a bijective 32-bit hash with full avalanche; int32 products wrap like uint32 ones."""
    x = ops.bitwise_xor(x, _shift_right(x, 16)) * _MUL_1
    x = ops.bitwise_xor(x, _shift_right(x, 15)) * _MUL_2
    return ops.bitwise_xor(x, _shift_right(x, 16))


def drop_threshold(p: float) -> int:
    """The signed int32 below which an (even) finalised hash drops its element: a fraction p of them."""
    return int(round(p * (1 << KEEP_BITS))) * 2 - (1 << 31)


def _odd_hash(count: int, key, first: int = 0):
    """``mix32(arange(first, first + count) ^ key) | 1``: the factors of ``count`` rows or columns."""
    indices = ops.arange(first, first + count, dtype=ms.int32)
    return ops.bitwise_or(mix32(ops.bitwise_xor(indices, key)), Tensor(1, ms.int32))


def keep_factors(rows: int, cols: int, key, first_row: int = 0):
    """The odd row factors ``[rows]`` and column factors ``[cols]`` of the draw of int32 scalar ``key``; rows
    ``first_row .. first_row + rows - 1`` of the draw (a share of a larger input gets that share's mask)."""
    row_Z = _odd_hash(rows, key, first_row)
    col_F = _odd_hash(cols, ops.bitwise_xor(key, Tensor(_COLUMNS, ms.int32)))
    return row_Z, col_F


@ms.jit_class
class DropoutStream:
    """The dropout draws of one adapted projection (PEFT: one ``lora_dropout`` module per adapter).

    Its two counters are parameters of the compiled graphs but not of the model (a plain attribute, not
    a Cell's): they are never trained, loaded from weight files or exported.
    """

    def __init__(self, name: str, seed: int, p: float):
        self.name = name
        self.p = float(p)
        self.salt = _int32(zlib.crc32(f"{seed}:{name}".encode()))
        self.rank = Parameter(Tensor(0, ms.int32), name=f"{name}.dropout_rank", requires_grad=False)
        self.draws = Parameter(Tensor(0, ms.int32), name=f"{name}.dropout_draws", requires_grad=False)
        # The per-element work (kernels.dropout_keep): the outer product of the factors and the finaliser.
        self.threshold, self.scale = drop_threshold(self.p), 1.0 / (1.0 - self.p)
        self.scaled_keep = kernels.dropout_keep(self.threshold, self.scale)

    def drop(self, x, first_row: int = 0):
        """``x`` with elements zeroed at probability ``p`` and the rest scaled by ``1 / (1 - p)``; one draw.

        ``first_row``: ``x`` holds rows ``first_row ..`` of a larger input (flattened to rows of its last axis),
        e.g. a process's share of the expert buffer under ``parallel.ep``, and is dropped as those rows of it."""
        cols = x.shape[-1]
        row_Z, col_F = self.factors(x.size // cols, cols, first_row)
        scaled_keep = self.scaled_keep(row_Z, col_F).reshape(x.shape)
        # One scaled mask: the backward then multiplies by it once.
        return x * scaled_keep.astype(x.dtype)

    def factors(self, rows: int, cols: int, first_row: int = 0):
        """One draw's row factors ``[rows]`` and column factors ``[cols]`` (:func:`keep_factors`), for a kernel
        that applies the mask itself (``kernels.token_experts``); advances the draw counter like :meth:`drop`."""
        # The key reads the counter before this draw advances it (side effects run in program order).
        key = mix32(ops.bitwise_xor(mix32(ops.bitwise_xor(mix32(self.draws * 1), self.rank)), self.salt))
        row_Z, col_F = keep_factors(rows, cols, key, first_row)
        # The increment waits for the factors, which read the counter: a kernel that applies the mask itself consumes
        # them only after this returns.
        one = ops.depend(ops.depend(Tensor(1, ms.int32), row_Z), col_F)
        ops.assign_add(self.draws, one)
        return row_Z, col_F


def dropout_streams(model) -> list:
    """Every :class:`DropoutStream` of ``model``, in cell order (empty without LoRA dropout)."""
    return [
        value
        for _, cell in model.cells_and_names()
        for value in vars(cell).values()
        if isinstance(value, DropoutStream)
    ]


def dropout_draws(model):
    """The draws so far of ``model``'s streams (all alike: each draws once per training forward), or None."""
    counts = {int(stream.draws.asnumpy()) for stream in dropout_streams(model)}
    if len(counts) > 1:
        raise RuntimeError(f"LoRA dropout streams disagree on their draw counts {sorted(counts)}")
    return counts.pop() if counts else None


def set_dropout_state(model, rank: int, draws: int) -> None:
    """Key ``model``'s streams by data-parallel ``rank``, ``draws`` draws in; before the graphs compile
    (a compiled graph keeps its own copy of a parameter set afterwards)."""
    for stream in dropout_streams(model):
        stream.rank.set_data(Tensor(np.int32(rank)))
        stream.draws.set_data(Tensor(np.int32(draws)))
