"""Dropout masks of the LoRA adapters, drawn from a counter-based hash so that a resumed run draws exactly
the masks the uninterrupted run would have drawn.

MindSpore 2.9's CPU dropout keeps its generator state inside the kernel, where no checkpoint reaches it:
``ops.dropout`` in a fresh process replays the masks of the first steps, and ``mindspore.set_rng_state``
does not move it; the generator-driven ops (``DropoutExt``, ``RandExt``, ``BernoulliExt``) have no CPU
kernel. So each adapted projection owns a :class:`DropoutStream`, and the mask of one draw is a pure
function of (seed, parameter name, data-parallel rank, draws so far)::

    key     = mix32(mix32(mix32(draws) ^ rank) ^ salt)         salt = crc32("<seed>:<parameter name>")
    bits_ZF = mix32(mix32(row_Z ^ key)[:, None] ^ col_F)       keep where bits >> 8 >= round(p * 2**24)

in exact int32 arithmetic (the same bits on every backend; ``mix32`` is the lowbias32 integer hash). The
only state is the draw counter, advanced in the graph once per training forward; it is saved in the
checkpoint's ``state.json`` and restored on resume (:mod:`train.resume`). The data-parallel rank keys the
stream, so data-parallel ranks drop independently while the ranks of one expert group, which run the same
micro-batch, drop alike. Shape legend (docs/architecture.md): Z rows of a flattened input, F features.
"""

import zlib

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

#: Bits of the hash compared against the dropout probability (exact in int32 and in fp32).
KEEP_BITS = 24


def _int32(value: int) -> int:
    """The int32 with the bit pattern of the low 32 bits of ``value``."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


_MUL_1 = _int32(0x7FEB352D)
_MUL_2 = _int32(0x846CA68B)


def _shift_right(x, bits: int):
    """Logical right shift of int32 bit patterns (MindSpore's shift of a signed type is arithmetic)."""
    return ops.bitwise_and(ops.bitwise_right_shift(x, bits), Tensor((1 << (32 - bits)) - 1, ms.int32))


def mix32(x):
    """lowbias32: a bijective 32-bit hash with full avalanche; int32 products wrap like uint32 ones."""
    x = ops.bitwise_xor(x, _shift_right(x, 16)) * _MUL_1
    x = ops.bitwise_xor(x, _shift_right(x, 15)) * _MUL_2
    return ops.bitwise_xor(x, _shift_right(x, 16))


def keep_mask(rows: int, cols: int, p: float, key):
    """``[rows, cols]`` bool: True where the draw of int32 scalar ``key`` keeps the element."""
    row_Z = mix32(ops.bitwise_xor(ops.arange(0, rows, dtype=ms.int32), key))
    bits_ZF = mix32(ops.bitwise_xor(row_Z.expand_dims(-1), ops.arange(0, cols, dtype=ms.int32)))
    return _shift_right(bits_ZF, 32 - KEEP_BITS) >= int(round(p * (1 << KEEP_BITS)))


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

    def drop(self, x):
        """``x`` with elements zeroed at probability ``p`` and the rest scaled by ``1 / (1 - p)``; one draw."""
        # The key reads the counter before this draw advances it (side effects run in program order).
        key = mix32(ops.bitwise_xor(mix32(ops.bitwise_xor(mix32(self.draws * 1), self.rank)), self.salt))
        cols = x.shape[-1]
        keep = keep_mask(x.size // cols, cols, self.p, key).reshape(x.shape)
        ops.assign_add(self.draws, Tensor(1, ms.int32))
        return x * keep.astype(x.dtype) * (1.0 / (1.0 - self.p))


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
