"""Faults of a ``mindmoe-launch`` job: a signal to the launcher stops every worker after the checkpoint
of one step and leaves nothing running; a busy scheduler port or a worker that fails at start ends
the launch within seconds, named, with no resume hint.

The watch loop is first tested against a stand-in for msrun (a small Python script that behaves as
msrun does in that fault: the process tree, the log lines, hanging where msrun hangs); then two real
msrun launches check the signal path and the busy port end to end."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mindmoe.launch.msrun import WORKER_BANNER
from mindmoe.launch.scheduler import PortInUse, check_port_free
from mindmoe.launch.supervise import LaunchStopped, SchedulerFailed, WorkerFailed, run_direct, run_msrun
from tests.helpers.processes import descendants, free_port
from tests.helpers.tiny_run import TINY_RUN

REPO = Path(__file__).resolve().parents[2]

# A stand-in for a worker: prints the banner into its log, answers SIGTERM as mindmoe-train does after
# its checkpoint (exit 3), or fails at start like a worker that cannot import its dependencies.
FAKE_WORKER = """
import os, signal, sys, time
log_path, banner, rank, role = sys.argv[1:]
log = open(log_path, "a", buffering=1)
log.write(banner.format(rank=rank, pid=os.getpid()) + "\\n")

def stop(signum, frame):
    log.write(f"mindmoe-train: stopped: received {signal.Signals(signum).name}: checkpoint of step 4 written "
              "to ckpt; run the same command again (train.resume=auto) to continue\\n")
    sys.exit(3)

for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, signal.SIG_IGN if role == "stubborn" else stop)
if role == "fail":
    log.write("ModuleNotFoundError: No module named 'hydra'\\n")
    sys.exit(1)
while True:
    time.sleep(1)
"""
# A stand-in for msrun: starts two workers in sessions of their own (as msrun does); for "port_busy" its
# scheduler log gets MindSpore's line; for "worker_fails" it reports the worker and kills the other, as
# msrun does. Then it waits forever, as msrun waits for a scheduler that waits launch.cluster_timeout.
FAKE_MSRUN = """
import os, signal, subprocess, sys, time
worker_script, logs, behaviour, banner = sys.argv[1:]
workers = []
for rank in range(2):
    role = {"worker_fails": "fail" if rank == 1 else "run", "stubborn": "stubborn"}.get(behaviour, "run")
    log = os.path.join(logs, f"worker_{rank}.log")
    command = [sys.executable, worker_script, log, banner, str(rank), role]
    workers.append(subprocess.Popen(command, start_new_session=True))
print("fake msrun: workers started", flush=True)
time.sleep(1)
if behaviour == "port_busy":
    with open(os.path.join(logs, "scheduler.log"), "w") as log:
        log.write("[ERROR] DISTRIBUTED(1,2):2026 [tcp_server.cc:1] Start] Failed to init the tcp server.\\n")
if behaviour == "worker_fails":
    while workers[1].poll() is None:
        time.sleep(0.1)
    print(f"[ERROR] ME: Worker process {workers[1].pid} exit with exception. Error code: 1.", flush=True)
    os.killpg(workers[0].pid, signal.SIGKILL)
while True:
    time.sleep(1)
"""


def fake_launch(tmp_path, behaviour):
    logs = tmp_path / "msrun"
    logs.mkdir()
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    (tmp_path / "fake_msrun.py").write_text(FAKE_MSRUN)
    command = [sys.executable, str(tmp_path / "fake_msrun.py"), str(tmp_path / "fake_worker.py"), str(logs)]
    command += [behaviour, WORKER_BANNER]
    return command, logs, SimpleNamespace(master_addr="127.0.0.1", master_port=8123, node_timeout=300)


def job_pids(tmp_path):
    """Processes still running whose command line names this test's directory."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(tmp_path).encode() in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_scheduler_that_cannot_listen_ends_the_launch_in_seconds_naming_the_port(tmp_path):
    command, logs, launch = fake_launch(tmp_path, "port_busy")
    start = time.monotonic()
    with pytest.raises(SchedulerFailed) as failed:
        run_msrun(command, {}, launch, logs, tmp_path)
    assert time.monotonic() - start < 15
    message = str(failed.value)
    assert message.startswith("launch.master_port=8123: msrun's scheduler could not listen on 127.0.0.1:8123")
    assert "Failed to init the tcp server" in message and str(logs / "scheduler.log") in message
    assert "resume" not in message
    assert failed.value.exit_code == 2
    assert job_pids(tmp_path) == [], "the workers msrun started must not outlive the launch"


def test_a_worker_that_fails_at_start_ends_the_launch_in_seconds_with_its_error(tmp_path):
    """msrun kills the other workers but then waits for its scheduler (launch.cluster_timeout)."""
    command, logs, launch = fake_launch(tmp_path, "worker_fails")
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        run_msrun(command, {}, launch, logs, tmp_path)
    assert time.monotonic() - start < 15
    message = str(failed.value)
    assert "rank 1 (pid" in message and "its first error: ModuleNotFoundError: No module named 'hydra'" in message
    assert "resume" not in message
    assert job_pids(tmp_path) == []


def fake_job(tmp_path, behaviour, direct):
    """``(run, logs)``: the fake msrun job, or (``direct``) the fake workers of a node > 0 whose scheduler
    runs on the same host, which the launcher starts itself."""
    command, logs, launch = fake_launch(tmp_path, behaviour)
    if not direct:
        return lambda: run_msrun(command, {}, launch, logs, tmp_path), logs
    role = "stubborn" if behaviour == "stubborn" else "run"
    workers = []
    for rank in (2, 3):
        log = logs / f"worker_{rank}.log"
        worker_command = [command[0], command[2], str(log), WORKER_BANNER, str(rank), role]
        workers.append({"rank": rank, "log": log, "env": {}, "command": worker_command})
    return lambda: run_direct(workers, {}, tmp_path), logs


def signal_launcher(tmp_path, behaviour, signals, direct=False):
    """The fake job, and ``signals`` sent to this process (the launcher here) a second apart from 3 s on,
    as a batch system sends them; a failure before that still cancels them."""
    run, logs = fake_job(tmp_path, behaviour, direct)
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    timers = [threading.Timer(3.0 + i, os.kill, (os.getpid(), signum)) for i, signum in enumerate(signals)]
    for timer in timers:
        timer.start()
    try:
        with pytest.raises(LaunchStopped) as stopped:
            run()
    finally:
        for timer in timers:
            timer.cancel()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == previous
    assert stopped.value.exit_code == 3
    assert job_pids(tmp_path) == [], "a process of the job outlived the launcher"
    return str(stopped.value), logs


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_reaches_every_worker_and_ends_msrun(tmp_path, signum):
    name = signal.Signals(signum).name
    message, logs = signal_launcher(tmp_path, "run", [signum])
    assert message.startswith(f"received {name}; rank 0 reported: received {name}: checkpoint of step 4")
    assert "killed" not in message
    for rank in (0, 1):
        assert f"mindmoe-train: stopped: received {name}" in (logs / f"worker_{rank}.log").read_text()


@pytest.mark.parametrize("direct", [False, True], ids=["msrun", "direct"])
def test_a_second_signal_kills_workers_that_do_not_stop(tmp_path, direct):
    message, _ = signal_launcher(tmp_path, "stubborn", [signal.SIGTERM, signal.SIGTERM], direct)
    assert "the workers stopped before writing a checkpoint" in message and "were killed" in message


def test_workers_started_without_msrun_get_the_signal_too(tmp_path):
    message, logs = signal_launcher(tmp_path, "run", [signal.SIGTERM], direct=True)
    assert message.startswith("received SIGTERM; rank 2 reported: received SIGTERM: checkpoint of step 4")
    assert "mindmoe-train: stopped: received SIGTERM" in (logs / "worker_3.log").read_text()


def test_the_port_check_before_msrun_reports_a_busy_port_and_passes_a_free_one():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUse, match=f"launch.master_port={port}: port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)


# --- real msrun launches ------------------------------------------------------------------------------


def launch_command(run_dir, data_cache, *extra):
    return [
        sys.executable,
        "-m",
        "mindmoe.launch.cli",
        f"hydra.run.dir={run_dir}",
        f"data.cache_dir={data_cache}",
        *TINY_RUN,
        "launch.procs_per_node=2",
        *extra,
    ]


def start(processes, command):
    process = subprocess.Popen(
        command, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    processes.append(process)
    return process


def read_text(path):
    return path.read_text() if path.exists() else ""


def running(pids):
    alive = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
        except OSError:
            continue
    return alive


@pytest.mark.msrun
def test_sigterm_to_the_launcher_stops_both_ranks_at_one_checkpointed_step_and_leaves_nothing_running(
    tmp_path, data_cache, processes
):
    run_dir = tmp_path / "stopped"
    launcher = start(
        processes,
        launch_command(
            run_dir,
            data_cache,
            # Smaller than TINY_RUN (one dense layer, 32 tokens) to compile sooner: the signal path is tested.
            "model.num_layers=1",
            "data.seq_len=32",
            "data.global_batch_size=4",
            "data.micro_batch_size=2",
            "train.max_steps=100000",
            "train.save_every=100000",
            f"launch.master_port={free_port()}",
        ),
    )
    deadline = time.monotonic() + 300
    while '"step"' not in read_text(run_dir / "metrics.jsonl"):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "no metrics row"
        time.sleep(0.2)
    tree = descendants(launcher.pid)
    assert len(tree) >= 4, "msrun, its scheduler and two workers"
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 3, stdout[-3000:] + stderr[-3000:]

    steps = []
    for rank in (0, 1):
        log = (run_dir / "msrun" / f"worker_{rank}.log").read_text()
        line = next(line for line in log.splitlines() if line.startswith("mindmoe-train: stopped: "))
        steps.append(int(line.split("checkpoint of step ")[1].split()[0]))
    assert steps[0] == steps[1], f"the ranks stopped at steps {steps}"
    assert (run_dir / "checkpoints" / f"step_{steps[0]:06d}" / "state.json").is_file()
    reported = "mindmoe-launch: stopped: received SIGTERM; rank 0 reported: received SIGTERM: checkpoint of step"
    assert f"{reported} {steps[0]} written" in stderr, stderr[-3000:]
    assert running(tree) == [] and job_pids(run_dir) == [], "a process of the job outlived the launcher"


@pytest.mark.msrun
def test_a_busy_master_port_fails_the_launch_at_once_naming_it(tmp_path, data_cache):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start_time = time.monotonic()
        result = subprocess.run(
            launch_command(tmp_path / "busy", data_cache, f"launch.master_port={port}"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        elapsed = time.monotonic() - start_time
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"launch.master_port={port}: port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "resume" not in result.stdout + result.stderr
    assert elapsed < 30
    assert not (tmp_path / "busy" / "msrun").exists(), "msrun must not start"
