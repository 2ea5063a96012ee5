"""Data-parallel and expert-parallel training on CPU (mccl) through the real ``mindmoe-launch`` entry point: every
multi-process run must reproduce one process accumulating the same micro-batches (the session's shared reference
runs, ``tests/helpers/shared_runs.py``). The launch command and layout errors are in ``test_launch_command.py``."""

import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.launches import DROPLESS_MB2, LAUNCH_RUN, assert_same_losses, finish, launch_command, start
from tests.helpers.processes import free_port
from tests.helpers.runs import losses_by_step, metrics_rows
from tests.helpers.shared_runs import reference_runs

STEPS = int(next(o for o in LAUNCH_RUN if o.startswith("train.max_steps=")).split("=")[1])
ALL_STEPS = list(range(1, STEPS + 1))
SAVED = int(next(o for o in LAUNCH_RUN if o.startswith("train.save_every=")).split("=")[1])  # the first checkpoint


#: One multi-token-prediction depth: its MoE block's experts are sharded and exchanged like the main layers'.
MTP = ("model.mtp_layers=1", "train.mtp_loss_coeff=0.3")


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache):
    """The one-process runs every launch below is compared to, shared by the session (trained side by side the
    first time they are asked for)."""
    runs = {"default": (), "dropless": DROPLESS_MB2, "mtp": MTP}
    return {name: losses_by_step(run) for name, run in reference_runs(tmp_path_factory, data_cache, runs).items()}


@pytest.fixture(scope="module")
def single_process(references):
    return references["default"]


@pytest.fixture(scope="module")
def single_process_dropless(references):
    return references["dropless"]


@pytest.fixture(scope="module")
def single_process_mtp(references):
    return references["mtp"]


# --- multi-process runs on CPU ----------------------------------------------------------------------


@pytest.mark.msrun
def test_two_nodes_of_one_worker_reproduce_the_single_process_losses(single_process, tmp_path, data_cache, processes):
    run_dir = tmp_path / "nodes2"
    node = ["launch.nodes=2", "launch.procs_per_node=1", f"launch.master_port={free_port()}"]
    node0 = start(processes, launch_command(run_dir, data_cache, *node, "launch.node_rank=0"))
    node1 = start(processes, launch_command(run_dir, data_cache, *node, "launch.node_rank=1"))
    code1, stdout1, stderr1 = finish(node1)
    code0, stdout0, stderr0 = finish(node0)
    assert code0 == 0 and code1 == 0, stderr0[-3000:] + stderr1[-3000:]
    assert "--node_rank=0" in stdout0 and "start worker rank 1" in stdout1
    assert_same_losses(losses_by_step(run_dir), single_process, ALL_STEPS)


def wait_for_checkpoint_after(run_dir, step, launcher, timeout=600):
    """The newest checkpoint step once one newer than ``step`` exists."""
    root = Path(run_dir) / "checkpoints"
    deadline = time.time() + timeout
    while True:
        steps = [int(p.name.split("_")[1]) for p in root.glob("step_*")] if root.is_dir() else []
        if steps and max(steps) > step:
            return max(steps)
        assert launcher.poll() is None, launcher.communicate()
        assert time.time() < deadline, f"no checkpoint after step {step} in {root}"
        time.sleep(0.2)


def worker_pid(run_dir, rank):
    log = (Path(run_dir) / "msrun" / f"worker_{rank}.log").read_text()
    return int(log.split(f"mindmoe worker: rank {rank} pid ")[1].split()[0])


@pytest.mark.msrun
def test_two_data_parallel_workers_stopped_or_killed_stop_the_job_naming_its_log_and_relaunches_reproduce_one_process(
    single_process, tmp_path, data_cache, processes
):
    """Two data-parallel workers (dp 2, accumulation 1): a SIGTERM, then a SIGKILL of one worker, then a relaunch
    that runs to the end. Every step is logged by one of the three launches and must be the single process's."""
    run_dir = tmp_path / "killed"
    worker_log = str(run_dir / "msrun" / "worker_1.log")
    command = launch_command(
        run_dir, data_cache, "launch.procs_per_node=2", "launch.node_timeout=5", "train.save_every=2"
    )

    # SIGTERM to one worker: every rank stops at the same step, after rank 0 wrote its checkpoint.
    launcher = start(processes, command + [f"launch.master_port={free_port()}"])
    wait_for_checkpoint_after(run_dir, 0, launcher)
    os.kill(worker_pid(run_dir, 1), signal.SIGTERM)
    code, stdout, stderr = finish(launcher, timeout=240)
    assert code != 0 and "stopped on a signal after the checkpoint of that step was written" in stderr, stderr
    stopped_at = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert f"checkpoint of step {stopped_at} written" in (run_dir / "msrun" / "worker_0.log").read_text()

    # SIGKILL of one worker: the job stops after launch.node_timeout, naming the rank and its log.
    relaunch = start(processes, command + [f"launch.master_port={free_port()}"])
    wait_for_checkpoint_after(run_dir, stopped_at, relaunch)
    os.kill(worker_pid(run_dir, 1), signal.SIGKILL)
    # Generous: the job must stop after launch.node_timeout, not hang until the test's timeout.
    code, stdout, stderr = finish(relaunch, timeout=240)
    assert code != 0
    assert "rank 1 (pid" in stderr and "exited with code -9" in stderr and worker_log in stderr, stderr[-3000:]
    assert "train.resume=auto" in stderr

    final = start(processes, command + [f"launch.master_port={free_port()}"])
    code, stdout, stderr = finish(final)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "resumed from" in stdout + stderr and "data parallel 2, accumulation 1" in stdout
    losses = losses_by_step(run_dir)
    assert sorted(losses) == ALL_STEPS
    assert_same_losses(losses, single_process, ALL_STEPS)
    # Rank 0 alone writes metrics and checkpoints (pruned to train.keep_last=2); each rank has its msrun log.
    assert sorted(p.name for p in (run_dir / "msrun").glob("worker_*.log")) == ["worker_0.log", "worker_1.log"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{STEPS - 2:06d}", f"step_{STEPS:06d}"]


@pytest.mark.msrun
def test_four_workers_with_ep2_dp2_reproduce_the_single_process_losses(
    single_process_dropless, tmp_path, data_cache, processes
):
    """Two expert groups of two ranks, grouped dropless dispatch: each group reads its own micro-batches (dp 2,
    accumulation 2), its ranks sum their experts' outputs (the CPU fallback of the allgather dispatcher),
    expert gradients are averaged over the 2 ranks holding the same experts, and the checkpoint still gathers
    full expert tensors (read through the index: each rank wrote its own experts)."""
    from mindmoe.model.checkpoints.shards import read_tensors

    run_dir = tmp_path / "ep2dp2"
    launcher = start(
        processes,
        launch_command(
            run_dir,
            data_cache,
            *DROPLESS_MB2,
            "launch.procs_per_node=4",
            "parallel.ep=2",
            "parallel.dp=2",
            f"launch.master_port={free_port()}",
        ),
    )
    # Four MindSpore processes compile on a shared 2-core machine: slow, hence the generous timeout.
    code, stdout, stderr = finish(launcher, timeout=2400)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "data parallel 2, accumulation 2" in stdout
    losses = losses_by_step(run_dir)
    assert sorted(losses) == ALL_STEPS
    assert_same_losses(losses, single_process_dropless, ALL_STEPS)
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    assert dict(read_tensors(checkpoint, "model"))["layers.1.mlp.experts.gate_proj"].shape == (4, 32, 64)


@pytest.mark.msrun
def test_token_routed_expert_parallel_workers_reproduce_the_single_process_losses(
    single_process_mtp, tmp_path, data_cache, processes
):
    """``parallel.ep_dispatcher=alltoall`` on 2 workers, capacity dispatch, one MTP depth: each rank reads its own
    micro-batch (dp 2, accumulation 1; one process accumulates both), counts capacity on it, sends each expert's rows
    to the rank holding the expert (the world group: the AllGather emulation) and gets the outputs back; the MTP
    depth's MoE block holds and exchanges its experts the same way, and the checkpoint gathers its full tensors."""
    from mindmoe.model.checkpoints.shards import read_tensors

    run_dir = tmp_path / "alltoall"
    launcher = start(
        processes,
        launch_command(
            run_dir,
            data_cache,
            *MTP,
            "launch.procs_per_node=2",
            "parallel.ep=2",
            "parallel.ep_dispatcher=alltoall",
            f"launch.master_port={free_port()}",
        ),
    )
    code, stdout, stderr = finish(launcher)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "data parallel 2, accumulation 1" in stdout
    assert_same_losses(losses_by_step(run_dir), single_process_mtp, ALL_STEPS)
    mtp_losses = [row["mtp_loss"] for row in metrics_rows(run_dir) if "loss" in row]
    assert len(mtp_losses) == STEPS and all(loss > 0 for loss in mtp_losses)
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    tensors = dict(read_tensors(checkpoint, "model"))
    assert tensors["layers.1.mlp.experts.up_proj"].shape == (4, 32, 64)
    assert tensors["mtp_layers.0.mlp.experts.up_proj"].shape == (4, 32, 64)


@pytest.mark.msrun
def test_four_token_routed_workers_with_ep2_and_dropless_reproduce_the_single_process_losses(
    single_process_dropless, tmp_path, data_cache, processes
):
    """4 data-parallel ranks in two expert groups of 2 (groups smaller than the world: the AllReduce emulation),
    dropless dispatch through the grouped exchange (each rank sends only its routed rows), expert gradients summed
    over the 2 ranks holding the same experts; one process accumulates the same 4 micro-batches of 2."""
    run_dir = tmp_path / "alltoall4"
    launcher = start(
        processes,
        launch_command(
            run_dir,
            data_cache,
            *DROPLESS_MB2,
            "launch.procs_per_node=4",
            "parallel.ep=2",
            "parallel.ep_dispatcher=alltoall",
            f"launch.master_port={free_port()}",
        ),
    )
    code, stdout, stderr = finish(launcher, timeout=2400)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "data parallel 4, accumulation 1" in stdout
    assert_same_losses(losses_by_step(run_dir), single_process_dropless, ALL_STEPS)


@pytest.mark.msrun
def test_workers_that_fail_at_start_are_reported_with_their_error_and_no_resume_hint(tmp_path, data_cache, processes):
    """A config error only the workers see (the context is longer than the model's positions, found once
    the model is built): the launcher quotes the failing worker's own error line from its log and, with
    no checkpoint written, does not suggest resuming."""
    run_dir = tmp_path / "bad_start"
    launcher = start(
        processes,
        launch_command(
            run_dir,
            data_cache,
            "launch.procs_per_node=2",
            "launch.node_timeout=5",
            "model.max_position_embeddings=32",
            f"launch.master_port={free_port()}",
        ),
    )
    code, stdout, stderr = finish(launcher, timeout=600)
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    first_error = "data.seq_len=64 exceeds max_position_embeddings=32 of model.max_position_embeddings"
    assert f"its first error: mindmoe-train: error: {first_error}" in stderr, stderr[-3000:]
    assert str(run_dir / "msrun" / "worker_") in stderr
    assert "train.resume" not in stderr and "continue from the last checkpoint" not in stderr
    assert not (run_dir / "checkpoints").exists()
