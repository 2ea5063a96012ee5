"""``mindmoe-plan`` against measurement on CPU: ``python bench/plan_vs_measured.py [--tolerance 0.25] [--layouts ...]``.

Runs the default tiny model for a few steps in several layouts, as a user would: one ``mindmoe-train`` process,
and ``mindmoe-launch`` on 2 workers with ``parallel.dp=2`` and with ``parallel.ep=2`` (``allgather``), and with
``parallel.zero=2`` and ``3`` on 2 and 4 workers. Each
run's peak RSS comes from ``wait4`` (:func:`bench.scaling.run_one`: for a launch, the largest worker's), and is
taken above the framework baseline (RSS of a fresh process after ``import mindspore, mindmoe.train.trainer``,
:func:`bench.lora_ep_memory.framework_baseline_rss`). The planned figure is the per-rank total that
``mindmoe-plan plan.device=CPU`` prints for the same keys (:func:`launch.plan_cli.given_plan`). Prints one
JSON object as its last line: per layout the planned and measured GiB and planned / measured, and whether
every ratio is within ``--tolerance`` of 1 (exit status 1 when not). ``--layouts "ep 2 alltoall"`` measures
the other dispatcher too (not in the default set).

Validation is off (``data.valid_files=[]``): the planner plans the train step, and the end-of-run evaluation
compiles a graph of its own. The three runs share one data cache (the first builds the tokenizer and shards,
which peak far below training). 10 to 20 minutes on 2 cores: not part of the test suite.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindmoe.bench.lora_ep_memory import framework_baseline_rss  # noqa: E402
from mindmoe.bench.scaling import ScalingRun, run_one  # noqa: E402

GIB = 2**30
TOLERANCE = 0.25
#: Default tiny model and data; micro-batches of 8 of the 16 sequences, so that dp=2 has one per rank.
COMMON = (
    "data.micro_batch_size=8",
    "data.valid_files=[]",
    "train.max_steps=3",
    "train.log_every=1",
    "train.eval_every=0",
    "train.save_every=3",
    "train.progress_bar=false",
    "train.peak_gflops=100",
)
LAYOUTS = {
    "one process": (),
    "dp 2": ("launch.procs_per_node=2", "parallel.dp=2"),
    "ep 2": ("launch.procs_per_node=2", "parallel.ep=2"),
    # Not in the acceptance set: the other dispatcher, for --layouts.
    "ep 2 alltoall": ("launch.procs_per_node=2", "parallel.ep=2", "parallel.ep_dispatcher=alltoall"),
    "zero 2, 2 workers": ("launch.procs_per_node=2", "parallel.zero=2"),
    "zero 3, 2 workers": ("launch.procs_per_node=2", "parallel.zero=3"),
    # 4 workers read 4 sequences each.
    "zero 2, 4 workers": ("launch.procs_per_node=4", "parallel.zero=2", "data.micro_batch_size=4"),
    "zero 3, 4 workers": ("launch.procs_per_node=4", "parallel.zero=3", "data.micro_batch_size=4"),
}
#: The layouts of the acceptance lines: one process, dp=2, ep=2 (allgather); ZeRO-2 and ZeRO-3 on 2 and 4 workers.
DEFAULT_LAYOUTS = (
    "one process",
    "dp 2",
    "ep 2",
    "zero 2, 2 workers",
    "zero 3, 2 workers",
    "zero 2, 4 workers",
    "zero 3, 4 workers",
)


def planned_bytes(overrides) -> float:
    """Per-rank total of ``mindmoe-plan plan.device=CPU <overrides>``."""
    from hydra import compose, initialize_config_module

    from mindmoe.launch.plan_cli import given_plan

    with initialize_config_module("mindmoe.conf", version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "plan.device=CPU"])
    return given_plan(cfg).memory.total


def compare(planned: float, measured: float, tolerance: float) -> dict:
    ratio = planned / measured if measured > 0 else float("inf")
    return {
        "planned_gib": round(planned / GIB, 3),
        "measured_gib": round(measured / GIB, 3),
        "ratio": round(ratio, 3),
        "within": abs(ratio - 1) <= tolerance,
    }


def measure(layouts: dict, tolerance: float) -> dict:
    baseline = framework_baseline_rss()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="plan_vs_measured_") as tmp:
        work = Path(tmp)
        for label, keys in layouts.items():
            overrides = (*COMMON, f"data.cache_dir={work / 'cache'}", *keys)
            run = ScalingRun("plan", label, overrides, launcher=bool(keys))
            row = run_one(run, ROOT, work)
            if row["status"] != "ok":
                sys.exit(f"{run.command}: {row['status']}")
            measured = row["peak_rss"] - baseline
            rows[label] = dict(compare(planned_bytes(overrides), measured, tolerance), wall_s=row["wall_s"])
            print(json.dumps({label: rows[label]}), flush=True)
    return {
        "case": "plan_vs_measured",
        "framework_rss_gib": round(baseline / GIB, 3),
        "tolerance": tolerance,
        "layouts": rows,
        "all_within": all(row["within"] for row in rows.values()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest |planned / measured - 1|")
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=list(DEFAULT_LAYOUTS))
    args = parser.parse_args()
    result = measure({label: LAYOUTS[label] for label in args.layouts}, args.tolerance)
    print(json.dumps(result))
    sys.exit(0 if result["all_within"] else 1)


if __name__ == "__main__":
    main()
