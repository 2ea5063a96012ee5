"""What ``mindmoe-launch`` says when a worker failed: which rank, its log, the error it printed, and
whether running the command again would resume; and what the workers said when a signal stopped the job.

msrun reports a failed worker by pid; every worker prints :data:`launch.msrun.WORKER_BANNER` first, so
the pid leads to its ``worker_<rank>.log``. The first error line of that log is quoted (a worker that
dies at start - an import error, a config error only the worker can see - says why there, not in
msrun's output). Resuming is suggested only when it can help: a checkpoint exists to resume from and
the worker did not reject its configuration (exit code 2, which would fail the same way again).
"""

import re
from pathlib import Path
from typing import Optional, Tuple

from mindmoe.conf.exit_codes import CONFIG_ERROR, STOPPED_ON_SIGNAL
from mindmoe.launch.msrun import WORKER_BANNER

#: msrun's report of the first worker that failed (``_api.py`` of MindSpore 2.9).
FAILED_WORKER = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
BANNER = re.compile(WORKER_BANNER.format(rank=r"(\d+)", pid=r"(\d+)"))
#: A line that says what went wrong: our commands' report, a Python exception (the last line of a
#: traceback, never indented), or a MindSpore C++ error.
ERROR_LINE = re.compile(
    r"^(?:mindmoe-[\w-]+: (?:error|stopped): .+"
    r"|(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)(?:: .*)?"
    r"|\[ERROR\] .+)$"
)
#: Longest quoted error line (a message may embed a whole config).
MAX_QUOTED = 600
#: A worker's last word after the checkpoint a stop signal asked for (``train.checkpoints.resume.TrainingStopped``).
STOPPED_LINE = re.compile(r"^mindmoe-train: stopped: (.+)$")
#: The scheduler's word on a worker it stopped hearing from for ``MS_NODE_TIMEOUT`` seconds (MindSpore 2.9,
#: ``meta_server_node.cc``); the other workers are then stopped by MindSpore itself with SIGTERM.
TIMED_OUT_WORKER = re.compile(r"worker (\d+) is the first one timed out|The node: (\d+) is timed out")
#: Checkpoint directories as ``train.checkpoints.checkpoint`` names them (``step_000300``).
CHECKPOINT_DIR = re.compile(r"^step_\d{6,}$")


def rank_log(logs: Path, pid: int) -> Tuple[Optional[int], Optional[Path]]:
    """The ``worker_<rank>.log`` whose worker printed the banner with ``pid``, as ``(rank, path)``."""
    for path in sorted(logs.glob("worker_*.log")):
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                found = BANNER.search(line)
                if found and int(found.group(2)) == pid:
                    return int(found.group(1)), path
    return None, None


def first_match(log: Path, find) -> Optional[re.Match]:
    """``find(line)`` (a pattern's ``match`` or ``search``) of the first line of ``log`` it matches, or None
    (also when ``log`` cannot be read)."""
    try:
        with open(log, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                found = find(line.rstrip("\n"))
                if found:
                    return found
    except OSError:
        return None
    return None


def first_error_line(log: Path) -> Optional[str]:
    """The first line of ``log`` that states an error (see :data:`ERROR_LINE`), or None."""
    found = first_match(log, ERROR_LINE.match)
    if found is None:
        return None
    line = found.group(0)
    return line if len(line) <= MAX_QUOTED else line[:MAX_QUOTED] + " ..."


def timed_out_rank(scheduler_log: Path) -> Optional[int]:
    """The first worker ``scheduler.log`` says stopped answering within ``launch.node_timeout``, or None."""
    found = first_match(scheduler_log, TIMED_OUT_WORKER.search)
    return None if found is None else int(found.group(1) or found.group(2))


def has_checkpoint(checkpoint_root: Path) -> bool:
    return checkpoint_root.is_dir() and any(
        CHECKPOINT_DIR.match(p.name) and p.is_dir() for p in checkpoint_root.iterdir()
    )


def failure_message(logs: Path, run_dir: Path, pid: int, code: int, node_timeout: Optional[int] = None) -> str:
    """The one report of a failed job: rank and pid, exit, log, its first error line, the worker the scheduler
    stopped hearing from (the cause when MindSpore stopped the others), and resuming if it helps."""
    rank, path = rank_log(logs, pid)
    who = f"rank {rank} (pid {pid})" if rank is not None else f"worker pid {pid}"
    where = f"its log: {path}" if path else f"logs: {logs}"
    what = f"exited with code {code}"
    if code == STOPPED_ON_SIGNAL:
        what = "stopped on a signal after the checkpoint of that step was written"
    error = first_error_line(path) if path else None
    lines = [f"{who} {what}; {where}. The other workers were stopped."]
    if error:
        lines.append(f"its first error: {error}")
    silent = timed_out_rank(logs / "scheduler.log")
    if silent is not None:
        seconds = f"{node_timeout} s, " if node_timeout else ""
        lines.append(
            f"The scheduler stopped the job: rank {silent} did not answer for launch.node_timeout ({seconds}"
            f"MS_NODE_TIMEOUT; see {logs / f'worker_{silent}.log'}). If it was busy rather than dead (a long "
            "compile or checkpoint on a loaded host), a larger launch.node_timeout lets the job wait for it."
        )
    checkpoints = Path(run_dir) / "checkpoints"
    if code == CONFIG_ERROR:
        lines.append("The worker rejected its configuration: fix it and start the run again.")
    elif has_checkpoint(checkpoints):
        lines.append(
            f"Run the same command again to continue from the last checkpoint in {checkpoints} (train.resume=auto)."
        )
    else:
        lines.append(f"No checkpoint was written (none in {checkpoints}): fix the error and start the run again.")
    return "\n".join(lines)


def rank_logs(logs: Path):
    """``(rank, path)`` of each ``worker_<rank>.log`` in ``logs``, by rank."""
    found = []
    for path in logs.glob("worker_*.log"):
        suffix = path.stem[len("worker_") :]
        if suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def stopped_line(logs: Path) -> Optional[Tuple[int, str]]:
    """The lowest rank that reported stopping after its checkpoint, and what it said."""
    for rank, path in rank_logs(logs):
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                found = STOPPED_LINE.match(line.rstrip("\n"))
                if found:
                    return rank, found.group(1)
    return None


def stop_message(logs: Path, signal_name: str, killed: bool) -> str:
    """The report of a job stopped by a signal to the launcher: the checkpoint the workers wrote, if any."""
    stopped = stopped_line(logs)
    if stopped is None:
        what = f"the workers stopped before writing a checkpoint of this run (logs: {logs})"
    else:
        what = f"rank {stopped[0]} reported: {stopped[1]}"
    if killed:
        what += "; workers still running after that were killed"
    return f"received {signal_name}; {what}. Nothing of the job is left running on this node."
