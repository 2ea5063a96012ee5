"""Every ZeRO layout of the acceptance matrix against one process: ``python bench/zero_layouts.py [--models ...]``.

For the default tiny model and ``recipe=glm5_tiny`` (8 steps, global batch 8 in micro-batches of 2, no validation),
one ``mindmoe-train`` process (no ZeRO) and then ``mindmoe-launch`` with ``parallel.zero=2`` and ``3`` on 2 workers,
and ``zero=3`` with ``ep=2``, with ``shard_size=2`` and with ``ep=2 ep_dispatcher=alltoall`` on 4 workers; then
``train.dtype=fp16`` with ``zero=3`` on 2 workers against one fp16 process (within 1e-3). Prints a
JSON line per run (the largest relative loss difference to the one process over the 8 steps, and rank 0's
``held_bytes`` total against the one process's), then one JSON object with ``all_within`` (every difference within
``--tolerance``, default 1e-5). The tests run a subset (tests/integration/test_fsdp.py); this is the whole matrix,
20 to 40 minutes on 2 cores.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindmoe.bench.scaling import free_port  # noqa: E402

TOLERANCE = 1e-5
COMMON = (
    "data.global_batch_size=8",
    "data.micro_batch_size=2",
    "data.valid_files=[]",
    "train.max_steps=8",
    "train.log_every=1",
    "train.eval_every=0",
    "train.save_every=8",
    "train.progress_bar=false",
    "train.peak_gflops=100",
)
MODELS = {"tiny": (), "glm5_tiny": ("recipe=glm5_tiny",)}
#: fp16 (CPU's half precision: stored weights, fp32 masters) against one fp16 process, within this tolerance.
FP16_TOLERANCE = 1e-3
LAYOUTS = {
    "zero 2, 2 workers": (2, "parallel.zero=2"),
    "zero 3, 2 workers": (2, "parallel.zero=3"),
    "zero 3 ep 2, 4 workers": (4, "parallel.zero=3", "parallel.ep=2"),
    "zero 3 shard_size 2, 4 workers": (4, "parallel.zero=3", "parallel.shard_size=2"),
    "zero 3 ep 2 alltoall, 4 workers": (4, "parallel.zero=3", "parallel.ep=2", "parallel.ep_dispatcher=alltoall"),
}
FP16_LAYOUTS = {"fp16 zero 3, 2 workers": (2, "parallel.zero=3", "train.dtype=fp16")}


def rows_of(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run(module: str, run_dir: Path, overrides) -> list:
    command = [sys.executable, "-m", module, f"hydra.run.dir={run_dir}", *overrides]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        sys.exit(f"{' '.join(command)}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return rows_of(run_dir)


def losses(rows) -> dict:
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def held_total(rows) -> int:
    return sum(next(row["held_bytes"] for row in rows if "held_bytes" in row).values())


def measure(models, tolerance: float) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="zero_layouts_") as tmp:
        work = Path(tmp)
        for model in models:
            common = (*COMMON, f"data.cache_dir={work / 'cache'}", *MODELS[model])
            single = run("mindmoe.train.cli", work / f"{model}_single", common)
            reference, reference_held = losses(single), held_total(single)
            half = run("mindmoe.train.cli", work / f"{model}_single_fp16", (*common, "train.dtype=fp16"))
            references = {False: (reference, reference_held, tolerance), True: (losses(half), held_total(half), None)}
            for label, (workers, *keys) in {**LAYOUTS, **FP16_LAYOUTS}.items():
                expected, expected_held, bound = references["train.dtype=fp16" in keys]
                bound = bound or FP16_TOLERANCE
                launch = (f"launch.procs_per_node={workers}", f"launch.master_port={free_port()}", *keys)
                rows = run("mindmoe.launch.cli", work / f"{model}_{label.replace(' ', '_')}", (*common, *launch))
                got = losses(rows)
                worst = max(abs(got[step] - loss) / abs(loss) for step, loss in expected.items())
                row = {
                    "model": model,
                    "layout": label,
                    "max_relative_loss_difference": worst,
                    "tolerance": bound,
                    "within": worst <= bound and sorted(got) == sorted(expected),
                    "held_vs_one_process": round(held_total(rows) / expected_held, 3),
                }
                results[f"{model}: {label}"] = row
                print(json.dumps(row), flush=True)
    return {
        "case": "zero_layouts",
        "tolerance": tolerance,
        "runs": results,
        "all_within": all(r["within"] for r in results.values()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    args = parser.parse_args()
    result = measure(args.models, args.tolerance)
    print(json.dumps(result))
    sys.exit(0 if result["all_within"] else 1)


if __name__ == "__main__":
    main()
