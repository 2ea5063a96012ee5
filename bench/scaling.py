"""The opt-in ``scaling`` case: short ``mindmoe-train`` runs as the expert count, length and vocabulary grow,
and two 2-worker ``mindmoe-launch`` runs of expert parallelism (``allgather`` against ``alltoall``).

Each row is one ``mindmoe-train`` process on the bundled corpus, as a user would run it: its tokens/s
is the median logged ``tokens_per_s`` after the first log row (which holds the compile), its peak RSS
the whole process's (data preparation and final validation included), taken from ``wait4`` as
``/usr/bin/time`` does, in a small process between (:mod:`bench.peak_memory`: a process started directly
reports the peak of the one that started it when that was larger). One factor changes at a time around each
group's base point. A run that fails (out of memory, say) is a row saying how, not an error of the bench.
"""

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mindmoe.bench.peak_memory import run_measured
from mindmoe.bench.report import _proc_field, _table

GIB = 2**30
TIMEOUT_S = 900

# The measurement: a tiny fine-grained MoE, default data (seq 128, 16 sequences per step).
EXPERTS_BASE = ("model.top_k=8", "model.moe_intermediate_size=32")
DISPATCH = {
    "capacity": ("moe.dispatch=capacity", "moe.capacity_factor=1.25"),
    "dropless": ("moe.dispatch=dropless",),
}
# One sequence per step; RoPE tables long enough for every length of the group.
LENGTH_BASE = ("data.micro_batch_size=1", "data.global_batch_size=1", "model.max_position_embeddings=8192")
COMMON = ("train.progress_bar=false",)
# dropless / capacity at top-8: tokens/s at least this (RSS at most DROPLESS_RSS_LIMIT x) per expert count.
DROPLESS_SPEED_TARGET = {64: 0.8, 128: 0.7, 256: 0.7}
DROPLESS_RSS_LIMIT = 1.3
# (RSS(4k) - RSS(2k)) <= this x max(RSS(2k) - RSS(1k), 0.25 GiB): peak RSS about linear in length.
LENGTH_GROWTH_LIMIT = 2.3
# Expert parallelism on 2 workers, the experts group's 64/8 capacity model: alltoall / allgather tokens/s.
# Micro-batches of 4 of the 16 sequences: allgather accumulates 4 per group, alltoall 2 per rank (dp 2).
EP_BASE = (
    "model.num_experts=64",
    *EXPERTS_BASE,
    *DISPATCH["capacity"],
    "data.micro_batch_size=4",
    "launch.procs_per_node=2",
    "parallel.ep=2",
)
EP_DISPATCHERS = ("allgather", "alltoall")
ALLTOALL_SPEED_TARGET = 1.3


@dataclass(frozen=True)
class Grid:
    experts: tuple
    lengths: tuple
    vocabs: tuple
    vocab_length: int  # data.seq_len of the vocabulary rows
    long_row: tuple  # (seq_len, vocab) of the one run that must fit in memory, or ()
    experts_steps: tuple  # (train.max_steps, train.log_every)
    length_steps: tuple
    expert_parallel: bool = True  # the two 2-worker runs


GRIDS = {
    "full": Grid((8, 64, 128, 256), (1024, 2048, 4096, 8192), (8192, 151552), 2048, (8192, 151552), (40, 10), (3, 1)),
    # A smoke test of the case: figures meaningless.
    "quick": Grid((8,), (128,), (8192,), 128, (), (2, 1), (2, 1), expert_parallel=False),
}


@dataclass(frozen=True)
class ScalingRun:
    group: str  # experts | length | vocab | expert parallel
    label: str
    overrides: tuple
    launcher: bool = False  # mindmoe-launch (msrun workers) instead of one mindmoe-train process

    @property
    def command(self) -> str:
        return ("mindmoe-launch " if self.launcher else "mindmoe-train ") + " ".join(self.overrides)

    @property
    def module(self) -> str:
        return "mindmoe.launch.cli" if self.launcher else "mindmoe.train.cli"


def _steps(steps: tuple) -> tuple:
    return (f"train.max_steps={steps[0]}", f"train.log_every={steps[1]}")


def scaling_runs(size_name: str) -> list:
    """The runs of the case at ``size_name`` (``full`` or ``quick``), in the order they run."""
    grid = GRIDS[size_name]
    runs = []
    for experts in grid.experts:
        for dispatch, dispatch_overrides in DISPATCH.items():
            overrides = (f"model.num_experts={experts}", *EXPERTS_BASE, *dispatch_overrides)
            runs.append(ScalingRun("experts", f"{experts}/8 {dispatch}", overrides + _steps(grid.experts_steps)))
    length_steps = _steps(grid.length_steps)
    for length in grid.lengths:
        runs.append(ScalingRun("length", f"seq {length}", (*LENGTH_BASE, f"data.seq_len={length}", *length_steps)))
    for vocab in grid.vocabs:
        overrides = (*LENGTH_BASE, f"data.seq_len={grid.vocab_length}", f"model.vocab_size={vocab}", *length_steps)
        runs.append(ScalingRun("vocab", f"vocab {vocab}", overrides))
    if grid.long_row:
        length, vocab = grid.long_row
        overrides = (*LENGTH_BASE, f"data.seq_len={length}", f"model.vocab_size={vocab}", *length_steps)
        runs.append(ScalingRun("vocab", f"seq {length}, vocab {vocab}", overrides))
    if grid.expert_parallel:
        for dispatcher in EP_DISPATCHERS:
            overrides = (*EP_BASE, f"parallel.ep_dispatcher={dispatcher}", *_steps(grid.experts_steps))
            runs.append(ScalingRun("expert parallel", f"ep 2 {dispatcher}", overrides, launcher=True))
    return [ScalingRun(r.group, r.label, r.overrides + COMMON, r.launcher) for r in runs]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def median_tokens_per_s(metrics_path: Path):
    """Median ``tokens_per_s`` of the logged training rows after the first; None without two rows."""
    if not metrics_path.exists():
        return None, 0
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    speeds = [row["tokens_per_s"] for row in sorted(rows, key=lambda r: r["step"]) if "tokens_per_s" in row]
    return (statistics.median(speeds[1:]) if len(speeds) > 1 else None), len(speeds)


def failure(returncode: int, stderr: str) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    lines = [line.strip() for line in stderr.splitlines()]
    marked = [i for i, line in enumerate(lines) if "Error" in line or "error:" in line]
    if not marked:
        return f"exit {returncode}: no error line"
    # MindSpore's errors put their message on the lines after "RuntimeError:": keep the first of them too.
    last = marked[-1]
    message = lines[last] + next((" " + line for line in lines[last + 1 :] if line.strip("-")), "")
    return f"exit {returncode}: " + (message if lines[last].endswith(":") else lines[last])[:300]


def run_one(run: ScalingRun, root: Path, work: Path, keep_run_dir: Path = None) -> dict:
    """``run`` in a fresh process; its peak RSS from :func:`bench.peak_memory.run_measured`: the largest of the
    process and the children it waited for (with ``mindmoe-launch``: the largest worker), not counting what the
    process running this held. Its run directory is deleted, unless it is ``keep_run_dir``."""
    run_dir = keep_run_dir or work / run.label.replace(" ", "_").replace("/", "-").replace(",", "")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    command = [sys.executable, "-m", run.module, *run.overrides, f"hydra.run.dir={run_dir}"]
    if run.launcher:
        command.append(f"launch.master_port={free_port()}")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with open(work / "stderr.txt", "w+") as stderr:
        returncode, peak_rss = run_measured(
            command, TIMEOUT_S, work / "peak_rss.txt", stdout=subprocess.DEVNULL, stderr=stderr, cwd=root, env=env
        )
        stderr.seek(0)
        errors = stderr.read()[-20000:]
    row = {
        "group": run.group,
        "label": run.label,
        "command": run.command,
        "wall_s": round(time.perf_counter() - started, 1),
        "peak_rss": peak_rss,
        "load_avg": round(max(load_before, os.getloadavg()[0]), 2),
    }
    tokens_per_s, log_rows = median_tokens_per_s(run_dir / "metrics.jsonl")
    if keep_run_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint: up to GiBs at a large vocabulary
    row.update(tokens_per_s=tokens_per_s, log_rows=log_rows)
    if returncode is None:
        row["status"] = f"timed out after {TIMEOUT_S} s"
    elif returncode:
        row["status"] = failure(returncode, errors)
    else:
        row["status"] = "ok" if tokens_per_s is not None else f"ok, but {log_rows} log row(s): no speed"
    return row


def ratios(rows: list) -> list:
    """The acceptance figures formed from the run rows: dropless / capacity per expert count, length growth."""
    by_label = {row["label"]: row for row in rows}
    out = []

    def add(figure, value, target, higher_is_better):
        holds = value >= target if higher_is_better else value <= target
        bound = (">= " if higher_is_better else "<= ") + str(target)
        out.append({"figure": figure, "value": value, "target": bound, "holds": holds})

    for experts, target in DROPLESS_SPEED_TARGET.items():
        capacity, dropless = by_label.get(f"{experts}/8 capacity"), by_label.get(f"{experts}/8 dropless")
        if capacity and dropless and capacity["tokens_per_s"] and dropless["tokens_per_s"]:
            speed = dropless["tokens_per_s"] / capacity["tokens_per_s"]
            add(f"{experts}/8 dropless / capacity tokens/s", speed, target, True)
            rss = dropless["peak_rss"] / capacity["peak_rss"]
            add(f"{experts}/8 dropless / capacity peak RSS", rss, DROPLESS_RSS_LIMIT, False)
    lengths = [by_label.get(f"seq {length}") for length in (1024, 2048, 4096)]
    if all(row and row["status"] == "ok" for row in lengths):
        rss_1k, rss_2k, rss_4k = (row["peak_rss"] for row in lengths)
        growth = (rss_4k - rss_2k) / max(rss_2k - rss_1k, 0.25 * GIB)
        add("peak RSS (4k - 2k) / max(2k - 1k, 0.25 GiB)", growth, LENGTH_GROWTH_LIMIT, False)
    gathered, routed = (by_label.get(f"ep 2 {dispatcher}") for dispatcher in EP_DISPATCHERS)
    if gathered and routed and gathered["tokens_per_s"] and routed["tokens_per_s"]:
        speed = routed["tokens_per_s"] / gathered["tokens_per_s"]
        add("ep 2 alltoall / allgather tokens/s", speed, ALLTOALL_SPEED_TARGET, True)
    return out


def measure(size_name: str, root: Path, emit) -> list:
    """Every run of the case, then its ratios; ``emit(row)`` records each as it is measured."""
    rows = []
    cpu = f"{os.cpu_count()}-core {_proc_field('/proc/cpuinfo', 'model name')}"
    with tempfile.TemporaryDirectory(prefix="mindmoe-scaling-") as work:
        for run in scaling_runs(size_name):
            rows.append(emit({"kind": "run", **run_one(run, root, Path(work)), "cpu": cpu}))
    for figure in ratios(rows):
        rows.append(emit({"kind": "ratio", **figure}))
    return rows


SECTION = "## Scaling"


def markdown_section(rows: list) -> list:
    """The Scaling section of BENCHMARKS.md from the ``scaling`` rows of one run."""
    runs = [row for row in rows if row.get("kind") == "run"]
    figures = [row for row in rows if row.get("kind") == "ratio"]
    machine = f" on a {runs[0]['cpu']}" if runs and runs[0].get("cpu") else ""
    lines = [
        SECTION,
        "",
        f"Opt-in (`mindmoe-bench --cases scaling`), run {rows[0]['run']}{machine}. One factor at a time around each "
        "group's base point: **experts** = the tiny model at top-8, expert width 32, default data (seq 128, "
        "16 sequences per step), capacity factor 1.25 or dropless; **length** and **vocab** = micro-batch 1, "
        "one sequence per step, `model.max_position_embeddings=8192`. Each row is one `mindmoe-train` process: "
        "tokens/s = median logged `tokens_per_s` after the first log row; peak RSS = the whole process's "
        "(data preparation and final validation included). **expert parallel** = the 64/8 capacity model on 2 "
        "`mindmoe-launch` workers with `parallel.ep=2`, `allgather` (one replica) or `alltoall` (dp 2); its peak "
        "RSS is the largest worker's.",
        "",
    ]
    table = [
        [
            row["group"],
            row["label"],
            "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}",
            row["peak_rss"] / GIB,
            round(row["wall_s"]),
            row["load_avg"],
            row["status"],
            f"`{row['command']}`",
        ]
        for row in runs
    ]
    header = ["group", "run", "tokens/s", "peak RSS GiB", "wall s", "load", "status", "command"]
    lines += _table(header, table)
    if figures:
        figure_rows = [[f["figure"], f["value"], f["target"], "yes" if f["holds"] else "no"] for f in figures]
        lines += _table(["figure", "value", "target", "holds"], figure_rows)
    return lines


def splice(markdown: str, section: str) -> str:
    """``markdown`` with its Scaling section (up to the next ``## `` heading) replaced by ``section``, or with
    ``section`` appended; an empty ``section`` changes nothing."""
    if not section:
        return markdown
    old = existing_section(markdown)
    section = section.rstrip("\n") + "\n"
    if not old:
        return (markdown.rstrip("\n") + "\n\n" if markdown else "") + section
    blank_before_next = "\n" if old.endswith("\n\n") else ""
    return markdown.replace(old, section + blank_before_next, 1)


def existing_section(markdown: str, heading: str = SECTION) -> str:
    """The section of ``markdown`` under ``heading`` (the Scaling section by default), up to the next ``## ``
    heading ("" if it has none)."""
    start = markdown.find(heading + "\n")
    if start < 0:
        return ""
    end = markdown.find("\n## ", start + len(heading))
    return markdown[start:] if end < 0 else markdown[start : end + 1]
