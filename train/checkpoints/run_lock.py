"""One writer per run directory: ``<run dir>/run.lock``, held by the process that writes the run.

The lock is an ``fcntl.flock`` on the file, not an ``O_CREAT | O_EXCL`` marker: the kernel drops a
flock when its process ends in any way (``kill -9``, out of memory, a crash of the interpreter), so a
lock left behind is recognised as stale by trying it, with no guess from a pid that may have been reused.
The file's content (JSON: pid, host, start time) only names the holder in messages. Linux emulates flock
on NFS with POSIX record locks, so runs on two hosts sharing a run dir exclude each other too.

Under msrun every worker of a job runs in the same run dir: only rank 0 (the one writer of metrics and
checkpoints) takes the lock, after the job has formed, so a job never conflicts with itself; a second
job's rank 0 fails, and msrun then stops that job. The file is removed when the lock is released (end of
the run, an error, a stop on a signal); after a kill it stays and the next run takes it over with a warning.
"""

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

from mindmoe.conf.exit_codes import CommandExit

log = logging.getLogger("mindmoe.train")

LOCK_FILE = "run.lock"
# A probe (``holder``) holds a shared lock for microseconds; an acquire that meets one retries.
_ATTEMPTS, _RETRY_SECONDS = 20, 0.05


class RunDirBusy(CommandExit):
    """Another live process holds the run directory's lock (exit code 2: choose another run dir)."""


def _process_start(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid from the holder."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def holder_alive_here(info: dict) -> bool:
    """True when the holder ``info`` names is a running process of this host (the same pid and start)."""
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False  # (pid 0 or below would name a process group)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    recorded = info.get("pid_start")
    return recorded is None or _process_start(pid) in (None, recorded)


def _read_info(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        info = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"unreadable": raw[:200].decode("utf-8", "replace")}
    return info if isinstance(info, dict) else {}


def describe(info: dict) -> str:
    if not info.get("pid"):
        return "a process that wrote no details"
    return f"pid {info['pid']} on host {info.get('host', '?')} (started {info.get('started', '?')})"


def busy(lock_path: Path, info: dict) -> RunDirBusy:
    """The error for a run dir whose lock ``lock_path`` a live process holds (``info``: its content)."""
    return RunDirBusy(
        f"hydra.run.dir={lock_path.parent} is in use: {lock_path} is held by {describe(info)}; wait for that "
        "run to end (or stop it) and run this command again, or choose another hydra.run.dir (a lock "
        "left by a process that no longer runs is taken over automatically)"
    )


def _same_file(fd: int, path: Path) -> bool:
    """False when ``path`` was removed or replaced since ``fd`` was opened (the holder released it)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


class RunLock:
    """The lock of ``run_dir``; :meth:`acquire` takes it (rank 0), leaving the ``with`` block releases it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirBusy` naming its holder; a stale lock is taken over."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(_ATTEMPTS):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not self._lock(fd, attempt == _ATTEMPTS - 1):
                os.close(fd)
                time.sleep(_RETRY_SECONDS)
                continue
            if _same_file(fd, self.path):
                break
            os.close(fd)  # locked a file its holder had just removed: try the new one
        else:
            raise RunDirBusy(f"{self.path}: could not be locked after {_ATTEMPTS} attempts")
        previous = _read_info(fd)
        if holder_alive_here(previous) and previous.get("pid") != os.getpid():
            # flock succeeded although the holder runs: this filesystem does not enforce flock.
            os.close(fd)
            raise busy(self.path, previous)
        if previous:
            log.warning(
                "%s: taking over the lock of %s, which ended without releasing it", self.path, describe(previous)
            )
        self._fd = fd
        self._write_info()

    def _lock(self, fd: int, last_attempt: bool) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            info = _read_info(fd)
            here = info.get("host") == socket.gethostname()
            if last_attempt or (info.get("pid") and (not here or holder_alive_here(info))):
                os.close(fd)
                raise busy(self.path, info) from None
            # Being created or taken over (the file still names the dead holder), or probed by a
            # starting command (:func:`lock_holder`): look again.
            return False
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # No locks on this filesystem: the pid in the file is the only guard (this host only).
            log.warning(
                "%s: the filesystem does not support file locks (%s); only runs of this host are detected",
                self.path,
                error.strerror,
            )
            return True

    def _write_info(self) -> None:
        info = {
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, (json.dumps(info, sort_keys=True) + "\n").encode("utf-8"))
        os.fsync(self._fd)

    def release(self) -> None:
        """Remove the file and drop the lock (removed first, while held, so no one locks a dead file)."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink()
        finally:
            os.close(self._fd)
            self._fd = None


def lock_holder(run_dir: Path) -> Optional[dict]:
    """The holder of ``run_dir``'s lock when a live process holds it, else None (nothing is changed)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_info(fd) or {}
    except OSError:
        info = _read_info(fd)
        return info if holder_alive_here(info) else None
    finally:
        os.close(fd)  # closing drops a shared lock this probe took
    return None
