"""The msrun scheduler's port: a check before msrun starts, and the scheduler log's word when it could not listen.

A scheduler that cannot listen on ``launch.master_port`` logs "Failed to init the tcp server" within
seconds and exits, but msrun only looks at its workers, which wait ``launch.cluster_timeout`` for a
scheduler that is gone. So the node that hosts the scheduler tries the port first, and the launcher
reads ``scheduler.log`` while the job runs (the port can be taken between the check and the start).
"""

import errno
import socket
from pathlib import Path
from typing import Optional

#: What the MindSpore 2.9 scheduler logs when it cannot listen on its port.
BIND_FAILURE = "Failed to init the tcp server"


class PortInUse(ValueError):
    """``launch.master_port`` is taken on the node that hosts the scheduler (a configuration error, exit 2)."""


def _advice(port: int) -> str:
    return f"stop what holds port {port} (another job's scheduler?) or choose a free launch.master_port"


def check_port_free(address: str, port: int) -> None:
    """Raise :class:`PortInUse` when ``address:port`` cannot be bound here.

    ``SO_REUSEADDR`` keeps a port that only lingers in TIME_WAIT from an earlier run from being
    reported: the scheduler can reuse it. Other bind errors are left to msrun to report.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise PortInUse(
                    f"launch.master_port={port}: port {port} on {address} is already in use, so msrun's "
                    f"scheduler could not listen there; {_advice(port)}"
                ) from None


class SchedulerLog:
    """Reads ``scheduler.log`` again only when it has grown, for the line of a failed listen."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._size = -1

    def bind_failure(self) -> Optional[str]:
        try:
            size = self.path.stat().st_size
            if size == self._size:
                return None
            self._size = size
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    if BIND_FAILURE in line:
                        return line.strip()
        except OSError:
            return None
        return None


def bind_failure_message(address: str, port: int, line: str, log: Path) -> str:
    """The report of a scheduler that could not listen: the port, the key, and the scheduler's own line."""
    return (
        f"launch.master_port={port}: msrun's scheduler could not listen on {address}:{port} (port in use?); "
        f"{log}: {line}\nThe workers were stopped; {_advice(port)}."
    )
