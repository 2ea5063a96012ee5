"""The processes of one node's job, and stopping all of them.

msrun starts the scheduler in its own process group and every worker in a new session of its own
(``setsid``), with a ``tail -f`` of each worker log beside it. msrun itself handles SIGINT by
killing its workers with SIGKILL (no checkpoint) and SIGTERM not at all (it dies and its workers
train on, orphaned). So :mod:`launch.cli` starts msrun in a new session, finds the workers in the
process tree (msrun's children that lead their own session), signals them itself so that they
write their checkpoint, and at the end kills msrun's process group and each worker's session:
nothing of the job outlives the launcher.
"""

import os
import signal
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Set


class ProcessInfo(NamedTuple):
    ppid: int
    group: int
    session: int
    #: Clock ticks after boot when the process started: tells a process from a later one with its pid.
    start: int
    zombie: bool


def process_table() -> Dict[int, ProcessInfo]:
    """Every process of this host from ``/proc``."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name in parentheses may contain spaces: split after its closing one.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            ppid, group, session, start = (int(fields[i]) for i in (1, 2, 3, 19))
            table[int(entry.name)] = ProcessInfo(ppid, group, session, start, fields[0] in ("Z", "X"))
        except (OSError, IndexError, ValueError):
            continue
    return table


def alive(pid: int, table: Dict[int, ProcessInfo]) -> bool:
    """Running (a zombie has exited, only its parent has not collected it yet)."""
    return pid in table and not table[pid].zombie


def send(pid: int, signum: int, group: bool = False) -> None:
    """``kill``/``killpg`` that ignores a process (group) already gone."""
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class MsrunJob:
    """msrun (a ``Popen`` started with ``start_new_session=True``) and the workers it started.

    A pid is only signalled while it is known to be the job's: a worker by its start time, a session
    or group by a member (Linux does not reuse the pid of a session or group that still has one).
    """

    def __init__(self, process):
        self.process = process
        #: pid -> start time of every worker msrun has started.
        self.workers: Dict[int, int] = {}
        self.signalled: Set[int] = set()

    def refresh(self) -> Dict[int, ProcessInfo]:
        """Record the workers msrun has started so far (msrun's children that lead a session of their own)."""
        table = process_table()
        if self.process.returncode is None and alive(self.process.pid, table):
            for pid, info in table.items():
                if info.ppid == self.process.pid and info.session == pid:
                    self.workers.setdefault(pid, info.start)
        return table

    def running_workers(self) -> List[int]:
        table = self.refresh()
        return sorted(pid for pid, start in self.workers.items() if alive(pid, table) and table[pid].start == start)

    def forward(self, signum: int) -> None:
        """Send ``signum`` once to each running worker (also one msrun starts later) and only to the worker
        itself, not its session: a worker's own helper processes must live until it has written its checkpoint."""
        for pid in self.running_workers():
            if pid not in self.signalled:
                self.signalled.add(pid)
                send(pid, signum)

    def pause(self) -> None:
        """Stop msrun itself (not its scheduler or workers) until :meth:`kill`."""
        if self.process.poll() is None:
            send(self.process.pid, signal.SIGSTOP)

    def _signal_group(self, signum: int, table: Dict[int, ProcessInfo]) -> None:
        if self.process.returncode is None or any(info.group == self.process.pid for info in table.values()):
            send(self.process.pid, signum, group=True)

    def kill(self, grace: float = 2.0) -> None:
        """End msrun, its scheduler and log tails (SIGTERM, then SIGKILL after ``grace`` s) and kill every
        worker's session; then collect msrun."""
        table = self.refresh()
        self._signal_group(signal.SIGTERM, table)
        self._signal_group(signal.SIGCONT, table)
        deadline = time.monotonic() + grace
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        table = process_table()
        self._signal_group(signal.SIGKILL, table)
        for pid, start in self.workers.items():
            worker = table.get(pid)
            if (worker.start == start) if worker else any(info.session == pid for info in table.values()):
                send(pid, signal.SIGKILL, group=True)
        self.process.wait()
