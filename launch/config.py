"""Parallel layout (``parallel.*``), cluster launch (``launch.*``) and planner (``plan.*``) keys of a run.

Plain dataclasses and their per-section checks: no MindSpore and no planner code, so the config
schema and ``mindmoe-launch`` read them without importing either.
"""

from dataclasses import dataclass
from typing import Optional

#: Bytes per gradient element for each ``plan.grad_dtype``.
GRAD_BYTES = {"fp32": 4, "bf16": 2}


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
    """``plan.*`` keys of ``mindmoe-plan`` (planner only: the trainer has no tp/pp yet).

    The layout planned is ``parallel.dp`` x ``plan.tp`` x ``plan.pp`` with ``parallel.ep``; the
    micro-batch, sequence length and global batch are ``data.micro_batch_size``,
    ``data.seq_len`` and ``data.global_batch_size``. The formulas are in :mod:`launch.plan`.
    """

    #: Devices the layout search fills; 0 = those of the planned layout (dp * tp * pp).
    devices: int = 0
    #: Memory of one device in GiB (Ascend 910B: 64).
    device_memory_gb: float = 64.0
    #: GiB kept free for the runtime (framework workspace, HCCL, fragmentation).
    reserved_gb: float = 4.0
    #: Tensor-parallel degree, with sequence parallelism (must divide the query and key/value heads).
    tp: int = 1
    #: Pipeline stages, 1F1B schedule.
    pp: int = 1
    #: 0: optimizer replicated; 1: ZeRO-1, master weights and Adam states sharded over the
    #: data-parallel group (edp for experts); 2: gradients sharded too.
    zero: int = 1
    #: Full activation recomputation of every layer.
    recompute: bool = False
    #: Fused attention that never stores the seq x seq scores (Ascend FlashAttentionScore).
    flash_attention: bool = True
    #: Gradient dtype: fp32 (Megatron's choice for bf16 training) or bf16.
    grad_dtype: str = "fp32"
    #: MiB of one gradient-reduction bucket (two are live while reducing).
    grad_bucket_mb: float = 256.0
    #: Largest tensor-parallel degree the search tries (8 = the devices of one 910B server).
    max_tp: int = 8
    #: Layouts the search prints.
    show_layouts: int = 5


def validate_plan_config(plan: PlanConfig) -> None:
    """Raise ValueError naming the ``plan.*`` key whose value cannot work."""

    def fail(key: str, why: str):
        raise ValueError(f"plan.{key}={getattr(plan, key)!r}: {why}")

    for key in ("devices", "reserved_gb", "grad_bucket_mb", "show_layouts"):
        if getattr(plan, key) < 0:
            fail(key, "must be >= 0")
    for key in ("tp", "pp", "max_tp"):
        if getattr(plan, key) < 1:
            fail(key, "must be >= 1")
    if plan.device_memory_gb <= plan.reserved_gb:
        fail("device_memory_gb", f"must exceed plan.reserved_gb={plan.reserved_gb}")
    if plan.zero not in (0, 1, 2):
        fail("zero", "must be 0 (no sharding), 1 (optimizer states) or 2 (optimizer states and gradients)")
    if plan.grad_dtype not in GRAD_BYTES:
        fail("grad_dtype", f"must be one of {tuple(GRAD_BYTES)}")
