"""Temporary directories of the data cache, named after the process that made them.

``prepare_data`` reads files into a ``.read-<pid>@<host>-<random>`` directory and builds each
cache entry in a ``.<key>.<pid>@<host>-<random>`` staging directory; both are deleted when it
ends, but not when the process is killed. The owner in the name lets a later preparation tell
the leftovers of a dead process from the directories of one still running (another run
preparing the same cache, or an ``msrun`` worker), and only the former are removed. A cache
shared by several hosts holds directories of other hosts too: their pids mean nothing here,
so they are left to their own host.
"""

import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import List

logger = logging.getLogger(__name__)

#: ``.read-<pid>@<host>-<random>`` or ``.<entry key>.<pid>@<host>-<random>``; ``tempfile``'s
#: random part has no ``-``, so the host is everything between ``@`` and the last ``-``.
OWNED_NAME = re.compile(r"^\.(?:read-|[0-9a-f]+\.)(?P<pid>\d+)@(?P<host>.+)-[a-z0-9_]+$")
#: How ``.read-*`` directories were named before they carried their owner.
UNOWNED_READ_NAME = re.compile(r"^\.read-[a-z0-9_]+$")


def scratch_prefix(prefix: str) -> str:
    """``prefix`` plus this process's ``<pid>@<host>-``, for ``tempfile``'s ``prefix=``."""
    return f"{prefix}{os.getpid()}@{socket.gethostname()}-"


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a process on this host (a recycled pid counts: the directory is kept)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_scratch(directories: List[Path]) -> List[Path]:
    """Delete the temporary directories in ``directories`` left by dead processes of this host,
    logging each; returns them. Unowned ``.read-*`` directories of earlier versions get a warning."""
    host = socket.gethostname()
    removed = []
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob(".*")):
            match = OWNED_NAME.match(path.name)
            if match is None:
                if UNOWNED_READ_NAME.match(path.name) and path.is_dir():
                    logger.warning(
                        "%s: temporary directory of an earlier mindmoe version (no owner in its name); "
                        "delete it when no data preparation is running",
                        path,
                    )
                continue
            pid = int(match["pid"])
            if match["host"] != host or process_running(pid) or not path.is_dir():
                continue
            logger.warning("removing %s: temporary directory left by process %d, which is no longer running", path, pid)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
