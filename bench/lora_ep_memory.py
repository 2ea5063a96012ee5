"""LoRA of a GLM-4.5-Air-shaped checkpoint on one process and on 2 expert-parallel workers:
``python bench/lora_ep_memory.py [--gib 1.0] [--layers N] [--steps 3]``.

Writes a random HF ``glm4_moe`` directory shaped like a shrunken GLM-4.5-Air (128 routed experts, top-8, sigmoid router
with its correction bias, one shared expert, one dense layer first, routed experts holding most of the bytes; about
``--gib`` GiB of fp16 weights, with the bundled tiny tokenizer): layers are added until it is that large, or with
``--layers`` the layer count is fixed and the experts are widened instead. Then it runs ``mindmoe-train
recipe=lora_business model.pretrained=<it> moe.dispatch=dropless`` (the HF import's own choice, stated) in one process
and ``mindmoe-launch ... parallel.ep=2`` on 2 workers for ``--steps`` steps. It reports the per-step losses of both (the
largest relative difference), whether the two PEFT adapter files are byte-identical, and each run's peak RSS above the
framework baseline (RSS after importing MindSpore and mindmoe's trainer): the largest worker's for the launch. The
target is worker / one process <= 0.7: each process also holds what ep does not divide (the optimizer's library,
compiled graphs, attention, router and shared expert of its micro-batch), so it is met where the experts outweigh that,
as in published checkpoints. The one process runs with the kernel threads of each of the 2 workers
(``MINDMOE_LOCAL_WORKERS=2``: half the cores for MindSpore's kernels and NumPy's BLAS), as the launched workers do:
kernels split their sums by thread, so the comparison is then of the layouts alone (with all cores in the one process
its adapter file differed from the workers' in the last bits). ``--dispatcher alltoall``: the workers split the tokens
(each its own micro-batch of one conversation, ``parallel.ep_dispatcher=alltoall``) and both runs use ``lora.dropout=0``
and ``moe.aux_loss=none``: data-parallel ranks draw independent dropout masks, and the switch balancing loss is a
function of the micro-batch's load. Prints one JSON object as its last line. Not part of the test suite (two real runs
of a model of about a GiB).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from safetensors.numpy import save_file  # noqa: E402

from mindmoe.bench.hf_load_memory import BASE_CONFIG, SHARD_BYTES, hf_tensor_shapes  # noqa: E402
from mindmoe.bench.scaling import ScalingRun, run_one  # noqa: E402
from mindmoe.model.kernels.host_runtime import usable_cores  # noqa: E402

GIB = 2**30
#: Worker peak RSS growth over the one-process run's that the bench accepts (parallel.ep=2).
TARGET_WORKER_OVER_ONE = 0.7
#: Routed experts' share of the checkpoint's bytes: at least this (GLM-4.5-Air: about 0.95).
ROUTED_SHARE = 0.8
TINY_TOKENIZER = ROOT / "data" / "samples" / "tiny_base" / "tokenizer.model"

# GLM-4.5-Air's structure at a small width; the vocabulary is the bundled tokenizer's.
AIR_CONFIG = dict(
    BASE_CONFIG,  # the import bench's glm4_moe layout, at GLM-4.5-Air's expert shape
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=2048,
    num_attention_heads=8,
    num_key_value_heads=2,
    moe_intermediate_size=512,
    num_experts_per_tok=8,
    n_routed_experts=128,
    routed_scaling_factor=1.0,
    torch_dtype="float16",
    bos_token_id=2,
    eos_token_id=3,
    pad_token_id=0,
)


def write_air_checkpoint(directory: Path, target_bytes: int, layers: int = 0) -> dict:
    """A random fp16 GLM-4.5-Air-shaped checkpoint of about ``target_bytes``: layers added until it is, or with
    ``layers`` given, that many layers whose routed experts are widened (``moe_intermediate_size`` in steps of 64)
    until it is. Returns its total and routed-expert bytes, layer count and expert width."""
    config = dict(AIR_CONFIG, num_hidden_layers=layers or 2)

    def size():
        return sum(2 * int(np.prod(s)) for _, s in hf_tensor_shapes(config))

    while size() < target_bytes:
        if layers:
            config["moe_intermediate_size"] += 64
        else:
            config["num_hidden_layers"] += 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(TINY_TOKENIZER, directory / "tokenizer.model")
    rng = np.random.default_rng(0)
    shards, pending, pending_bytes, total, routed = [], {}, 0, 0, 0

    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(pending, str(directory / name), metadata={"format": "pt"})
        shards.append((name, list(pending)))

    for name, shape in hf_tensor_shapes(config):
        if name.endswith("e_score_correction_bias"):
            array = np.zeros(shape, np.float32)  # HF keeps the correction bias in fp32
        elif name.endswith("norm.weight"):
            array = np.ones(shape, np.float16)
        else:
            array = (rng.standard_normal(size=shape, dtype=np.float32) * np.float32(0.02)).astype(np.float16)
        if pending and pending_bytes + array.nbytes > SHARD_BYTES:
            flush()
            pending, pending_bytes = {}, 0
        pending[name] = array
        pending_bytes += array.nbytes
        total += array.nbytes
        routed += array.nbytes if ".mlp.experts." in name else 0
    flush()
    weight_map = {tensor: name for name, tensors in shards for tensor in tensors}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return {
        "bytes": total,
        "routed_bytes": routed,
        "layers": config["num_hidden_layers"],
        "moe_intermediate_size": config["moe_intermediate_size"],
    }


def framework_baseline_rss() -> int:
    """RSS of a fresh process after importing MindSpore and mindmoe's trainer."""
    code = (
        "import mindspore, mindmoe.train.trainer\n"
        "from mindmoe.bench.peak_memory import current_rss\n"
        "print(current_rss())"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return int(child.stdout.strip().splitlines()[-1])


def losses(run_dir: Path) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in sorted(rows, key=lambda r: r["step"]) if "loss" in row and "tokens_per_s" in row]


def adapter_bytes(run_dir: Path, steps: int) -> bytes:
    return (run_dir / "checkpoints" / f"step_{steps:06d}" / "adapter" / "adapter_model.safetensors").read_bytes()


def measure(directory: Path, work: Path, steps: int, dispatcher: str = "allgather", extra=()) -> dict:
    """Both runs (module docstring) with ``extra`` overrides: ``{"one process" | "ep 2": run_one's row with the
    losses and the adapter file's bytes}``."""
    split = dispatcher == "alltoall"
    # Per micro-batch terms differ when the micro-batches do: the dropout masks (drawn per data-parallel rank)
    # and the switch balancing loss (its load fractions are a micro-batch's).
    overrides = ("lora.dropout=0", "moe.aux_loss=none") if split else ()
    overrides += (
        "recipe=lora_business",
        f"model.pretrained={directory}",
        # What the HF import chooses anyway (model/hf/config_map.py: HF's glm4_moe drops no token), stated so
        # the figures say which dispatch they are of: with alltoall the workers then exchange tokens.
        "moe.dispatch=dropless",
        # Two conversations per step: the activations stay small beside the weights, whose share ep divides.
        "data.global_batch_size=2",
        f"train.max_steps={steps}",
        "train.log_every=1",
        f"train.save_every={steps}",
        f"train.eval_every={steps}",
        "train.progress_bar=false",
        *extra,
    )
    one = ScalingRun("lora", "one process", overrides + ("data.micro_batch_size=2",))
    layout = ("launch.procs_per_node=2", "parallel.ep=2", f"parallel.ep_dispatcher={dispatcher}")
    # alltoall: a conversation per worker (data parallel over the expert group), the same global batch
    layout += (f"data.micro_batch_size={1 if split else 2}",)
    two = ScalingRun("lora", "ep 2", overrides + layout, launcher=True)
    results = {}
    for run in (one, two):
        keep = work / run.label.replace(" ", "_")
        row = run_one_kept(run, keep)
        results[run.label] = dict(row, losses=losses(keep), adapter=adapter_bytes(keep, steps))
    return results


def run_one_kept(run: ScalingRun, run_dir: Path) -> dict:
    """:func:`bench.scaling.run_one`, keeping the run directory (its metrics and adapter are compared)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    row = run_one(run, ROOT, run_dir.parent, keep_run_dir=run_dir)
    if row["status"] != "ok":
        sys.exit(f"{run.command}: {row['status']}")
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size to generate (fp16 bytes)")
    parser.add_argument(
        "--layers", type=int, default=0, help="fix the layer count (>= 2) and widen the experts to reach --gib instead"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dispatcher", choices=("allgather", "alltoall"), default="allgather", help="the workers'")
    args = parser.parse_args()
    if args.layers == 1 or args.layers < 0:
        # The first layer is dense: with fewer than 2 there is no expert to widen.
        parser.error(f"--layers {args.layers}: give at least 2 (the first layer is dense), or 0 to add layers")
    # The one process's kernel threads are a worker's (module docstring); the launcher sets its workers' own.
    os.environ["MINDMOE_LOCAL_WORKERS"] = "2"
    baseline = framework_baseline_rss()
    with tempfile.TemporaryDirectory(prefix="lora_ep_memory_") as tmp:
        directory = Path(tmp) / "air"
        directory.mkdir()
        shape = write_air_checkpoint(directory, int(args.gib * GIB), args.layers)
        results = measure(directory, Path(tmp) / "runs", args.steps, args.dispatcher)
    one, two = results["one process"], results["ep 2"]
    growth_one, growth_two = one["peak_rss"] - baseline, two["peak_rss"] - baseline
    loss_diff = max(abs(a - b) / abs(a) for a, b in zip(one["losses"], two["losses"]))
    print(
        json.dumps(
            {
                "case": "lora_ep_memory",
                "checkpoint_gib": round(shape["bytes"] / GIB, 3),
                "routed_share": round(shape["routed_bytes"] / shape["bytes"], 3),
                "layers": shape["layers"],
                "moe_intermediate_size": shape["moe_intermediate_size"],
                "kernel_threads": max(1, usable_cores() // 2),
                "dispatcher": args.dispatcher,
                "framework_rss_gib": round(baseline / GIB, 3),
                "one_process_peak_gib": round(one["peak_rss"] / GIB, 3),
                "worker_peak_gib": round(two["peak_rss"] / GIB, 3),
                "losses_one": one["losses"],
                "losses_ep2": two["losses"],
                "max_loss_rel_diff": loss_diff,
                "same_losses": len(one["losses"]) == len(two["losses"]) == args.steps and loss_diff <= 1e-5,
                "same_adapter_file": one["adapter"] == two["adapter"],
                "worker_over_one_process": round(growth_two / growth_one, 3),
                "budget_met": growth_two <= TARGET_WORKER_OVER_ONE * growth_one,
                "routed_share_met": shape["routed_bytes"] >= ROUTED_SHARE * shape["bytes"],
            }
        )
    )


if __name__ == "__main__":
    main()
