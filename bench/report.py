"""BENCHMARKS.md from the rows of one run, and the machine description that heads it."""

import os
import platform

from mindmoe.bench.specs import CAPACITY_FACTOR, NUM_EXPERTS, TOP_K

GIB = 2**30
# Acceptance targets of the benchmark figures (issue "Benchmarks and speed").
TARGETS = {
    "mfu_moe": 0.5,
    "mfu_dense": 0.55,
    "torch_ratio": 1.0,
    "moe_overhead": 0.8,
    "compile_ratio": 2.0,
    "peak_rss_ratio": 1.5,
}


def _proc_field(path: str, key: str) -> str:
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine_description() -> dict:
    import mindspore

    description = {
        "cpu": _proc_field("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "ram_gib": None,
        "mindspore": mindspore.__version__,
        "python": platform.python_version(),
    }
    mem_kib = _proc_field("/proc/meminfo", "MemTotal").split()[0]
    if mem_kib.isdigit():
        description["ram_gib"] = round(int(mem_kib) / 2**20, 1)
    try:
        import torch

        description["torch"] = torch.__version__
    except ImportError:
        description["torch"] = "not installed"
    return description


def _fmt(value, digits=2):
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def headline_rows(rows: list) -> list:
    """``[figure, value, target, holds]`` for every acceptance figure present in ``rows``."""
    out = []

    def add(name, value, target, higher_is_better=True):
        holds = value >= target if higher_is_better else value <= target
        out.append([name, value, (">= " if higher_is_better else "<= ") + _fmt(target), "yes" if holds else "no"])

    for row in rows:
        case = row["case"]
        if case == "train_step":
            add(f"{row['model']} MFU (of the best MatMul rate)", row["mfu"], TARGETS["mfu_" + row["model"]])
            add(
                f"{row['model']} peak RSS / (params+grads+AdamW + activations)",
                row["peak_rss_ratio"],
                TARGETS["peak_rss_ratio"],
                higher_is_better=False,
            )
        elif case == "torch_reference" and row.get("variant") == "best":
            add(f"{row['model']} tokens/s, mindmoe / best PyTorch", row["torch_ratio"], TARGETS["torch_ratio"])
        elif case == "moe_overhead":
            add("moe_overhead (MoE tokens/s / dense)", row["moe_overhead"], TARGETS["moe_overhead"])
            add(
                "moe_overhead by CPU time (MoE tokens per CPU s / dense)",
                row["moe_overhead_cpu"],
                TARGETS["moe_overhead"],
            )
        elif case == "compile_scaling" and "compile_ratio" in row:
            # The target is for cell reuse; without it compile time grows with the layer count.
            reuse = "works" in row.get("cell_reuse", "")
            add(
                f"compile time {row['layers'][-1]} / {row['layers'][0]} layers"
                + ("" if reuse else " (no cell reuse here: the target applies where it works)"),
                row["compile_ratio"],
                TARGETS["compile_ratio"],
                higher_is_better=False,
            )
    return out


def torch_section(rows: list) -> list:
    """The PyTorch rows: the best variant on this machine (the target's) and the plain eager one."""
    lines = [
        "## torch_reference",
        "",
        "The same models in PyTorch (`bench/torch_reference.py`) on the same windows, eager experts loop; "
        "their steps alternate with mindmoe's in the train_step process. **best** = what a good PyTorch "
        "engineer runs on CPU: `F.scaled_dot_product_attention` with the document-causal mask, "
        "`AdamW(fused=True)` or `foreach=True` (the faster here), `torch.compile` when it is faster than eager "
        "here (all chosen by timing at the start of the case); **eager** = the model written plainly "
        "(matmul-softmax attention, default AdamW). CPU = process CPU time (all threads) instead of wall time.",
        "",
    ]
    table = []
    for r in rows:
        variant = r.get("variant", "eager")  # rows of runs before the best variant existed
        ratio = r["torch_ratio"] if variant == "best" else r.get("torch_eager_ratio", r["torch_ratio"])
        cpu_ratio = r["torch_cpu_ratio"] if variant == "best" else r.get("torch_eager_cpu_ratio", r["torch_cpu_ratio"])
        table.append(
            [
                r["model"],
                variant,
                r.get("attention", "matmul-softmax"),
                r.get("optimizer", "loop"),
                "yes" if r.get("compiled") else "no",
                r["step_s"],
                r["tokens_per_s"],
                ratio,
                cpu_ratio,
                r["threads"],
                r["load_avg"],
            ]
        )
    header = ["model", "variant", "attention", "AdamW", "compiled", "step s", "tokens/s", "mindmoe / this"]
    lines += _table(header + ["mindmoe / this (CPU time)", "threads", "load"], table)
    for r in rows:
        if r.get("variant") == "best":
            lines.append(
                f"- {r['model']}: AdamW step s {_step_times(r['optimizer_step_s'])}; "
                f"torch.compile {r['torch_compile']}"
                + (f" (compile {r['compile_s']:.1f} s)" if "compile_s" in r else "")
            )
    return lines + [""] if any(r.get("variant") == "best" for r in rows) else lines


def _step_times(by_name: dict) -> str:
    return ", ".join(f"{name} {seconds:.3g}" for name, seconds in by_name.items())


def render_markdown(rows: list, machine: dict, run_id: str, size) -> str:
    by_case = {}
    for row in rows:
        by_case.setdefault(row["case"], []).append(row)
    lines = [
        "# Benchmarks",
        "",
        "Regenerated by `mindmoe-bench` (`python -m mindmoe.bench`); the JSON rows are appended to "
        "`bench/results.jsonl`.",
        "Every figure below comes from one run, each case in its own process; ratios compare rows of that run.",
        "",
        f"- Run: {run_id}" + (f" (wall {machine['wall_s']} s)" if "wall_s" in machine else ""),
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']} GiB RAM, no accelerator",
        f"- MindSpore {machine['mindspore']}, PyTorch {machine['torch']}, Python {machine['python']}",
        f"- Load average (1 min) at start / end: {machine.get('load_avg_start')} / {machine.get('load_avg_end')}"
        " (the machine is shared; each row records the load during its case)",
        f"- Models: hidden {size.hidden_size}, {size.num_layers} layers, {size.num_heads} heads "
        f"({size.num_kv_heads} kv), vocab {size.vocab_size}, seq {size.seq_len}, micro-batch {size.micro_batch}; "
        f"dense FFN width {TOP_K * size.expert_width} vs {NUM_EXPERTS} experts of width {size.expert_width}, "
        f"top-{TOP_K}, capacity factor {CAPACITY_FACTOR} (equal active parameters)",
        "- FLOPs per token (training) = 6 x active matmul params + 6 x layers x seq x heads x head_dim "
        "(`train.metrics.train_flops_per_token`; the second term is causal attention; every weight trains here, "
        "a frozen one would count 4: no weight gradient)",
        "- MFU = model FLOPs/s over the fp32 MatMul rate measured on this machine in the run (the higher of "
        "MindSpore's and PyTorch's), not a datasheet peak",
        "",
    ]
    headline = headline_rows(rows)
    if headline:
        lines += ["## Against the targets", ""] + _table(["figure", "value", "target", "holds"], headline)
    if "gemm_peak" in by_case:
        row = by_case["gemm_peak"][0]
        lines += ["## gemm_peak", "", f"fp32 {row['matrix_size']}x{row['matrix_size']} MatMul, best of 3 x 8.", ""]
        lines += _table(
            ["MindSpore GFLOP/s", "NumPy GFLOP/s", "PyTorch GFLOP/s", "load"],
            [[row["gflops"], row["numpy_gflops"], row.get("torch_gflops", "-"), row["load_avg"]]],
        )
    if "train_step" in by_case:
        lines += [
            "## train_step",
            "",
            "`train.step.CompiledStep` with `train.optim` (mindformers AdamW, fused update), median of the timed "
            "steps after the warm-up steps of `bench.specs` (4 at full size: the first compiles, and the next ones "
            "ran up to 20 % slower than the rest, PyTorch's eager step too; every step function gets the same warm-up "
            "windows). "
            "compile = first step - median step. Peak RSS ratio = (peak RSS - RSS after importing the "
            "framework) / (16 bytes x params + activations), activations = the fp32 tensors the step keeps for "
            "backward, computed per layer from their shapes (`bench.specs.activation_bytes`), not measured. "
            "MFU = against the best fp32 MatMul rate of the run (the higher of MindSpore's and PyTorch's in "
            "gemm_peak, and the MindSpore MatMuls timed in the step processes: load only lowers it); MFU local = "
            "against the MatMul timed in the step's own process right after its steps.",
            "",
        ]
        lines += _table(
            [
                "model",
                "params (M)",
                "MFLOP/token",
                "step s",
                "CPU s",
                "tokens/s",
                "peak GFLOP/s",
                "MFU",
                "MFU local",
                "compile s",
                "peak RSS GiB",
                "theory GiB",
                "activations GiB",
                "RSS ratio",
                "load",
            ],
            [
                [
                    r["model"],
                    r["params"] / 1e6,
                    r["flops_per_token"] / 1e6,
                    r["step_s"],
                    r["cpu_s"],
                    r["tokens_per_s"],
                    r["peak_gflops"],
                    r["mfu"],
                    r["mfu_local"],
                    r["compile_s"],
                    r["peak_rss"] / GIB,
                    r["theoretical_bytes"] / GIB,
                    r["activation_bytes"] / GIB,
                    r["peak_rss_ratio"],
                    r["load_avg"],
                ]
                for r in by_case["train_step"]
            ],
        )
    if "torch_reference" in by_case:
        lines += torch_section(by_case["torch_reference"])
    if "moe_overhead" in by_case:
        row = by_case["moe_overhead"][0]
        lines += [
            "## moe_overhead",
            "",
            "Dispatch = router softmax/top-k, capacity slots, gather and combine, "
            "forward + backward, timed alone at the step's token count, times the MoE layers.",
            "",
        ]
        lines += _table(
            [
                "MoE / dense tokens/s",
                "same by CPU time",
                "dispatch share of MoE step",
                "dispatch s",
                "MoE step s",
                "dense step s",
            ],
            [
                [
                    row["moe_overhead"],
                    row["moe_overhead_cpu"],
                    row["dispatch_share"],
                    row["dispatch_s"],
                    row["moe_step_s"],
                    row["dense_step_s"],
                ]
            ],
        )
    if "compile_scaling" in by_case:
        per_layer = [
            r for r in by_case["compile_scaling"] if not isinstance(r["layers"], list) and not r.get("lazy_inline")
        ]
        summary = [r for r in by_case["compile_scaling"] if isinstance(r["layers"], list)]
        lines += [
            "## compile_scaling",
            "",
            f"MoE train step at hidden {size.compile_hidden}, batch 1."
            + (
                f" Cell reuse (`train.cell_reuse=true`, meant for Ascend): {summary[0]['cell_reuse']}."
                if summary
                else ""
            ),
            "",
        ]
        lines += _table(
            ["layers", "compile s", "first step s", "step s", "load"],
            [[r["layers"], r["compile_s"], r["first_step_s"], r["step_s"], r["load_avg"]] for r in per_layer],
        )
    if "data_pipeline" in by_case:
        row = by_case["data_pipeline"][0]
        lines += [
            "## data_pipeline",
            "",
            "MindRecord `WindowLoader` reading micro-batches vs the fastest train step's consumption.",
            "",
        ]
        lines += _table(
            ["loader batches/s", "train step batches/s", "headroom (x)", "load"],
            [[row["batches_per_s"], row["train_batches_per_s"], row["headroom"], row["load_avg"]]],
        )
    if "hf_load_memory" in by_case:
        row = by_case["hf_load_memory"][0]
        lines += ["## hf_load_memory", ""]
        lines += _table(
            ["file GiB", "peak growth GiB", "model GiB", "budget met", "stream s"],
            [
                [
                    row["file_gib"],
                    row["peak_growth_gib"],
                    row["model_param_gib"],
                    row["budget_met"],
                    row["stream_seconds"],
                ]
            ],
        )
    return "\n".join(lines)
