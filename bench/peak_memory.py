"""Peak resident memory of this process, and of a command's processes, whatever the process that started them held.

Linux hands a process's peak on to the programs it starts: a child made by ``vfork`` (``subprocess`` uses it) or
``fork`` and then ``exec``'d keeps, as its ``ru_maxrss``, the peak (vfork) or current (fork) RSS of the address
space it left, and ``wait4`` reports that (measured: after a 3 GiB NumPy array was freed, ``/bin/true`` started
from the same Python process had a ``ru_maxrss`` of 3 GiB). So a run started from a process that was once large
(a pytest worker after an hour of in-process tests: 6.2 GiB) reports that process's peak as its own. Two ways
around it here:

- :func:`own_peak_rss`: ``VmHWM`` of this process's address space, which ``exec`` starts anew (not ``ru_maxrss``).
- :func:`run_measured`: the command started by this file run as a small script (``python -S``: the standard
  library only, a few MiB), which reports ``wait4`` of the command: the largest peak among the command and the
  descendants it waited for (a launcher's workers), each of which inherited at most the peak of the process that
  started it within the run.

Standard library only: :func:`run_measured` runs this file with ``python -S``.
"""

import os
import signal
import subprocess
import sys
import time


def own_peak_rss() -> int:
    """Peak RSS in bytes of this process since its ``exec`` (``VmHWM``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: peak RSS is measured on Linux only")


def current_rss() -> int:
    """RSS in bytes of this process now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_measured(command, timeout_s: float, report_path, **popen_kwargs) -> tuple:
    """Run ``command`` (``Popen`` arguments ``popen_kwargs``: cwd, env, stdout, stderr) to its end or for at most
    ``timeout_s`` seconds; ``(returncode or None if it timed out, peak RSS in bytes)``. The peak is that of the
    command and the descendants it waited for, from ``wait4`` in a small process between (module docstring), which
    writes it to ``report_path``; the return code is the command's (negative: the signal that killed it). On the
    timeout, or when this process is interrupted, the command's process group is killed."""
    reaper = subprocess.Popen(
        [sys.executable, "-S", os.path.abspath(__file__), str(report_path), *command],
        start_new_session=True,
        **popen_kwargs,
    )
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        while reaper.poll() is None:
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        if reaper.poll() is None:  # the timeout, or this process interrupted: leave nothing running
            reaper.send_signal(signal.SIGTERM)  # it kills the command's group and still reports the peak
            try:
                reaper.wait(30)
            except subprocess.TimeoutExpired:
                for group in [reaper.pid, *_report(report_path)[:1]]:
                    _kill_group(group)
                reaper.wait()
    lines = _report(report_path)
    return (None if timed_out else reaper.returncode), (lines[1] if len(lines) > 1 else None)


def _report(report_path) -> list:
    """The numbers the reaper wrote: the command's pid, then its peak RSS (none if it never started)."""
    try:
        with open(report_path) as report:
            return [int(word) for word in report.read().split()]
    except FileNotFoundError:
        return []


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(report_path: str, command: list) -> None:
    """The script :func:`run_measured` runs: start ``command`` in its own process group, wait for it, write its pid
    and then its peak RSS to ``report_path``, and end as it ended (its exit code, or killed by its signal).
    SIGTERM or SIGINT here kill the command's group."""
    started, stopped = [], []

    def stop(signum, frame):
        stopped.append(signum)
        for pid in started:
            _kill_group(pid)

    for signum in (signal.SIGTERM, signal.SIGINT):  # before the command starts: a stop never misses it
        signal.signal(signum, stop)
    child = subprocess.Popen(command, process_group=0)
    started.append(child.pid)
    with open(report_path, "w") as report:
        report.write(f"{child.pid}\n")
    if stopped:  # a stop that came while it was starting
        _kill_group(child.pid)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    with open(report_path, "a") as report:
        report.write(f"{usage.ru_maxrss * 1024}\n")  # Linux reports KiB
    if child.returncode < 0:  # end by the same signal (its default action), so the caller sees it
        signum = -child.returncode
        if signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        sys.exit(128 + signum)  # a signal whose default is to be ignored
    sys.exit(child.returncode)


if __name__ == "__main__":
    _reap(sys.argv[1], sys.argv[2:])
