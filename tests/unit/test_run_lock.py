"""One writer per run dir (issue 22, Found 6): ``run.lock`` held by a live process stops a second run at
once, naming the holder; a lock left by a dead process is taken over with a warning; releasing removes it."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from mindmoe.conf.exit_codes import CONFIG_ERROR, exit_status
from mindmoe.train.checkpoints.run_lock import LOCK_FILE, RunDirBusy, RunLock, lock_holder
from mindmoe.train.cli import check_run_dir, run_dir_argument

# A process that takes the lock of argv[1], says so, and holds it until it is killed.
HOLDER = (
    "import sys, time\n"
    "from mindmoe.train.checkpoints.run_lock import RunLock\n"
    "RunLock(sys.argv[1]).acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def holder(tmp_path, processes):
    """A live process of this host that holds ``tmp_path``'s lock."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    processes.append(process)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_writer_fails_at_once_naming_the_holder_and_the_lock_file(tmp_path, holder):
    with pytest.raises(RunDirBusy) as caught:
        RunLock(tmp_path).acquire()
    message = str(caught.value)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in message
    assert str(tmp_path / LOCK_FILE) in message and "hydra.run.dir" in message
    assert exit_status(caught.value) == (CONFIG_ERROR, "error")
    # The holder's lock is untouched.
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    assert lock_holder(tmp_path)["pid"] == holder.pid


def test_the_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path, holder, caplog):
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (tmp_path / LOCK_FILE).exists(), "a kill cannot remove the file: the next run finds it"
    assert lock_holder(tmp_path) is None
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"), RunLock(tmp_path) as lock:
        lock.acquire()
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over the lock of pid {holder.pid}" in caplog.text and str(tmp_path / LOCK_FILE) in caplog.text


def test_a_lock_file_naming_a_live_process_here_is_respected_even_where_flock_is_not(tmp_path, holder):
    # What a filesystem that ignores flock shows: the file names a running process, no lock is held.
    info = json.loads((tmp_path / LOCK_FILE).read_text())
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    info["pid"], info["pid_start"] = os.getppid(), None  # a process of this host that runs
    (tmp_path / LOCK_FILE).write_text(json.dumps(info))
    with pytest.raises(RunDirBusy, match=f"pid {os.getppid()}"):
        RunLock(tmp_path).acquire()


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path, caplog):
    # A running process of this host, but not the one that wrote the lock: it started at another time.
    stale = {"pid": os.getppid(), "pid_start": 1, "host": socket.gethostname(), "started": "then"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"), RunLock(tmp_path) as lock:
        lock.acquire()
    assert "taking over the lock" in caplog.text


def test_release_removes_the_file_on_success_and_on_error(tmp_path):
    with RunLock(tmp_path) as lock:
        lock.acquire()
        assert lock_holder(tmp_path)["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()
    with pytest.raises(RuntimeError), RunLock(tmp_path) as lock:
        lock.acquire()
        raise RuntimeError("a failing run")
    assert not (tmp_path / LOCK_FILE).exists()
    with RunLock(tmp_path) as lock:  # and it can be taken again, without a warning
        lock.acquire()


def test_the_command_line_check_names_a_file_given_as_run_dir_and_a_held_run_dir(tmp_path, capsys):
    regular = tmp_path / "notes.txt"
    regular.write_text("mine")
    for run_dir in (regular, regular / "run"):
        with pytest.raises(SystemExit) as exited:
            check_run_dir(["train.max_steps=2", f"hydra.run.dir={run_dir}"])
        assert exited.value.code == CONFIG_ERROR
        assert f"hydra.run.dir={run_dir}: {regular} is a file, not a directory" in capsys.readouterr().err
    assert regular.read_text() == "mine"
    with RunLock(tmp_path / "run") as lock:
        lock.acquire()
        with pytest.raises(SystemExit) as exited:
            check_run_dir([f"hydra.run.dir={tmp_path / 'run'}"])
        assert exited.value.code == CONFIG_ERROR
        assert f"held by pid {os.getpid()}" in capsys.readouterr().err
    check_run_dir([f"hydra.run.dir={tmp_path / 'run'}"])  # released: no error


def test_run_dir_argument_takes_the_last_literal_value():
    assert run_dir_argument(["hydra.run.dir=a", "x=1", "++hydra.run.dir='b c'"]).name == "b c"
    assert run_dir_argument(["hydra.run.dir=runs/${now:%H}"]) is None
    assert run_dir_argument(["train.max_steps=2"]) is None
