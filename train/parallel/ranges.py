"""Where each rank's ZeRO range of a parameter lies (:class:`ShardSpec`), for every layout: ranges over every rank
holding the same copy of a tensor, or under hybrid sharding (``parallel.shard_size``) over the ranks of a shard
group (train/parallel/zero.py has the layout in full)."""

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardSpec:
    """Where this rank's range of one parameter lies. ``shape``: the tensor this rank holds (an expert shard's
    ``[E/ep, ...]`` under expert parallelism); ``group``: the communication group of the ``k`` ranks holding
    it (``""`` when ``k == 1``); ``mean_scale``: the factor that turns the summed gradient into the mean the
    step takes; ``first_row`` / ``ep``: the rows of the full tensor an expert shard holds (0 / 1 otherwise)."""

    name: str
    shape: tuple
    k: int = 1
    rank: int = 0
    group: str = ""
    mean_scale: float = 1.0
    first_row: int = 0
    ep: int = 1
    #: Hybrid sharding (``parallel.shard_size``): the group of the ranks holding this range in the other shard
    #: groups ("" without), over which its gradient is all-reduced, and this rank's shard group (0 writes it).
    replica_group: str = ""
    replica: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def size(self) -> int:
        """Elements of every rank's range, padding included: ``n' / k``."""
        return max(1, -(-self.numel // self.k))

    @property
    def start(self) -> int:
        return self.rank * self.size

    @property
    def stop(self) -> int:
        """The end of the owned elements that exist (the padding excluded), at least ``start``."""
        return max(self.start, min(self.start + self.size, self.numel))

    @property
    def full_shape(self) -> tuple:
        return (self.shape[0] * self.ep,) + tuple(self.shape[1:]) if self.ep > 1 else tuple(self.shape)

    @property
    def offset(self) -> int:
        """Flat index, in the full tensor, of this rank's held tensor's first element."""
        return self.first_row * (self.numel // self.shape[0]) if self.shape else 0


def shard_specs(params, dist=None, held=None) -> list:
    """The :class:`ShardSpec` of every parameter on this rank of ``dist`` (None: one process); ``held``: the specs
    of parameters already held as ranges (ZeRO-3, train/parallel/fsdp.py), whose own shape is their range's."""
    world = dist.world_size if dist is not None else 1
    rank = dist.rank if dist is not None else 0
    experts = dist.expert_rows if dist is not None else {}
    world_group = ""
    if world > 1:
        from mindspore.communication import GlobalComm

        world_group = GlobalComm.WORLD_COMM_GROUP
    hybrid = dist is not None and bool(getattr(dist, "replica_group", ""))
    specs = []
    for param in params:
        if hybrid:
            specs.append(_hybrid_spec(param, dist, held))
            continue
        if held and param.name in held:
            specs.append(held[param.name])
            continue
        shape = tuple(param.shape)
        if param.name in experts:
            # Averaged like train/parallel/distributed.py's reducer: summed over the expert_dp_group, divided by dp.
            grouped = bool(dist.expert_dp_group)
            specs.append(
                ShardSpec(
                    param.name,
                    shape,
                    k=world // dist.ep if grouped else 1,
                    rank=rank // dist.ep if grouped else 0,
                    group=dist.expert_dp_group if grouped else "",
                    mean_scale=1.0 / dist.dp,
                    first_row=experts[param.name],
                    ep=dist.ep,
                )
            )
        else:
            specs.append(ShardSpec(param.name, shape, world, rank, world_group, 1.0 / world))
    return specs


def _hybrid_spec(param, dist, held=None) -> ShardSpec:
    """:func:`shard_specs` under hybrid sharding: ranges over the ``shard_size`` consecutive ranks of this one (an
    expert shard's: over those of them holding the same experts), replicated in every shard group."""
    if held and param.name in held:
        return held[param.name]
    size = dist.layout.shard_size
    common = dict(replica_group=dist.replica_group, replica=dist.rank // size)
    position = dist.rank % size
    if param.name in dist.expert_rows:
        k = size // dist.ep
        return ShardSpec(
            param.name,
            tuple(param.shape),
            k=k,
            rank=position // dist.ep if k > 1 else 0,
            group=dist.expert_shard_group if k > 1 else "",
            mean_scale=1.0 / dist.dp,
            first_row=dist.expert_rows[param.name],
            ep=dist.ep,
            **common,
        )
    return ShardSpec(param.name, tuple(param.shape), size, position, dist.shard_group, 1.0 / dist.world_size, **common)


def flat_range(values: np.ndarray, spec: ShardSpec) -> np.ndarray:
    """This rank's range ``[size]`` (fp32) of a tensor's values, zero-padded."""
    padded = np.zeros(spec.size * spec.k, np.float32)
    padded[: spec.numel] = np.asarray(values, np.float32).reshape(-1)
    return padded[spec.start : spec.start + spec.size]
