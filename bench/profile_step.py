"""``python -m mindmoe.bench.profile_step --model dense|moe``: where the time of one benchmark train step goes.

Builds the step of the ``train_step`` case (bench.cases.build_trainer on bench.specs.model_config, the same
random windows), runs warm-up steps, then profiles a few with ``mindspore.profiler.profile`` (CPU activity)
and prints one JSON summary: kernel time per category (explicit table below), the achieved GFLOP/s of the
MatMul/BatchMatMul kernels against a 2048x2048 fp32 MatMul timed in the same process, the top op types,
and the host time of a step (its wall time minus the kernels it ran).

On CPU, MindSpore 2.9's profiler writes ``FRAMEWORK/cpu_op_execute_timestamp_<rank>.txt`` (every kernel
execution: start in epoch ns, duration in ms) and ``FRAMEWORK/cpu_framework_<rank>.txt`` (one line per
execution, in execution order, with the input shapes). The kernels run one after another on one host
thread (``MS_DEV_HOST_BLOCKING_RUN=1``, model/kernels/host_runtime.py), so a step's wall time minus its
kernel time is host time: launching kernels inside the graph, and Python before and after it.
"""

import argparse
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

from mindmoe.bench.scaling import existing_section

#: Op type -> category. A type not listed counts as "other" and is named in the summary, so a new kernel
#: shows up instead of silently joining a category.
OP_CATEGORY = {
    **dict.fromkeys(("MatMul", "BatchMatMul", "MatMulExt", "BatchMatMulExt", "GroupedMatmul", "Dense"), "matmul"),
    **dict.fromkeys(
        (
            "Add", "AddN", "Sub", "Mul", "Div", "RealDiv", "Neg", "Reciprocal", "Exp", "Log", "Log1p", "Sqrt",
            "Rsqrt", "Pow", "Square", "Abs", "Sign", "Cos", "Sin", "Tanh", "Erf", "Sigmoid", "SigmoidGrad",
            "SiLU", "SiLUGrad", "Maximum", "Minimum", "Equal", "NotEqual", "Greater", "GreaterEqual", "Less",
            "LessEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "Select", "IsFinite", "IsNan", "OneHot",
            "ZerosLike", "OnesLike", "Fill", "FillV2", "MaskedFill", "BiasAdd", "BiasAddGrad", "SqrtGrad",
            "RsqrtGrad", "Floor", "FloorDiv", "Round", "Clip", "ClipByValue",
        ),
        "elementwise",
    ),
    **dict.fromkeys(
        (
            "ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd", "ReduceAll", "ReduceAny",
            "Softmax", "SoftmaxGrad", "LogSoftmax", "LogSoftmaxGrad", "SoftmaxCrossEntropyWithLogits",
            "SparseSoftmaxCrossEntropyWithLogits", "ArgMaxWithValue", "ArgMinWithValue", "Argmax", "Argmin",
            "TopK", "Sort", "CumSum", "Cumsum", "CumProd", "RmsNorm", "RmsNormGrad", "LayerNorm", "LayerNormGrad",
        ),
        "reduction",
    ),
    **dict.fromkeys(
        (
            "Transpose", "Concat", "Slice", "SliceGrad", "StridedSlice", "StridedSliceGrad", "Gather", "GatherD",
            "GatherDGrad", "GatherDGradV2", "GatherNd", "Reshape", "ExpandDims", "Squeeze", "Flatten", "Cast",
            "ScatterNd", "ScatterNdAdd", "ScatterNdUpdate", "TensorScatterUpdate", "TensorScatterAdd",
            "UnsortedSegmentSum", "Split", "Stack", "Unstack", "Tile", "BroadcastTo", "Identity",
            "TensorCopySlices", "TensorMove", "Pad", "PadV3", "Range", "Zeros", "Ones", "Tril", "Triu",
            "TensorShape", "Shape", "Depend", "MakeTuple", "TupleGetItem",
        ),
        "data_movement",
    ),
    # train/fused_adamw.py: one Adam kernel per parameter after the decoupled decay's Assign; the step count.
    **dict.fromkeys(("Adam", "ApplyAdam", "AdamWeightDecay", "Assign", "AssignAdd"), "optimizer"),
}  # fmt: skip
CATEGORIES = ("matmul", "elementwise", "reduction", "data_movement", "optimizer", "other")
MATMUL_TYPES = ("MatMul", "BatchMatMul", "MatMulExt", "BatchMatMulExt")
#: Timings of the 2048² MatMul peak, before and after the profiled steps: the best one is the least disturbed
#: by other users of the machine (their load only ever lowers a measured rate).
PEAK_TRIALS = 10
#: Rows of the summary's MatMul-by-shape table (the most time first).
MATMUL_SHAPE_ROWS = 16
#: The hand-written section of BENCHMARKS.md that :func:`keep_profile_section` carries over a regeneration.
PROFILE_SECTION = "## Profile of one training step"
_SHAPE = re.compile(r"^input_\d+:\[([0-9, ]*)\]$")


def op_type_of(op_name: str) -> str:
    """``Gradients/Default/MatMul-op47`` -> ``MatMul``."""
    return re.sub(r"-op\d+$", "", op_name.rsplit("/", 1)[-1])


def categorize(op_type: str, shapes: tuple = ()) -> str:
    """The category of a kernel: :data:`OP_CATEGORY`, else ``other``.

    One rule by shape: a MatMul of two ``[1, n]`` rows, or a BatchMatMul of two ``[p, 1, n]`` stacks of rows, is a dot
    product of the global gradient norm (train/grad_norm.py: the dense tensors' and each expert row's pieces), part of
    the update, not of the model (read as a model product, ``[p, n, 1] x [p, 1, n]``, its FLOPs would be n times too
    many: 754 instead of 342 GFLOP per MoE step)."""
    dots = op_type in ("MatMul", "BatchMatMul") and len(shapes) >= 2 and shapes[0] == shapes[1] and shapes[0]
    if dots and len(shapes[0]) >= 2 and shapes[0][-2] == 1 and (op_type == "BatchMatMul" or len(shapes[0]) == 2):
        return "optimizer"
    return OP_CATEGORY.get(op_type, "other")


def matmul_flops(op_type: str, shapes: tuple, head_dim: int = 0) -> tuple:
    """``(flops, alternative)`` of a MatMul/BatchMatMul from its input shapes; ``alternative`` is the other
    reading's count where the shapes allow two, else None.

    The profiler records no transpose flags. The step multiplies NN, NT (``x W^T``, ``q k^T``) and TN
    (``dy^T x``, weight and key gradients, also inside custom bprops); the contraction is ``a[-1]`` for NN and
    NT and ``a[-2]`` for TN. Both fit only when the shapes coincide; then a BatchMatMul of two operands ending
    in the head dim (+ 1: the row-sum column of fp32 attention, model/kernels/cpu_attention.py) is attention's
    ``q k^T`` or ``dout v^T`` (NT), and any other is a weight gradient over tokens (TN)."""
    if op_type not in MATMUL_TYPES or len(shapes) < 2 or not shapes[0] or not shapes[1]:
        return 0, None
    a, b = shapes[0], shapes[1]
    if len(a) < 2 or len(b) < 2:
        return 0, None
    (a0, a1), (b0, b1) = a[-2:], b[-2:]
    rank = max(len(a), len(b)) - 2
    batch = 1
    for x, y in zip((1,) * (rank + 2 - len(a)) + a[:-2], (1,) * (rank + 2 - len(b)) + b[:-2]):
        batch *= max(x, y)  # broadcast batch dimensions
    nn_or_nt = a1 in (b0, b1)
    tn = a0 == b0
    if nn_or_nt and tn and a1 != a0:
        attention = op_type.startswith("BatchMatMul") and a1 == b1 and a1 in (head_dim, head_dim + 1)
        k, other = (a1, a0) if attention else (a0, a1)
        return 2 * batch * a0 * a1 * b0 * b1 // k, 2 * batch * a0 * a1 * b0 * b1 // other
    k = a0 if tn and not nn_or_nt else a1  # neither: a TT product the step does not use; count it as NT
    return 2 * batch * a0 * a1 * b0 * b1 // k, None


def parse_shapes(fields: list) -> tuple:
    shapes = []
    for field in fields:
        match = _SHAPE.match(field.strip())
        if match:
            shapes.append(tuple(int(x) for x in match.group(1).split(",") if x.strip()))
        elif field.startswith("input_"):
            shapes.append(None)
    return tuple(shapes)


def read_executions(framework_dir: str) -> list:
    """Every kernel execution ``(start_ns, ms, op_name, op_type, shapes)`` in time order."""
    (stamps,) = glob.glob(os.path.join(framework_dir, "cpu_op_execute_timestamp_*.txt"))
    runs = []
    with open(stamps) as handle:
        for line in handle:
            parts = line.strip().split(";")
            if len(parts) < 3:
                continue
            for execution in parts[2].split():
                start, duration = execution.split(",")[:2]
                runs.append((int(start), float(duration), parts[0]))
    runs.sort()
    shape_lines = []
    for path in glob.glob(os.path.join(framework_dir, "cpu_framework_*.txt")):
        with open(path) as handle:
            shape_lines = [line.rstrip("\n").split(";") for line in handle if line.strip()]
    paired = len(shape_lines) == len(runs) and all(
        name.rsplit("/", 1)[-1] == line[1] for (_, _, name), line in zip(runs, shape_lines)
    )
    out = []
    for i, (start, ms, name) in enumerate(runs):
        shapes = parse_shapes(shape_lines[i][3:]) if paired else ()
        out.append((start, ms, name, op_type_of(name), shapes))
    return out


def summarize(executions: list, windows: list, peak_gflops: float, head_dim: int = 0) -> dict:
    """Per-step kernel time by category and op type, MatMul GFLOP/s and host time, from the executions
    inside ``windows`` (``(start_ns, end_ns)`` of each profiled step)."""
    steps = len(windows)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    by_type, other, step_kernel_ms, spans = {}, {}, [0.0] * steps, [[None, None] for _ in windows]
    by_shape = {}  # (op type, input shapes) of the MatMuls -> [executions, ms, FLOPs]
    flops = alternative = ambiguous = 0
    for start, ms, _name, op_type, shapes in executions:
        step = next((i for i, (lo, hi) in enumerate(windows) if lo <= start <= hi), None)
        if step is None:
            continue
        category = categorize(op_type, shapes)
        by_category[category] += ms
        by_type[op_type] = by_type.get(op_type, 0.0) + ms
        if category == "other":
            other[op_type] = other.get(op_type, 0.0) + ms
        if category == "matmul":
            count, alt = matmul_flops(op_type, shapes, head_dim)
            flops += count
            alternative += count if alt is None else alt
            ambiguous += alt is not None
            entry = by_shape.setdefault((op_type, shapes), [0, 0.0, 0])
            entry[0] += 1
            entry[1] += ms
            entry[2] += count
        step_kernel_ms[step] += ms
        end = start + ms * 1e6
        spans[step][0] = start if spans[step][0] is None else spans[step][0]
        spans[step][1] = end
    wall_ms = [(hi - lo) / 1e6 for lo, hi in windows]
    span_ms = [(hi - lo) / 1e6 if lo is not None else 0.0 for lo, hi in spans]
    kernel_ms = sum(step_kernel_ms) / steps
    step_ms = sum(wall_ms) / steps
    per_step = {name: value / steps for name, value in by_category.items()}
    per_step["host"] = step_ms - kernel_ms
    matmul_s = by_category["matmul"] / 1e3
    return {
        "profiled_steps": steps,
        "step_ms": step_ms,
        "step_ms_all": wall_ms,
        "kernel_ms": kernel_ms,
        "kernels_per_step": sum(1 for e in executions if windows[0][0] <= e[0] <= windows[0][1]),
        "ms_per_step": per_step,
        "share": {name: value / step_ms for name, value in per_step.items()},
        # Host time split: gaps between the graph's kernels, and Python/graph entry outside its first..last kernel.
        "host_in_graph_ms": sum(s - k for s, k in zip(span_ms, step_kernel_ms)) / steps,
        "host_outside_graph_ms": sum(w - s for w, s in zip(wall_ms, span_ms)) / steps,
        "matmul_gflop_per_step": flops / steps / 1e9,
        "matmul_gflops": flops / matmul_s / 1e9 if matmul_s else 0.0,
        "matmul_gflops_other_reading": alternative / matmul_s / 1e9 if matmul_s else 0.0,
        "ambiguous_matmuls_per_step": ambiguous / steps,
        "peak_gflops": peak_gflops,
        "matmul_of_peak": flops / matmul_s / 1e9 / peak_gflops if matmul_s and peak_gflops else 0.0,
        "top_op_types": [
            {"op_type": t, "ms_per_step": ms / steps, "share": ms / steps / step_ms, "category": categorize(t)}
            for t, ms in sorted(by_type.items(), key=lambda item: -item[1])[:10]
        ],
        "other_op_types": {t: ms / steps for t, ms in sorted(other.items(), key=lambda item: -item[1])},
        # The MatMuls by input shapes, the most time first, each with its own rate (FLOPs by the first reading of
        # matmul_flops): which products run below the step's MatMul rate.
        "matmul_shapes": [
            {
                "op_type": t,
                "shapes": [list(shape) for shape in shapes[:2]],  # the two operands; the profiler lists more inputs
                "per_step": count / steps,
                "ms_per_step": ms / steps,
                "gflops": flop / ms / 1e6 if ms else 0.0,
            }
            for (t, shapes), (count, ms, flop) in sorted(by_shape.items(), key=lambda item: -item[1][1])[
                :MATMUL_SHAPE_ROWS
            ]
        ],
    }


def markdown_tables(summary: dict) -> list:
    """The category table and the top-10 op types of one model's summary, as BENCHMARKS.md lines."""
    lines = ["| category | ms per step | share of step |", "|---|---|---|"]
    for name in (*CATEGORIES, "host"):
        ms, share = summary["ms_per_step"][name], summary["share"][name]
        note = ""
        if name == "matmul":
            note = (
                f" ({summary['matmul_gflops']:.0f} GFLOP/s = {summary['matmul_of_peak']:.2f} of the "
                f"{summary['peak_gflops']:.0f} GFLOP/s 2048² MatMul)"
            )
        if name == "other" and summary["other_op_types"]:
            note = " (" + ", ".join(summary["other_op_types"]) + ")"
        lines.append(f"| {name}{note} | {ms:.0f} | {share:.3f} |")
    lines.append(f"| **step (wall, profiled)** | {summary['step_ms']:.0f} | 1.000 |")
    if summary.get("unprofiled_step_ms"):
        lines.append(
            f"| step (wall, without the profiler; median of other steps) | {summary['unprofiled_step_ms']:.0f} | |"
        )
    lines += ["", "| op type | category | ms per step | share of step |", "|---|---|---|---|"]
    for row in summary["top_op_types"]:
        lines.append(f"| {row['op_type']} | {row['category']} | {row['ms_per_step']:.0f} | {row['share']:.3f} |")
    lines += ["", "| MatMul | input shapes | per step | ms per step | GFLOP/s |", "|---|---|---|---|---|"]
    for row in summary["matmul_shapes"]:
        shapes = " x ".join(str(tuple(shape)) for shape in row["shapes"])
        lines.append(
            f"| {row['op_type']} | `{shapes}` | {row['per_step']:g} | {row['ms_per_step']:.1f} | {row['gflops']:.0f} |"
        )
    return lines


def keep_profile_section(markdown: str, old_markdown: str) -> str:
    """``markdown`` (BENCHMARKS.md as ``mindmoe-bench`` renders it, which has no profile section) with the
    hand-written profile section of ``old_markdown`` put back after the train_step section, or appended.

    The profile is measured by this script, not by a bench run, so a regeneration must not drop it."""
    section = existing_section(old_markdown, PROFILE_SECTION)
    if not section or existing_section(markdown, PROFILE_SECTION):
        return markdown
    section = section.rstrip("\n") + "\n"
    anchor = existing_section(markdown, "## train_step")
    if not anchor or not markdown[markdown.find(anchor) + len(anchor) :]:
        return (markdown.rstrip("\n") + "\n\n" if markdown else "") + section
    at = markdown.find(anchor) + len(anchor)
    return markdown[:at].rstrip("\n") + "\n\n" + section + "\n" + markdown[at:]


def profile(kind: str, layers: int, steps: int, warmup: int, size_name: str, out_dir: str) -> dict:
    from mindmoe.bench import cases
    from mindmoe.bench.specs import SIZES, model_config

    ms = cases._graph_mode()
    from mindspore.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

    from mindmoe.train.metrics import measure_peak_gflops, train_flops_per_token

    size = SIZES[size_name]
    cfg = model_config(size, kind, num_layers=layers)
    trainer, num_params = cases.build_trainer(cfg)
    windows = [cases.random_windows(size, size.micro_batch, seed) for seed in range(warmup + steps)]
    start = time.perf_counter()
    trainer.step([windows[0]])
    first_step_s = time.perf_counter() - start
    unprofiled = [cases.timed(trainer.step, [w])[0] for w in windows[1:warmup]]
    peak = measure_peak_gflops(size.gemm_size, trials=PEAK_TRIALS)
    spans = []
    with ms.profiler.profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=0, active=steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(out_dir),
    ) as prof:
        for window in windows[warmup:]:
            begin = time.time_ns()
            trainer.step([window])
            spans.append((begin, time.time_ns()))
            prof.step()
    peak = max(peak, measure_peak_gflops(size.gemm_size, trials=PEAK_TRIALS))
    unprofiled += [cases.timed(trainer.step, [w])[0] for w in windows[1:warmup]]
    # The profiler names its directory after this process (``<host>_<pid>_<time>_ascend_ms``): an --out reused from an
    # earlier run keeps that run's directory beside it.
    (framework_dir,) = glob.glob(os.path.join(out_dir, f"*_{os.getpid()}_*", "FRAMEWORK"))
    summary = summarize(read_executions(framework_dir), spans, peak, cfg.resolved_head_dim)
    tokens = size.micro_batch * size.seq_len
    return {
        "model": kind,
        "layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "seq_len": size.seq_len,
        "micro_batch": size.micro_batch,
        "params": num_params,
        "model_gflop_per_step": train_flops_per_token(cfg, size.seq_len) * tokens / 1e9,
        "first_step_s": first_step_s,
        "unprofiled_step_ms": 1e3 * statistics.median(unprofiled) if unprofiled else None,
        "unprofiled_step_ms_all": [1e3 * t for t in unprofiled],
        "tokens_per_s_profiled": tokens / (summary["step_ms"] / 1e3),
        # Recording each kernel costs host time; without the profiler, host time ~ step - the same kernels
        # (steps timed apart from the profiled ones: under a varying load of other users this is rough).
        "host_unprofiled_ms": 1e3 * statistics.median(unprofiled) - summary["kernel_ms"] if unprofiled else None,
        **summary,
        "trace_dir": out_dir,
    }


def main(argv=None) -> int:
    from mindmoe.conf.quiet import quiet_framework_logs

    quiet_framework_logs()
    parser = argparse.ArgumentParser(prog="python -m mindmoe.bench.profile_step", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "moe"), required=True)
    parser.add_argument("--layers", type=int, default=0, help="layer count (default: the size's, 8 at full)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument(
        "--warmup", type=int, default=4, help="steps before profiling (the first compiles; the rest timed)"
    )
    parser.add_argument("--size", choices=("full", "quick"), default="full")
    parser.add_argument("--out", default="", help="profiler output directory (default: a new temporary one)")
    parser.add_argument("--markdown", action="store_true", help="also print the BENCHMARKS.md tables")
    args = parser.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="mindmoe_profile_")
    summary = profile(args.model, args.layers, args.steps, max(args.warmup, 1), args.size, out_dir)
    print(json.dumps(summary), flush=True)  # one line, the last: MindSpore's parser prints progress before it
    if args.markdown:
        print("\n".join(markdown_tables(summary)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
