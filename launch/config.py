"""Parallel layout (``parallel.*``) and cluster launch (``launch.*``) keys of a run."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class ParallelConfig:
    """How the work is split over processes. The single-process layout is ``dp=1, ep=1``."""

    #: Data-parallel replicas; 0 = the number of processes divided by ``ep`` (1 without mindmoe-launch).
    dp: int = 0
    #: Expert-parallel group size: each MoE layer's experts are split over ``ep`` ranks that share
    #: their micro-batches (one data-parallel replica); divides the process count and num_experts.
    ep: int = 1


@dataclass
class LaunchConfig:
    """How ``mindmoe-launch`` starts the workers of one node with ``msrun``.

    Every node of a job runs the same ``mindmoe-launch`` command with its own ``node_rank``;
    the world size is ``nodes * procs_per_node``.
    """

    #: Nodes (hosts) taking part in the job.
    nodes: int = 1
    #: This node's index, 0 .. nodes-1; node 0 hosts the msrun scheduler at ``master_addr``.
    node_rank: int = 0
    #: Worker processes on each node (one per Ascend device).
    procs_per_node: int = 1
    #: Address of node 0, reachable from every node.
    master_addr: str = "127.0.0.1"
    #: Free TCP port of the scheduler on node 0.
    master_port: int = 8118
    #: Directory for ``scheduler.log`` and ``worker_<rank>.log``; null = ``<run dir>/msrun``.
    log_dir: Optional[str] = None
    #: Let msrun bind each worker to its own CPU cores (what Ascend servers need for host-side speed).
    bind_core: bool = False
    #: Print the msrun command and environment of this node instead of running it.
    dry_run: bool = False
    #: Seconds msrun waits for all workers to join the cluster (``--cluster_time_out``).
    cluster_timeout: int = 600
    #: Seconds after a worker stops answering before the job is stopped (``MS_NODE_TIMEOUT``).
    node_timeout: int = 30
    #: ``HCCL_CONNECT_TIMEOUT``: seconds HCCL waits to link devices at start-up; 0 = HCCL's default.
    hccl_connect_timeout: int = 0
    #: ``HCCL_EXEC_TIMEOUT``: seconds a collective may wait for its peers; 0 = HCCL's default.
    hccl_exec_timeout: int = 0
    #: ``HCCL_SOCKET_IFNAME``: network interface(s) HCCL uses between hosts (e.g. ``eth0``); null = HCCL's choice.
    hccl_socket_ifname: Optional[str] = None
