"""Parallel layout (``parallel.*``), cluster launch (``launch.*``) and planner (``plan.*``) keys of a run.

Plain dataclasses and their per-section checks: no MindSpore and no planner code, so the config
schema and ``mindmoe-launch`` read them without importing either.
"""

from dataclasses import dataclass
from typing import Optional

from mindmoe.conf.ranges import Range, bounded


@dataclass
class ParallelConfig:
    """How the work is split over processes. The single-process layout is ``dp=1, ep=1``."""

    #: Data-parallel replicas; 0 = the number of processes divided by ``ep`` (with ``ep_dispatcher=alltoall``:
    #: the number of processes; 1 without mindmoe-launch).
    dp: int = 0
    #: Expert-parallel group size: each MoE layer's experts are split over ``ep`` consecutive ranks;
    #: divides the process count and num_experts.
    ep: int = 1
    #: How tokens reach the experts of an expert group (``ep > 1``). ``allgather``: the group's ranks
    #: share their micro-batches (one data-parallel replica, ``dp`` counts groups) and each runs its
    #: experts' rows. ``alltoall``: every rank reads its own micro-batches (``dp`` counts every rank and
    #: ``ep`` divides it) and sends each assignment only to the rank holding its expert; experts are
    #: then data parallel over ``dp / ep`` ranks.
    ep_dispatcher: str = "allgather"
    #: ZeRO stage. 0: every rank holds the AdamW moments of all its parameters. 1 (ZeRO-1): each parameter's
    #: moments are split over the ranks holding the same copy of it (all ranks; an expert shard's data-parallel
    #: ranks), gradients are reduce-scattered and the updated ranges all-gathered. 2: the gradients are
    #: reduce-scattered inside the backward, accumulated as ranges. 3 (FSDP): the parameters are held as ranges
    #: too, all-gathered where the forward and backward read them. Same losses at every stage; checkpoints are
    #: written per rank and load into any other stage or layout.
    zero: int = bounded(
        0,
        Range(
            0,
            3,
            note="0 = every rank holds all its AdamW moments, 1 = moments split over ranks, "
            "2 = also gradients, 3 = also parameters",
        ),
    )
    #: Hybrid sharding (``parallel.zero`` >= 1): split each tensor's ranges over ``shard_size`` consecutive ranks
    #: only (a node of 8 or 16 devices) and replicate them across those groups, whose gradients are all-reduced
    #: after the reduce-scatter; 0 = over every rank holding the same copy. Divides the number of processes and
    #: is a multiple of ``ep``.
    shard_size: int = bounded(0, Range(0, None, note="0 = shard over every rank holding the same copy"))


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
    #: Seconds after a worker stops answering before the job is stopped (``MS_NODE_TIMEOUT``; on CPU also how
    #: long a collective waits for a peer): longer than a worker can be busy (a compile, a checkpoint write).
    node_timeout: int = 300
    #: ``HCCL_CONNECT_TIMEOUT``: seconds HCCL waits to link devices at start-up; 0 = HCCL's default.
    hccl_connect_timeout: int = 0
    #: ``HCCL_EXEC_TIMEOUT``: seconds a collective may wait for its peers; 0 = HCCL's default.
    hccl_exec_timeout: int = 0
    #: ``HCCL_SOCKET_IFNAME``: network interface(s) HCCL uses between hosts (e.g. ``eth0``); null = HCCL's choice.
    hccl_socket_ifname: Optional[str] = None


def world_size(launch) -> int:
    """Processes of the whole job."""
    return launch.nodes * launch.procs_per_node


def validate_launch_config(launch) -> None:
    """Each ``launch.*`` value on its own; how the world divides is :func:`conf.checks.resolve_layout`."""
    for key in ("nodes", "procs_per_node"):
        if getattr(launch, key) < 1:
            raise ValueError(f"launch.{key}={getattr(launch, key)} must be >= 1")
    if not 0 <= launch.node_rank < launch.nodes:
        raise ValueError(
            f"launch.node_rank={launch.node_rank} must be in 0..{launch.nodes - 1} (launch.nodes={launch.nodes})"
        )
    if not 1024 <= launch.master_port <= 65535:
        raise ValueError(f"launch.master_port={launch.master_port} must be a port in 1024..65535")
    if not launch.master_addr:
        raise ValueError("launch.master_addr is empty: give node 0's address (e.g. launch.master_addr=10.0.0.1)")
    for key in ("cluster_timeout", "node_timeout"):
        if getattr(launch, key) < 1:
            raise ValueError(f"launch.{key}={getattr(launch, key)} must be >= 1 second")
    for key in ("hccl_connect_timeout", "hccl_exec_timeout"):
        if getattr(launch, key) < 0:
            raise ValueError(f"launch.{key}={getattr(launch, key)} must be >= 0 (0 = HCCL's default)")


@dataclass
class PlanConfig:
    """``plan.*`` keys of ``mindmoe-plan``: the devices to plan for. The layout planned is the trainer's own
    (``parallel.*``, ``train.recompute``, ``train.dtype``, ``lora.*``); formulas in :mod:`launch.plan`.
    """

    #: Devices the layout search fills; 0 = those of the ``parallel.*`` layout. With devices and no
    #: ``parallel.dp`` / ``parallel.ep`` given, the best layout found is the one planned in detail.
    devices: int = 0
    #: Memory of one device in GiB (Ascend 910B: 64).
    device_memory_gb: float = 64.0
    #: GiB kept free for the runtime (framework workspace, HCCL, fragmentation).
    reserved_gb: float = 4.0
    #: Device the plan is for, ``Ascend`` or ``CPU``: resolves ``lora.base_dtype=auto`` and whether attention
    #: runs blockwise, as the trainer does there.
    device: str = "Ascend"
    #: Layouts the search prints.
    show_layouts: int = 5


#: Values of ``plan.device``.
PLAN_DEVICES = ("Ascend", "CPU")


def validate_plan_config(plan: PlanConfig) -> None:
    """Raise ValueError naming the ``plan.*`` key whose value cannot work."""

    def fail(key: str, why: str):
        raise ValueError(f"plan.{key}={getattr(plan, key)!r}: {why}")

    for key in ("devices", "reserved_gb", "show_layouts"):
        if getattr(plan, key) < 0:
            fail(key, "must be >= 0")
    if plan.device_memory_gb <= plan.reserved_gb:
        fail("device_memory_gb", f"must exceed plan.reserved_gb={plan.reserved_gb}")
    if plan.device not in PLAN_DEVICES:
        fail("device", f"must be one of {', '.join(PLAN_DEVICES)}")
