"""mindmoe-launch and data-parallel training: the msrun command, layout errors before any worker
starts, and multi-process runs on CPU (mccl) that must reproduce one process accumulating the same
micro-batches. Multi-process runs go through the real ``mindmoe-launch`` entry point."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindmoe.conf.checks import resolve_layout
from tests.helpers.launches import (
    LAUNCH_RUN,
    assert_same_losses,
    finish,
    launch_command,
    single_process_losses_side_by_side,
    start,
)
from tests.helpers.processes import free_port
from tests.helpers.runs import REPO, losses_by_step, metrics_rows

STEPS = int(next(o for o in LAUNCH_RUN if o.startswith("train.max_steps=")).split("=")[1])
ALL_STEPS = list(range(1, STEPS + 1))
SAVED = int(next(o for o in LAUNCH_RUN if o.startswith("train.save_every=")).split("=")[1])  # the first checkpoint


#: Micro-batches of 2 with grouped dropless dispatch: the 4-worker layouts (each rank or group reads 2 or 4 of them).
DROPLESS_MB2 = ("data.micro_batch_size=2", "moe.dispatch=dropless")
#: One multi-token-prediction depth: its MoE block's experts are sharded and exchanged like the main layers'.
MTP = ("model.mtp_layers=1", "train.mtp_loss_coeff=0.3")


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache):
    """The two one-process runs every launch below is compared to, computed once for the module, side by side."""
    root = tmp_path_factory.mktemp("references")
    runs = {
        "default": (root / "single", ()),
        "dropless": (root / "single_dropless", DROPLESS_MB2),
        "mtp": (root / "single_mtp", MTP),
    }
    return single_process_losses_side_by_side(data_cache, runs)


@pytest.fixture(scope="module")
def single_process(references):
    return references["default"]


@pytest.fixture(scope="module")
def single_process_dropless(references):
    return references["dropless"]


@pytest.fixture(scope="module")
def single_process_mtp(references):
    return references["mtp"]


# --- the msrun command and configuration errors (no worker starts) ---------------------------------


def test_dry_run_prints_the_msrun_command_and_environment_of_node_3(tmp_path, data_cache):
    from mindspore.parallel.cluster import run as msrun_module

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindmoe.launch.cli",
            "launch.dry_run=true",
            "launch.nodes=4",
            "launch.procs_per_node=8",
            "launch.node_rank=3",
            "launch.master_addr=10.0.0.1",
            "launch.hccl_exec_timeout=1800",
            "launch.hccl_socket_ifname=eth0",
            "launch.bind_core=true",
            "data.global_batch_size=512",
            f"hydra.run.dir={run_dir}",
            f"data.cache_dir={data_cache}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    exports = dict(line[len("export ") :].split("=", 1) for line in lines if line.startswith("export "))
    assert exports["HCCL_EXEC_TIMEOUT"] == "1800" and exports["HCCL_SOCKET_IFNAME"] == "eth0"
    assert exports["MS_NODE_TIMEOUT"] == "300" and "HCCL_CONNECT_TIMEOUT" not in exports
    assert exports["MINDMOE_LOCAL_WORKERS"] == "8"  # each worker sizes its CPU kernel threads to its share
    command = shlex.split(lines[-1])
    assert command[0] == "msrun"
    # msrun's own argument parser reads the printed line as an operator's shell would pass it.
    saved_argv = sys.argv
    try:
        sys.argv = command
        args = msrun_module.get_args()
    finally:
        sys.argv = saved_argv
    assert (args.worker_num, args.local_worker_num, args.node_rank) == (32, 8, 3)
    assert (args.master_addr, args.master_port) == ("10.0.0.1", 8118)
    assert args.log_dir == str(run_dir.resolve() / "msrun") and args.join is True and args.bind_core is True
    assert args.task_script == "python"
    assert args.task_script_args[:2] == ["-m", "mindmoe.train.cli"]
    worker_args = args.task_script_args[2:]
    assert f"hydra.run.dir={run_dir.resolve()}" in worker_args and "data.global_batch_size=512" in worker_args
    assert not any(arg.startswith("launch.") for arg in worker_args)
    assert not run_dir.joinpath("msrun").exists(), "a dry run must not start anything"


def test_dry_run_of_a_batch_that_does_not_divide_prints_the_command_and_warns_naming_the_keys(tmp_path):
    """The issue's own command (default batch, no shared run dir): the command, then why a real launch
    would stop, starting nothing."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindmoe.launch.cli",
            "launch.dry_run=true",
            "launch.nodes=4",
            "launch.procs_per_node=8",
            "launch.node_rank=3",
            "launch.master_addr=10.0.0.1",
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip()
        .splitlines()[-1]
        .startswith(
            "msrun --worker_num=32 --local_worker_num=8 --master_addr=10.0.0.1 --master_port=8118 --node_rank=3"
        )
    )
    assert "warning: the launch would stop here" in result.stderr and "hydra.run.dir=/shared/path" in result.stderr
    assert not list(tmp_path.glob("runs/*/*/msrun")), "a dry run must not start anything"

    shared = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindmoe.launch.cli",
            "launch.dry_run=true",
            "launch.nodes=4",
            "launch.procs_per_node=8",
            "launch.node_rank=3",
            "launch.master_addr=10.0.0.1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shared.returncode == 0, shared.stderr
    assert (
        "data.global_batch_size=16 must be a positive multiple of data.micro_batch_size=16 x data-parallel size 32"
    ) in shared.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.ep=3"], "parallel.ep=3 must divide model.num_experts=4"),
        (["model.num_experts=8", "parallel.ep=4"], "parallel.ep=4 must divide the number of processes 2"),
        (["parallel.dp=4"], "parallel.dp=4 x parallel.ep=1 = 4 processes, but 2 are started"),
        (
            ["data.global_batch_size=6", "data.micro_batch_size=2"],
            "data.global_batch_size=6 must be a positive multiple of data.micro_batch_size=2 x data-parallel size 2",
        ),
        (["launch.node_rank=1"], "launch.node_rank=1 must be in 0..0"),
    ],
)
def test_a_world_that_does_not_divide_fails_before_any_worker_starts(tmp_path, data_cache, overrides, message):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        launch_command(run_dir, data_cache, "launch.procs_per_node=2", *overrides),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert not (run_dir / "msrun").exists()


def test_several_nodes_need_an_explicit_shared_run_dir(tmp_path, data_cache):
    # Run from tmp_path: the default run dir is relative to the working directory.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindmoe.launch.cli",
            "launch.nodes=2",
            "hydra.output_subdir=null",
            f"data.cache_dir={data_cache}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "hydra.run.dir=/shared/path" in result.stderr


def test_layout_defaults_dp_to_the_world_and_accumulates_the_rest():
    assert resolve_layout(4, 0, 1, 8, global_batch_size=32, micro_batch_size=2).accumulation == 4
    assert resolve_layout(4, 0, 1, 8, global_batch_size=32, micro_batch_size=2).dp == 4
    assert resolve_layout(1, 0, 1, 8, global_batch_size=32, micro_batch_size=2).accumulation == 16


def test_token_routed_layout_counts_every_rank_as_a_replica_and_names_the_keys_it_cannot_use():
    routed = resolve_layout(4, 0, 2, 8, global_batch_size=32, micro_batch_size=2, ep_dispatcher="alltoall")
    assert (routed.dp, routed.ep, routed.accumulation, routed.replicas_per_group) == (4, 2, 4, 2)
    assert resolve_layout(4, 4, 2, 8, 32, 2, ep_dispatcher="alltoall") == routed
    assert resolve_layout(4, 0, 2, 8, 32, 2).dp == 2  # allgather: the group is one replica
    with pytest.raises(ValueError, match="parallel.dp=2 with parallel.ep_dispatcher=alltoall: every one of the 4"):
        resolve_layout(4, 2, 2, 8, 32, 2, ep_dispatcher="alltoall")
    with pytest.raises(
        ValueError, match=r"data.global_batch_size=8 must be a positive multiple of data.micro_batch_size=4 x .* 4"
    ):
        resolve_layout(4, 0, 2, 8, 8, 4, ep_dispatcher="alltoall")
    with pytest.raises(ValueError, match="parallel.ep_dispatcher='alltoal' must be one of allgather, alltoall"):
        resolve_layout(2, 0, 2, 8, 8, 4, ep_dispatcher="alltoal")


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


def test_cluster_script_gives_every_node_its_rank_the_master_and_the_same_overrides(tmp_path):
    fake_ssh = tmp_path / "ssh"
    fake_ssh.write_text('#!/bin/sh\necho "$1|$2"\n')
    fake_ssh.chmod(0o755)
    env = dict(
        os.environ,
        HOSTS="10.0.0.1 10.0.0.2 10.0.0.3",
        RUN_DIR="/shared/run 1",
        PROCS_PER_NODE="4",
        MINDMOE_SSH=str(fake_ssh),
        WORKDIR="/opt/mindmoe",
    )
    result = subprocess.run(
        [
            "bash",
            str(REPO / "launch" / "cluster.sh"),
            "data.global_batch_size=48",
            "data.train_files=[a.jsonl,b c.jsonl]",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    remote = dict(line.split("|", 1) for line in result.stdout.strip().splitlines())
    assert sorted(remote) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    for node_rank, host in enumerate(["10.0.0.1", "10.0.0.2", "10.0.0.3"]):
        words = shlex.split(remote[host].split("&&")[-1])
        assert words[0] == "mindmoe-launch"
        assert {
            "launch.nodes=3",
            f"launch.node_rank={node_rank}",
            "launch.procs_per_node=4",
            "launch.master_addr=10.0.0.1",
            "hydra.run.dir=/shared/run 1",
            "data.global_batch_size=48",
            "data.train_files=[a.jsonl,b c.jsonl]",
        } <= set(words)


@pytest.mark.msrun
def test_four_workers_with_ep2_dp2_reproduce_the_single_process_losses(
    single_process_dropless, tmp_path, data_cache, processes
):
    """Two expert groups of two ranks, grouped dropless dispatch: each group reads its own micro-batches (dp 2,
    accumulation 2), its ranks sum their experts' outputs (the CPU fallback of the allgather dispatcher),
    expert gradients are averaged over the 2 ranks holding the same experts, and the checkpoint still gathers
    full expert tensors (read through the index: each rank wrote its own experts)."""
    from mindmoe.model.checkpoint_shards import read_tensors

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
    from mindmoe.model.checkpoint_shards import read_tensors

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
