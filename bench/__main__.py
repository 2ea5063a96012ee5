"""``python -m mindmoe.bench`` / ``mindmoe-bench``: measure, print one JSON line per row, append them to a
results file and regenerate BENCHMARKS.md.

    mindmoe-bench                        # the default cases at the full size (< 20 min on 2 cores)
    mindmoe-bench --quick                # tiny models: a smoke test of the command, figures meaningless
    mindmoe-bench --cases train_step,torch_reference
    mindmoe-bench --cases hf_load_memory # opt-in: peak RSS of importing a ~1 GiB HF checkpoint
    mindmoe-bench --cases scaling        # opt-in: mindmoe-train runs at 8-256 experts, 1k-8k tokens, 152k vocab

Each measurement runs in a fresh process, so ``peak_rss`` (``VmHWM``: :mod:`bench.peak_memory`) is that case's alone;
the ratios (``mfu``, ``torch_ratio``, ``torch_eager_ratio``, ``moe_overhead``) are formed from rows of
the same run.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mindmoe.bench import scaling
from mindmoe.bench.profile_step import keep_profile_section
from mindmoe.bench.report import machine_description, render_markdown
from mindmoe.bench.specs import SIZES
from mindmoe.conf.quiet import quiet_framework_logs

BENCH_DIR = Path(__file__).resolve().parent
RESULT_MARK = "BENCH_RESULT "
DEFAULT_CASES = ("gemm_peak", "train_step", "torch_reference", "moe_overhead", "compile_scaling", "data_pipeline")
OPT_IN_CASES = ("hf_load_memory", "scaling")
# Cases with their own section of BENCHMARKS.md, kept from the file when a run does not measure them.
SECTION_CASES = ("scaling",)
# Cases whose figures are ratios of other cases' measurements.
NEEDS = {
    "gemm_peak": (),
    "train_step": ("gemm_peak",),
    "torch_reference": ("train_step",),
    "moe_overhead": ("train_step",),
    "compile_scaling": (),
    "data_pipeline": ("train_step",),
    "hf_load_memory": (),
    "scaling": (),
}
HF_LOAD_GIB = {"full": 1.0, "quick": 0.02}


def load_average() -> float:
    with open("/proc/loadavg") as handle:
        return float(handle.read().split()[0])


def run_child(task: dict) -> dict:
    """One measurement in a fresh interpreter; returns its dict plus that process's peak RSS."""
    env = dict(os.environ)
    root = str(BENCH_DIR.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    load_before = load_average()
    child = subprocess.run(
        [sys.executable, "-m", "mindmoe.bench", "--child", json.dumps(task)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if child.returncode or not lines:
        raise RuntimeError(f"benchmark task {task} failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT_MARK) :])
    result["load_avg"] = round(max(load_before, load_average()), 2)
    return result


def child_main(task: dict) -> None:
    from mindmoe.bench import cases

    size = SIZES[task["size"]]
    name = task["task"]
    if name == "gemm_peak":
        result = cases.gemm_peak(size)
    elif name == "train_step":
        result = cases.train_step(
            size, task["model"], task.get("micro_batch", 0), task.get("steps", 0), task.get("with_torch", False)
        )
    elif name == "compile":
        result = cases.compile_time(size, task["layers"], task.get("lazy_inline", False))
    elif name == "data_pipeline":
        result = cases.data_pipeline(size)
    else:
        raise SystemExit(f"unknown benchmark task {name!r}")
    result["peak_rss"] = cases.own_peak_rss()
    print(RESULT_MARK + json.dumps(result), flush=True)


def hf_load_memory(size_name: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(BENCH_DIR.parent) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    child = subprocess.run(
        [sys.executable, str(BENCH_DIR / "hf_load_memory.py"), "--gib", str(HF_LOAD_GIB[size_name])],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if child.returncode:
        raise RuntimeError(f"hf_load_memory failed:\n{child.stderr[-3000:]}")
    row = json.loads(child.stdout.strip().splitlines()[-1])
    row.pop("case")
    return row


def add_mfu(gemm_row: dict, step_rows: list) -> None:
    """MFU of each train step against the best fp32 MatMul rate measured in the run.

    The higher of MindSpore's and PyTorch's rates in gemm_peak, and the MindSpore MatMuls timed
    inside the step processes: other users' load only ever lowers a measured rate, so the best one
    is the closest to the machine's limit.
    """
    rates = [gemm_row["gflops"], gemm_row.get("torch_gflops", 0.0)] + [row["local_gflops"] for row in step_rows]
    peak_gflops = max(rates)
    for row in step_rows:
        row["peak_gflops"] = peak_gflops
        row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / (peak_gflops * 1e9)
        # Against a MatMul timed in the step's own process right after its steps (same load).
        row["mfu_local"] = row["tokens_per_s"] * row["flops_per_token"] / (row["local_gflops"] * 1e9)


def rerender(results: Path, markdown: Path) -> None:
    """BENCHMARKS.md again from the last full or quick run in ``results`` (no new measurement); a section
    case's section from the last run that measured it (else kept from ``markdown``), and the profile section
    (bench/profile_step.py) kept from ``markdown``."""
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "run" in row]
    main_rows = [row for row in rows if row["case"] not in SECTION_CASES]
    if not rows:
        raise SystemExit(f"--rerender: no benchmark rows in {results}")
    old = markdown.read_text() if markdown.exists() else ""
    text = old
    if main_rows:
        run_rows = [row for row in main_rows if row["run"] == main_rows[-1]["run"]]
        gemm = [row for row in run_rows if row["case"] == "gemm_peak"]
        steps = [row for row in run_rows if row["case"] == "train_step"]
        if gemm and steps:
            add_mfu(gemm[0], steps)
        machine = machine_description()
        machine["load_avg_start"] = next(row["load_avg"] for row in run_rows if "load_avg" in row)
        machine["load_avg_end"] = [row["load_avg"] for row in run_rows if "load_avg" in row][-1]
        text = render_markdown(run_rows, machine, run_rows[0]["run"], SIZES[run_rows[0]["size"]])
        print(f"wrote {markdown} from run {run_rows[0]['run']} of {results}", file=sys.stderr)
    scaling_rows = [row for row in rows if row["case"] == "scaling"]
    scaling_rows = [row for row in scaling_rows if row["run"] == scaling_rows[-1]["run"]] if scaling_rows else []
    markdown.write_text(scaling.splice(keep_profile_section(text, old), section_text(scaling_rows, old)))


def section_text(scaling_rows: list, old_markdown: str) -> str:
    """The Scaling section: from these rows, else the one ``old_markdown`` has ("" if none)."""
    if scaling_rows:
        return "\n".join(scaling.markdown_section(scaling_rows))
    return scaling.existing_section(old_markdown)


def write_markdown(path: Path, run, machine: dict) -> None:
    """BENCHMARKS.md from this run; a run of section cases only rewrites just their sections. The hand-written
    profile section (bench/profile_step.py) is kept from the old file."""
    old = path.read_text() if path.exists() else ""
    measured_main = any(row["case"] not in SECTION_CASES for row in run.rows)
    text = render_markdown(run.rows, machine, run.run_id, run.size) if measured_main or not old else old
    text = keep_profile_section(text, old)
    path.write_text(scaling.splice(text, section_text([r for r in run.rows if r["case"] == "scaling"], old)))


class Run:
    """Runs the selected cases in dependency order and derives the cross-case ratios."""

    def __init__(self, size_name: str, results_path: Path, selected: list):
        self.selected = selected
        self.size_name = size_name
        self.size = SIZES[size_name]
        self.results_path = results_path
        self.run_id = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.rows = []
        self.measured = {}

    def emit(self, case: str, row: dict) -> dict:
        row = {"case": case, **row, "run": self.run_id, "size": self.size_name}
        print(json.dumps(row), flush=True)
        self.results_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.results_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        self.rows.append(row)
        return row

    def task(self, **task) -> dict:
        return run_child({"size": self.size_name, **task})

    def case(self, name: str) -> None:
        if name in self.measured:
            return
        for dependency in NEEDS[name]:
            self.case(dependency)
        self.measured[name] = getattr(self, "case_" + name)()

    def case_gemm_peak(self):
        return self.emit("gemm_peak", self.task(task="gemm_peak"))

    def case_train_step(self):
        measured = {}
        self.torch_rows = {}
        for kind in ("dense", "moe"):
            row = self.task(task="train_step", model=kind, with_torch="torch_reference" in self.selected)
            if "torch" in row:
                self.torch_rows[kind] = row.pop("torch")
            row["peak_rss"] = row.pop("mindmoe_peak_rss")  # before PyTorch ran in the same process
            # activation_bytes comes from the shapes the step keeps (bench.specs.activation_bytes).
            row["peak_rss_ratio"] = (row["peak_rss"] - row["framework_rss"]) / (
                row["theoretical_bytes"] + row["activation_bytes"]
            )
            measured[kind] = row
        add_mfu(self.measured["gemm_peak"], list(measured.values()))
        return {kind: self.emit("train_step", row) for kind, row in measured.items()}

    def case_torch_reference(self):
        """Per model a ``best`` and an ``eager`` PyTorch row; the target is on ``torch_ratio`` (vs best)."""
        rows = {}
        for kind in ("dense", "moe"):
            mindmoe = self.measured["train_step"][kind]
            variants = self.torch_rows[kind]
            # Steps of all three alternated in one process on the same windows: the ratios see one load.
            ratios = {
                "torch_ratio": mindmoe["tokens_per_s"] / variants["best"]["tokens_per_s"],
                "torch_cpu_ratio": mindmoe["tokens_per_cpu_s"] / variants["best"]["tokens_per_cpu_s"],
                "torch_eager_ratio": mindmoe["tokens_per_s"] / variants["eager"]["tokens_per_s"],
                "torch_eager_cpu_ratio": mindmoe["tokens_per_cpu_s"] / variants["eager"]["tokens_per_cpu_s"],
            }
            for variant in ("best", "eager"):
                row = {**variants[variant], "variant": variant, **ratios, "load_avg": mindmoe["load_avg"]}
                rows[(kind, variant)] = self.emit("torch_reference", row)
        return rows

    def case_moe_overhead(self):
        dense, moe = self.measured["train_step"]["dense"], self.measured["train_step"]["moe"]
        return self.emit(
            "moe_overhead",
            {
                "moe_overhead": moe["tokens_per_s"] / dense["tokens_per_s"],
                # The two steps ran minutes apart; CPU time is far less sensitive to the load in between.
                "moe_overhead_cpu": moe["tokens_per_cpu_s"] / dense["tokens_per_cpu_s"],
                "dispatch_share": moe["dispatch_s"] / moe["step_s"],
                "dispatch_s": moe["dispatch_s"],
                "moe_step_s": moe["step_s"],
                "dense_step_s": dense["step_s"],
            },
        )

    def case_compile_scaling(self):
        rows = [self.task(task="compile", layers=layers) for layers in self.size.compile_layers]
        for row in rows:
            self.emit("compile_scaling", row)
        # Cell reuse (lazy_inline) is documented for Ascend; try it here and report what happens.
        reuse = self.emit(
            "compile_scaling", self.task(task="compile", layers=self.size.compile_layers[0], lazy_inline=True)
        )
        cell_reuse = "works" if "error" not in reuse else f"fails here: {reuse['error']}"
        return self.emit(
            "compile_scaling",
            {
                "layers": [row["layers"] for row in rows],
                "compile_s": rows[-1]["compile_s"],
                "compile_ratio": rows[-1]["compile_s"] / max(rows[0]["compile_s"], 1e-9),
                "cell_reuse": "lazy_inline " + cell_reuse,
            },
        )

    def case_data_pipeline(self):
        row = self.task(task="data_pipeline")
        fastest_step_s = min(r["step_s"] for r in self.measured["train_step"].values())
        row["train_batches_per_s"] = 1.0 / fastest_step_s
        row["headroom"] = row["batches_per_s"] * fastest_step_s
        return self.emit("data_pipeline", row)

    def case_hf_load_memory(self):
        return self.emit("hf_load_memory", hf_load_memory(self.size_name))

    def case_scaling(self):
        return scaling.measure(self.size_name, BENCH_DIR.parent, lambda row: self.emit("scaling", row))


def parse_cases(text: str) -> list:
    cases = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in cases if c not in NEEDS]
    if unknown:
        raise SystemExit(f"--cases: unknown case(s) {unknown}; choose from {sorted(NEEDS)}")
    return cases


def main(argv=None) -> int:
    quiet_framework_logs()
    parser = argparse.ArgumentParser(prog="mindmoe-bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated cases (default: {','.join(DEFAULT_CASES)}; opt-in: {','.join(OPT_IN_CASES)})",
    )
    parser.add_argument("--quick", action="store_true", help="tiny models: checks the command, not the machine")
    parser.add_argument(
        "--results",
        type=Path,
        default=BENCH_DIR / "results.jsonl",
        help="JSON lines are appended here (default: bench/results.jsonl)",
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        default=BENCH_DIR.parent / "BENCHMARKS.md",
        help="regenerated from this run's rows (default: BENCHMARKS.md); '-' to skip",
    )
    parser.add_argument(
        "--rerender",
        action="store_true",
        help="only rewrite --markdown from the last run in --results, measuring nothing",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return 0
    if args.rerender:
        rerender(args.results, args.markdown)
        return 0
    selected = parse_cases(args.cases)
    run = Run("quick" if args.quick else "full", args.results, selected)
    machine = machine_description()
    machine["load_avg_start"] = load_average()
    started = time.perf_counter()
    for name in selected:
        run.case(name)
    machine["load_avg_end"] = load_average()
    machine["wall_s"] = round(time.perf_counter() - started, 1)
    if str(args.markdown) != "-":
        write_markdown(args.markdown, run, machine)
        print(f"wrote {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
