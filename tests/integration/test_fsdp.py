"""ZeRO-2 and ZeRO-3 with hybrid sharding (train/parallel/fsdp.py) through ``mindmoe-launch`` on CPU workers (mccl):
each layout prints the losses of one process accumulating the same micro-batches (the session's shared reference,
``tests/helpers/shared_runs.py``); a ZeRO-3 rank holds a quarter of the state of one process; every checkpoint file
holds only ranges its writer owned, and a checkpoint moves between ZeRO-3 and one process or ZeRO-1 either way.

The layouts of the acceptance matrix not run here (zero=2 and zero=3 alone on 2 workers, ``glm5_tiny``, fp16) are
run by ``bench/zero_layouts.py``."""

import json
import math
import re

import pytest

from tests.helpers import launches
from tests.helpers.launches import DROPLESS_MB2, LAUNCH_RUN, assert_same_losses, finish, launch_command, train_command
from tests.helpers.processes import free_port
from tests.helpers.runs import losses_by_step, metrics_rows
from tests.helpers.shared_runs import reference_runs

STEPS = int(next(o for o in LAUNCH_RUN if o.startswith("train.max_steps=")).split("=")[1])
SAVED = int(next(o for o in LAUNCH_RUN if o.startswith("train.save_every=")).split("=")[1])
RANK_FILE = re.compile(r"^(model|optimizer)(?:-rank(\d+))?\.safetensors$")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """The one-process run (zero=0) of the 4-worker layouts, shared with test_distributed.py."""
    return reference_runs(tmp_path_factory, data_cache, {"dropless": DROPLESS_MB2})["dropless"]


def workers(run_dir, data_cache, count, *extra):
    return launch_command(
        run_dir,
        data_cache,
        *DROPLESS_MB2,
        f"launch.procs_per_node={count}",
        f"launch.master_port={free_port()}",
        *extra,
    )


def succeeded(process):
    code, stdout, stderr = finish(process)
    assert code == 0, stdout[-3000:] + stderr[-3000:]


def held_bytes(run_dir) -> dict:
    (row,) = [row for row in metrics_rows(run_dir) if "held_bytes" in row]
    assert row["step"] == 0 and sorted(row["held_bytes"]) == ["gradients", "optimizer", "weights"]
    return row["held_bytes"]


def owned_range(name: str, shape, rank: int, world: int, ep: int, trained: bool) -> tuple:
    """The flat elements of tensor ``name`` that ``rank`` owns under ZeRO (train/parallel/zero.py's layout, written
    out here): a routed expert tensor's rows are split over the ``ep`` ranks of an expert group (rank % ep), its held
    rows' elements over the ``world / ep`` ranks holding them; any other trained tensor over all ranks; a tensor
    nobody trains is whole on rank 0."""
    numel = math.prod(shape)
    if not trained:
        return (0, numel) if rank == 0 else (0, 0)
    offset, held, k, index = 0, numel, world, rank
    if ".mlp.experts." in name and ep > 1:
        held = numel // ep
        offset, k, index = (rank % ep) * held, world // ep, rank // ep
    size = -(-held // k)
    return offset + min(index * size, held), offset + min((index + 1) * size, held)


def assert_each_file_holds_only_owned_ranges(checkpoint, world: int, ep: int):
    index = json.loads((checkpoint / "tensors.json").read_text())["groups"]
    trained = {name.split(".", 1)[1] for name in index["optimizer"] if name.startswith("adam_m.")}
    checked = 0
    for group, tensors in index.items():
        for name, entry in tensors.items():
            base = name.split(".", 1)[1] if name.startswith(("adam_m.", "adam_v.")) else name
            for file, begin, end in entry["pieces"]:
                match = RANK_FILE.match(file)
                assert match and match.group(1) == group, (name, file)
                rank = int(match.group(2) or 0)
                first, last = owned_range(base, entry["shape"], rank, world, ep, base in trained)
                assert first <= begin < end <= last, f"{file}: {name}[{begin}:{end}], rank {rank} owns [{first}:{last}]"
                checked += 1
    assert checked > 3 * len(trained)  # several ranks wrote pieces of each trained tensor


@pytest.mark.msrun
def test_zero3_with_expert_parallel_alltoall_on_four_workers_holds_a_quarter_and_its_checkpoint_moves_both_ways(
    reference, tmp_path, data_cache, processes
):
    run_dir = tmp_path / "zero3_ep2"
    extra = ("parallel.zero=3", "parallel.ep=2", "parallel.ep_dispatcher=alltoall")
    succeeded(launches.start(processes, workers(run_dir, data_cache, 4, *extra)))
    single = losses_by_step(reference)
    assert_same_losses(losses_by_step(run_dir), single, range(1, STEPS + 1))

    # Rank 0's weights, gradient buffers and optimizer state against one process's (which accumulates 4 micro-batches
    # in whole fp32 buffers; the workers accumulate none): the ideal, padding aside, is a quarter of its state.
    held, whole = held_bytes(run_dir), held_bytes(reference)
    # (One process's weights include the router biases, which nothing differentiates.)
    assert whole["gradients"] <= whole["weights"] < 1.01 * whole["gradients"] <= 0.51 * whole["optimizer"]
    assert sum(held.values()) <= 0.3 * sum(whole.values()), (held, whole)
    assert held["weights"] <= 0.26 * whole["weights"] and held["optimizer"] <= 0.26 * whole["optimizer"]

    checkpoint = run_dir / "checkpoints" / f"step_{SAVED:06d}"
    assert_each_file_holds_only_owned_ranges(checkpoint, world=4, ep=2)

    # The ZeRO-3 checkpoint in one process without ZeRO and on 2 workers with ZeRO-1; one process's checkpoint
    # into ZeRO-3 with hybrid sharding on 4 workers.
    one_process, zero1 = tmp_path / "to_one_process", tmp_path / "to_zero1"
    hybrid = tmp_path / "from_one_process"
    single_checkpoint = reference / "checkpoints" / f"step_{SAVED:06d}"
    resumed = [
        launches.start(processes, train_command(one_process, data_cache, *DROPLESS_MB2, f"train.resume={checkpoint}")),
        launches.start(processes, workers(zero1, data_cache, 2, "parallel.zero=1", f"train.resume={checkpoint}")),
    ]
    for process in resumed:
        succeeded(process)
    hybrid_resume = ("parallel.zero=3", "parallel.shard_size=2", f"train.resume={single_checkpoint}")
    succeeded(launches.start(processes, workers(hybrid, data_cache, 4, *hybrid_resume)))
    for resumed_dir in (one_process, zero1, hybrid):
        losses = losses_by_step(resumed_dir)
        assert sorted(losses) == list(range(SAVED + 1, STEPS + 1)), resumed_dir
        assert_same_losses(losses, single, range(SAVED + 1, STEPS + 1))


@pytest.mark.msrun
def test_zero2_on_two_workers_gives_the_losses_of_one_process_with_range_sized_gradient_buffers(
    reference, tmp_path, data_cache, processes
):
    run_dir = tmp_path / "zero2"
    succeeded(launches.start(processes, workers(run_dir, data_cache, 2, "parallel.zero=2")))
    assert_same_losses(losses_by_step(run_dir), losses_by_step(reference), range(1, STEPS + 1))
    held, whole = held_bytes(run_dir), held_bytes(reference)
    # Weights whole, gradients accumulated (2 micro-batches a rank) as halves, moments and masters halved.
    assert held["weights"] == whole["weights"]
    assert 0.5 * whole["gradients"] <= held["gradients"] <= 0.51 * whole["gradients"]
    assert held["optimizer"] <= 0.76 * whole["optimizer"]


@pytest.mark.msrun
def test_fp16_weights_under_zero3_on_two_workers_give_the_losses_of_one_fp16_process_and_resume_from_masters(
    tmp_path, tmp_path_factory, data_cache, processes
):
    """train.dtype=fp16 (CPU's half precision): the weights are stored in fp16 with fp32 masters in the ranges."""
    run_dir = tmp_path / "fp16_zero3"
    extra = ("parallel.zero=3", "train.dtype=fp16")
    launcher = launches.start(
        processes,
        launch_command(run_dir, data_cache, "launch.procs_per_node=2", f"launch.master_port={free_port()}", *extra),
    )
    single_dir = reference_runs(tmp_path_factory, data_cache, {"fp16": ("train.dtype=fp16",)})["fp16"]
    succeeded(launcher)
    single = losses_by_step(single_dir)
    for step, loss in losses_by_step(run_dir).items():
        assert abs(loss - single[step]) <= 1e-3 * abs(single[step]), (step, loss, single[step])
    # Rank 0 holds fp16 halves of the weights, and fp32 masters and moments of its halves: 12 bytes an element.
    held, whole = held_bytes(run_dir), held_bytes(single_dir)
    assert held["weights"] <= 0.51 * whole["weights"] and whole["optimizer"] >= 5.9 * whole["weights"]
    assert 0.49 * whole["optimizer"] <= held["optimizer"] <= 0.51 * whole["optimizer"]
    # The checkpoint holds the fp32 masters, which one fp16 process resumes from on the same curve.
    checkpoint = run_dir / "checkpoints" / f"step_{SAVED:06d}"
    index = json.loads((checkpoint / "tensors.json").read_text())["groups"]["model"]
    assert index["embed_tokens.weight"]["dtype"] == "float32"
    resumed_dir = tmp_path / "fp16_resumed"
    command = train_command(resumed_dir, data_cache, "train.dtype=fp16", f"train.resume={checkpoint}")
    succeeded(launches.start(processes, command))
    uninterrupted = losses_by_step(run_dir)
    for step, loss in losses_by_step(resumed_dir).items():
        assert abs(loss - uninterrupted[step]) <= 1e-5 * abs(uninterrupted[step]), (step, loss)
