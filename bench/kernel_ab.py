"""``python -m mindmoe.bench.kernel_ab --model dense --variant expand=broadcast_to``: what a change to a CPU kernel
function (or a model function) bought, measured in one process.

Two trainers of the ``train_step`` case (bench.ms_options.alternate): the first with the kernels as they are, the
second built and compiled while one kernel function is replaced by its earlier implementation (``VARIANTS``,
kept here for this comparison only); their steps alternate on the same windows, so both see the same load.
``speedup`` = the earlier variant's median step over today's. The JSON line also has both compile times and
the largest difference of their losses (the same windows and initial weights).
"""

import argparse
import contextlib
import importlib
import json
import sys

import mindspore as ms
from mindspore import ops

from mindmoe.bench.earlier_loss import EarlierTokenNLL
from mindmoe.model.kernels import cpu
from mindmoe.model.rope import rotate_channels


def _broadcast_expand(x, shape):
    """``kernels.cpu.expand`` before it tiled static shapes: ``BroadcastTo`` for every shape."""
    return ops.broadcast_to(x, shape)


def _sliced_leading(x, rows: int):
    """``model.lm_loss._leading`` before it skipped a full-range slice: always ``StridedSlice``."""
    return x[:rows]


def _stepped_ordered_int(x):
    """``model.moe.router.ordered_int`` before its ``log2`` estimate: the exponent found by fifteen compare-and-scale
    steps (the same keys, about 110 kernels per call instead of about 38)."""
    x = x.astype(ms.float32)
    magnitude = ops.abs(x)
    nonzero = magnitude > 0
    y = ops.select(nonzero, magnitude, ops.ones_like(magnitude))
    exponent = ops.zeros_like(magnitude, dtype=ms.int32)
    for k in (64, 32, 16, 8, 4, 2, 1):
        big = y >= 2.0**k
        y = ops.select(big, y * 2.0**-k, y)
        exponent = exponent + big.astype(ms.int32) * k
    for k in (64, 64, 32, 16, 8, 4, 2, 1):
        small = y < 2.0 ** (1 - k)
        y = ops.select(small, y * 2.0**k, y)
        exponent = exponent - small.astype(ms.int32) * k
    normal_bits = (exponent + 127) * (1 << 23) + ((y - 1.0) * 2.0**23).astype(ms.int32)
    subnormal_bits = (magnitude * 2.0**100 * 2.0**49).astype(ms.int32)
    bits = ops.select(exponent >= -126, normal_bits, subnormal_bits)
    bits = ops.select(nonzero, bits, ops.zeros_like(bits))
    return ops.select(x < 0, -bits, bits)


def _sliced_query_chunks(q_BNSD, chunks: int):
    """``model.attention.query_chunks`` before it split: a slice per chunk."""
    size = q_BNSD.shape[2] // chunks
    return tuple(q_BNSD[:, :, c * size : (c + 1) * size] for c in range(chunks))


def _sliced_rotate_half(x):
    """``model.kernels.cpu_rope._rotate_half`` before it split: two slices."""
    half = x.shape[-1] // 2
    return ops.concat((-x[..., half:], x[..., :half]), -1)


def _sliced_apply_rope(x, cos, sin, interleaved: bool, rotate=None):
    """``model.rope.apply_rope`` before it split: the rotated and passed channels as two slices (the second possibly
    empty)."""
    rotary_dim = cos.shape[-1]
    x_rot = rotate_channels(x[..., :rotary_dim], cos, sin, interleaved, rotate)
    x_pass = x[..., rotary_dim:]
    if x_pass.shape[-1] == 0:
        return x_rot
    return ops.concat((x_rot, x_pass), -1)


_DOT = ops.MatMul(transpose_b=True)


def _dot_row_squares(x_Rn, piece):
    """The global norm's sums of squares before ``kernels.row_squares``: a whole tensor as one ``[1, n] x [n, 1]``
    MatMul, an expert tensor's rows as batched ``[1, p] x [p, 1]`` dots and a sum (the formula today)."""
    if piece is None:
        flat_1N = x_Rn.astype(ms.float32).reshape(1, -1)
        return _DOT(flat_1N, flat_1N).reshape(1)
    return cpu.row_squares(x_Rn, piece)


def _selection_scores_with_gradient(scores_TE, bias_E=None):
    """``model.moe.router.selection_scores`` before its gradient stop."""
    return scores_TE if bias_E is None else scores_TE + bias_E.astype(ms.float32)


def _no_native_library():
    """``model.kernels.cpu_native.library`` before the compiled kernels: none, so the MindSpore formulas run."""
    return None


#: ``--variant`` -> ((module attribute paths to replace, the earlier implementation), ...). MindSpore resolves a
#: function's globals when it compiles the graph, so the replacement holds for graphs compiled meanwhile.
VARIANTS = {
    "expand=broadcast_to": (
        (("mindmoe.model.kernels.cpu.expand", "mindmoe.model.kernels.cpu_rope.expand"), _broadcast_expand),
    ),
    "loss_slice=always": ((("mindmoe.model.lm_loss._leading",), _sliced_leading),),
    "ordered_int=steps": ((("mindmoe.model.moe.router.ordered_int",), _stepped_ordered_int),),
    "loss=recompute": ((("mindmoe.train.head_loss.TokenNLL",), EarlierTokenNLL),),
    "native=none": ((("mindmoe.model.kernels.cpu_native.library",), _no_native_library),),
    "slots=formula": (
        (("mindmoe.model.kernels.CPU_KERNELS[slot_gather]",), lambda: cpu.gather_source_rows),
        (("mindmoe.model.kernels.CPU_KERNELS[slot_combine]",), lambda: cpu.combine_slot_rows),
    ),
    "softmax_nll=formula": ((("mindmoe.model.kernels.CPU_KERNELS[softmax_nll]",), cpu.SoftmaxNLL),),
    "selection=gradient": ((("mindmoe.model.moe.router.selection_scores",), _selection_scores_with_gradient),),
    "norm=dots": ((("mindmoe.model.kernels.CPU_KERNELS[row_squares]",), lambda: _dot_row_squares),),
    "split=slices": (
        (("mindmoe.model.attention.query_chunks",), _sliced_query_chunks),
        (("mindmoe.model.kernels.cpu_rope._rotate_half",), _sliced_rotate_half),
        (("mindmoe.model.attention.apply_rope", "mindmoe.model.mla.apply_rope"), _sliced_apply_rope),
    ),
}


def module_attribute(path: str) -> tuple:
    """``(get, set)`` of a ``VARIANTS`` path: a dotted module attribute, or ``module.DICT[key]`` (an entry of a
    kernel table), the module imported."""
    if path.endswith("]"):
        path, _, key = path[:-1].partition("[")
        module_name, _, attribute = path.rpartition(".")
        table = getattr(importlib.import_module(module_name), attribute)
        return (lambda: table[key]), (lambda value: table.__setitem__(key, value))
    module_name, _, attribute = path.rpartition(".")
    module = importlib.import_module(module_name)
    return (lambda: getattr(module, attribute)), (lambda value: setattr(module, attribute, value))


@contextlib.contextmanager
def earlier_kernel(variant: str):
    """Every attribute of ``VARIANTS[variant]`` replaced inside the block, restored after it."""
    saved = []
    try:
        for paths, earlier in VARIANTS[variant]:
            for path in paths:
                get, put = module_attribute(path)
                saved.append((put, get()))
                put(earlier)
        yield
    finally:
        for put, value in reversed(saved):
            put(value)


def _renamed(row: dict) -> dict:
    """``alternate`` calls today's trainer "baseline" and the earlier variant's "option": "today", "earlier" here."""
    names = {"baseline": "today", "option": "earlier"}
    renamed = {}
    for key, value in row.items():
        first, underscore, rest = key.partition("_")
        renamed[names.get(first, first) + underscore + rest] = value
    return renamed


def main(argv=None) -> int:
    from mindmoe.bench.ms_options import alternate
    from mindmoe.conf.quiet import quiet_framework_logs

    quiet_framework_logs()
    parser = argparse.ArgumentParser(prog="python -m mindmoe.bench.kernel_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "moe"), required=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--layers", type=int, default=0, help="layer count (default: the size's, 8 at full)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps of each trainer")
    parser.add_argument("--size", choices=("full", "quick"), default="full")
    args = parser.parse_args(argv)
    row = alternate(args.model, args.layers, args.steps, args.size, lambda: earlier_kernel(args.variant))
    if "error" not in row:
        row = _renamed(row)
        row["speedup"] = row["earlier_step_s"] / row["today_step_s"]
    print(json.dumps({"variant": args.variant, **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
