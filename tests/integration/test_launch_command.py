"""mindmoe-launch before any worker starts: the msrun command of a dry run, layout errors, the data-parallel and
expert-parallel layouts, and the cluster script. Runs of workers are in ``test_distributed.py``."""

import os
import shlex
import subprocess
import sys

import pytest

from mindmoe.conf.checks import resolve_layout
from tests.helpers.launches import launch_command
from tests.helpers.runs import REPO

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
