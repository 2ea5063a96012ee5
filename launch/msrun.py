"""The ``msrun`` command and environment of one node, built from ``launch.*`` keys.

msrun (MindSpore's launcher) starts ``procs_per_node`` workers on this node and, on node 0, the
scheduler they rendezvous at; every worker runs ``python -m mindmoe.train.cli`` with the same overrides
and the same run dir, and writes ``worker_<rank>.log`` into the log dir. Nothing here runs a
process: :mod:`launch.cli` does.
"""

import ipaddress
import os
import shlex
import shutil
import socket
import sys
from pathlib import Path
from typing import Dict, List, Sequence

from mindmoe.launch.config import world_size

#: model/kernels/host_runtime.py's LOCAL_WORKERS_ENV (not imported: that package imports MindSpore, which the
#: launcher must not load before its logs are quieted).
LOCAL_WORKERS_ENV = "MINDMOE_LOCAL_WORKERS"

#: The worker entry point: the ``mindmoe-train`` Hydra app.
WORKER_MODULE = "mindmoe.train.cli"
#: Every worker logs to stdout, which msrun writes to ``worker_<rank>.log``; Hydra's own log file and
#: config copy are written once, by the launcher, instead of by every worker into the shared run dir.
WORKER_HYDRA_OVERRIDES = ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
#: Printed by each worker as its first line, so a failure reported by pid can be traced to a rank's log.
WORKER_BANNER = "mindmoe worker: rank {rank} pid {pid}"


def log_dir(launch, run_dir: Path) -> Path:
    return Path(launch.log_dir).expanduser().resolve() if launch.log_dir else Path(run_dir) / "msrun"


def worker_overrides(run_dir: Path, overrides: Sequence[str]) -> List[str]:
    """The user's overrides for every worker: same config, the one shared run dir; ``launch.*`` stays here."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("launch.", "launch="))]
    return [f"hydra.run.dir={Path(run_dir).resolve()}", *WORKER_HYDRA_OVERRIDES, *kept]


def environment(launch) -> Dict[str, str]:
    """Variables this node's msrun (and through it every worker) needs beyond the caller's environment."""
    # Workers sharing this node: each sizes its CPU kernel thread pool to its share (model/kernels/host_runtime.py).
    env = {"MS_NODE_TIMEOUT": str(launch.node_timeout), LOCAL_WORKERS_ENV: str(launch.procs_per_node)}
    if launch.hccl_connect_timeout:
        env["HCCL_CONNECT_TIMEOUT"] = str(launch.hccl_connect_timeout)
    if launch.hccl_exec_timeout:
        env["HCCL_EXEC_TIMEOUT"] = str(launch.hccl_exec_timeout)
    if launch.hccl_socket_ifname:
        env["HCCL_SOCKET_IFNAME"] = launch.hccl_socket_ifname
    return env


def interpreter_path_prefix():
    """The directory to put first on ``PATH``, or None when ``python`` already is this interpreter.

    msrun starts every worker as plain ``python``; it must be the one mindmoe is installed in.
    """
    interpreter_dir = str(Path(sys.executable).parent)
    found = shutil.which("python")
    return None if found and str(Path(found).parent) == interpreter_dir else interpreter_dir


def process_environment(env: Dict[str, str]) -> Dict[str, str]:
    """The caller's environment with ``env`` and the interpreter's ``PATH`` prefix applied."""
    merged = dict(os.environ, **env)
    prefix = interpreter_path_prefix()
    if prefix:
        merged["PATH"] = prefix + os.pathsep + merged.get("PATH", "")
    return merged


def msrun_command(launch, run_dir: Path, overrides: Sequence[str]) -> List[str]:
    command = [
        "msrun",
        f"--worker_num={world_size(launch)}",
        f"--local_worker_num={launch.procs_per_node}",
        f"--master_addr={launch.master_addr}",
        f"--master_port={launch.master_port}",
        f"--node_rank={launch.node_rank}",
        f"--log_dir={log_dir(launch, run_dir)}",
        "--join=True",
        f"--cluster_time_out={launch.cluster_timeout}",
    ]
    if launch.bind_core:
        command.append("--bind_core=True")
    return command + ["python", "-m", WORKER_MODULE, *worker_overrides(run_dir, overrides)]


def render(command: Sequence[str], env: Dict[str, str], launch) -> str:
    """The shell lines an operator would type on this node: exports, then the command."""
    first = launch.node_rank * launch.procs_per_node
    lines = [
        f"# node {launch.node_rank} of {launch.nodes}: ranks {first}..{first + launch.procs_per_node - 1} "
        f"of {world_size(launch)}"
    ]
    prefix = interpreter_path_prefix()
    if prefix:
        lines.append(f"export PATH={shlex.quote(prefix)}:$PATH")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    lines.append(shlex.join(command))
    return "\n".join(lines)


def is_local_address(address: str) -> bool:
    """True when ``address`` names this host (msrun then starts its scheduler here)."""
    try:
        resolved = socket.gethostbyname(address)
    except OSError:
        return False
    if ipaddress.ip_address(resolved).is_loopback:
        return True
    try:
        own = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        own = set()
    return resolved in own


def direct_workers(launch, run_dir: Path, overrides: Sequence[str]) -> List[dict]:
    """Workers of a node > 0 whose scheduler runs on this same host, with msrun's environment.

    msrun on such a node would start a second scheduler on the master address and fail (address in
    use), which happens when several "nodes" share one host. So these workers are started with the
    variables msrun would give them: role, scheduler address, world size, node id.
    """
    logs = log_dir(launch, run_dir)
    workers = []
    for local_rank in range(launch.procs_per_node):
        rank = launch.node_rank * launch.procs_per_node + local_rank
        env = {
            "MS_ROLE": "MS_WORKER",
            "MS_SCHED_HOST": launch.master_addr,
            "MS_SCHED_PORT": str(launch.master_port),
            "MS_WORKER_NUM": str(world_size(launch)),
            "MS_NODE_ID": str(rank),
            "MS_TOPO_TIMEOUT": str(launch.cluster_timeout),
            "RANK_ID": str(rank),
            "RANK_SIZE": str(world_size(launch)),
            "DEVICE_ID": str(local_rank),
        }
        command = [sys.executable, "-m", WORKER_MODULE, *worker_overrides(run_dir, overrides)]
        workers.append({"rank": rank, "command": command, "env": env, "log": logs / f"worker_{rank}.log"})
    return workers
