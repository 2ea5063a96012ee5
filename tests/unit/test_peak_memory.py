"""bench.peak_memory: a command's peak RSS is its own, not the peak of the process that started it.

This process first holds 512 MiB and frees it; a run started directly from it then reports at least 512 MiB
(``wait4``), which is how a pytest worker's peak became a launched worker's peak in an earlier CI run.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mindmoe.bench.peak_memory import current_rss, own_peak_rss, run_measured

MIB = 2**20


def allocate(mib: int) -> str:
    """Python code that holds ``mib`` MiB of written memory."""
    return f"import numpy; held = numpy.ones({mib} * 2**20 // 8); assert held.sum() > 0\n"


@pytest.fixture(scope="module")
def raised_peak():
    """This process's peak raised past 512 MiB, then the memory freed."""
    held = np.ones(512 * MIB // 8)
    assert held.sum() > 0
    del held
    assert own_peak_rss() >= 512 * MIB
    return own_peak_rss()


def test_a_directly_started_child_reports_the_starters_peak_and_run_measured_does_not(raised_peak, tmp_path):
    code = allocate(64)
    child = subprocess.Popen([sys.executable, "-c", code])
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert usage.ru_maxrss * 1024 >= 512 * MIB  # the fact this module works around (Linux)

    returncode, peak = run_measured([sys.executable, "-c", code], 60, tmp_path / "peak.txt")
    assert returncode == 0
    assert 64 * MIB <= peak < 256 * MIB, peak / MIB


def test_the_peak_is_the_largest_of_the_command_and_its_descendants(raised_peak, tmp_path):
    code = textwrap.dedent(
        f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {allocate(200)!r}], check=True)
        """
    )
    returncode, peak = run_measured([sys.executable, "-c", code], 60, tmp_path / "peak.txt")
    assert returncode == 0
    assert 200 * MIB <= peak < 400 * MIB, peak / MIB


def test_exit_codes_and_signals_are_the_commands(tmp_path):
    returncode, peak = run_measured([sys.executable, "-c", "raise SystemExit(3)"], 60, tmp_path / "a.txt")
    assert returncode == 3 and peak > 0
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    returncode, peak = run_measured([sys.executable, "-c", killed], 60, tmp_path / "b.txt")
    assert returncode == -signal.SIGKILL and peak > 0


def test_a_timed_out_command_and_its_children_are_killed_and_still_measured(tmp_path):
    pids = tmp_path / "pids"
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        {allocate(32)}
        time.sleep(120)
        """
    )
    returncode, peak = run_measured([sys.executable, "-c", code], 3, tmp_path / "peak.txt")
    assert returncode is None
    assert peak >= 32 * MIB
    for pid in map(int, pids.read_text().split()):
        assert ended(pid), pid


def test_a_stop_while_the_command_starts_still_ends_it(tmp_path):
    started = time.monotonic()
    returncode, _ = run_measured([sys.executable, "-c", "import time; time.sleep(120)"], 0, tmp_path / "peak.txt")
    assert returncode is None and time.monotonic() - started < 30
    report = (tmp_path / "peak.txt").read_text().split() if (tmp_path / "peak.txt").exists() else []
    for pid in map(int, report[:1]):
        assert ended(pid), pid


def ended(pid: int, wait_s: float = 10.0) -> bool:
    """Whether ``pid`` is gone or a zombie within ``wait_s`` (a killed orphan waits for init to reap it)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_own_peak_rss_of_a_child_excludes_the_starters_peak(raised_peak):
    code = "from mindmoe.bench.peak_memory import own_peak_rss; print(own_peak_rss())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(child.stdout.strip().splitlines()[-1]) < 256 * MIB
    assert current_rss() <= own_peak_rss()
