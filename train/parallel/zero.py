"""ZeRO-1 (``parallel.zero=1``): the AdamW moments split over the ranks that hold the same copy of a parameter.

Layout. A trained parameter of ``n`` elements held identically by ``k`` ranks (dense parameters: every rank of
the job; expert shards under ``parallel.ep``: the ranks of their ``expert_dp_group``, or ``k = 1`` when there is
none) is flattened and padded with zeros to ``n' = k * ceil(n / k)``; rank ``i`` of those ``k`` owns the flat
range ``[i n'/k, (i + 1) n'/k)``. Its moments ``exp_avg`` / ``exp_avg_sq`` exist for that range only (fp32
``[n'/k]``), and so does an fp32 working copy of the range, the ``var`` the fused Adam kernel updates in place.

A step (train/step.py), after backward and accumulation (whose buffers stay full size):

    gradients -> reduce-scatter over the k ranks (sum), times the mean's factor   this rank's ranges
    |g|^2      = the ranges' squares summed, all-reduced over the world (each element is owned once; padding 0)
    clipping as without ZeRO
    working copy <- the parameter's range; the update of train/fused_adamw.py on it (decoupled decay, bias
                    correction, ``update_scales`` mapped to the range's elements)
    all-gather of the ranges -> the full parameter

The update is element-wise, so every range gets exactly the values :class:`FusedAdamW` gives it. The working
copy is read from the parameter every step, so a resumed (``set_data``) parameter needs nothing else.
Checkpoints see full moments: :class:`train.parallel.range_views.MomentView` gathers on ``asnumpy`` and slices
on ``set_data``.
"""

import logging
import math
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.ops import functional as F

from mindmoe.model import kernels
from mindmoe.train.fused_adamw import fused_update
from mindmoe.train.grad_norm import global_squared_norm_kernel

log = logging.getLogger("mindmoe.train")


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


class ParamRange(nn.Cell):
    """One parameter's range and its collectives (``collectives``: ``(reduce_scatter, all_gather)`` factories
    called with ``(group, k, rank)``, default the kernel functions; tests pass stand-ins)."""

    def __init__(self, spec: ShardSpec, collectives=None):
        super().__init__()
        scatter, gather = collectives or (kernels.reduce_scatter, kernels.all_gather)
        self.shape = tuple(spec.shape)
        self.numel = spec.numel
        self.pad = spec.size * spec.k - spec.numel
        self.start = spec.start
        self.size = spec.size
        self.mean_scale = spec.mean_scale
        self.rows = spec.shape[0] if spec.shape else 1
        self.row_numel = spec.numel // self.rows
        distributed = spec.k > 1
        self.reduce_scatter = scatter(spec.group, spec.k, spec.rank) if distributed else nn.Identity()
        self.all_gather = gather(spec.group, spec.k, spec.rank) if distributed else nn.Identity()
        # Hybrid sharding: the range's gradient summed over its replicas in the other shard groups.
        self.over_replicas = ops.AllReduce(group=spec.replica_group) if spec.replica_group else nn.Identity()

    def flat(self, x):
        """``x`` flattened and zero-padded to ``n'`` elements."""
        flat_N = x.reshape(-1)
        if self.pad:
            flat_N = ops.pad(flat_N, (0, self.pad))
        return flat_N

    def scatter(self, grad):
        """This rank's range of the mean gradient over the ``k`` ranks."""
        shard = self.over_replicas(self.reduce_scatter(self.flat(grad.astype(ms.float32))))
        if self.mean_scale != 1.0:
            shard = shard * self.mean_scale
        return shard

    def owned(self, param):
        return self.flat(param.astype(ms.float32))[self.start : self.start + self.size]

    def owned_scale(self, scale):
        """A per-row update scale (``[rows, 1, ...]``) as one factor per element of the range."""
        element = ops.arange(self.start, self.start + self.size, dtype=ms.int32)
        row = ops.minimum(element // self.row_numel, self.rows - 1)
        return ops.gather(scale.reshape(-1).astype(ms.float32), row, 0)

    def gather(self, shard):
        """The full parameter from every rank's range."""
        return self.all_gather(shard)[: self.numel].reshape(self.shape)


def zero_adamw_class(fused):
    """The ZeRO-1 variant of the :func:`train.fused_adamw.fused_adamw_class` class ``fused``: moments and
    updates of this rank's ranges only. The step calls :meth:`scatter` on the gradients, then :meth:`apply`."""

    class ZeroAdamW(fused):
        """``stage`` (``parallel.zero``) 1-3; ``seamed``: the names of the parameters read through a seam
        (model/weights.py), whose gradients stages 2 and 3 reduce-scatter in the backward
        (train/parallel/fsdp.py); the others are reduced as at stage 1."""

        def __init__(self, params, specs, collectives=None, stage=1, seamed=frozenset(), **kwargs):
            self_ranged = {spec.name for spec in specs if stage == 3 and spec.name in seamed}
            # Read by clone_state while the base class builds the moments: only ranges are allocated.
            object.__setattr__(self, "_zero_specs", {spec.name: spec for spec in specs})
            object.__setattr__(self, "_self_ranged", self_ranged)
            super().__init__(params, **kwargs)
            self.stage = stage
            self.specs = [self._zero_specs[p.name] for p in self.parameters]
            #: Gradient reduced in the backward (stage >= 2, seamed); ``local``: the parameter is its own range (3).
            self.in_backward = tuple(stage >= 2 and p.name in seamed for p in self.parameters)
            self.local = tuple(p.name in self_ranged for p in self.parameters)
            # The working copy of each range (stage 2: also what the backward's range gradient is taken for);
            # a parameter that is its own range needs none (one placeholder element).
            self.ranges = self.clone_state("zero_range", "zeros", skip=self_ranged)
            self.shards = nn.CellList([ParamRange(spec, collectives) for spec in self.specs])
            self.count = len(self.specs)

        def clone_state(self, prefix, init, skip=frozenset()):
            return ParameterTuple(
                Parameter(
                    Tensor(np.zeros(1 if p.name in skip else self._zero_specs[p.name].size, np.float32)),
                    name=f"{prefix}.{p.name}",
                    requires_grad=False,
                )
                for p in self.parameters
            )

        @property
        def targets(self) -> list:
            """What the step differentiates, one per parameter: the parameter, or (stage 2, seamed) its range."""
            return [
                self.ranges[i] if self.in_backward[i] and not self.local[i] else self._parameters[i]
                for i in range(self.count)
            ]

        def target_shapes(self) -> list:
            """The shapes of the gradients the step gets for :attr:`targets` (a range: ``[size]``)."""
            return [
                (spec.size,) if reduced else tuple(spec.shape) for spec, reduced in zip(self.specs, self.in_backward)
            ]

        def shrink(self, i: int) -> None:
            """Parameter ``i`` (stage 3) <- its own range ``[size]`` (train/parallel/fsdp.py installs the seam that
            all-gathers it)."""
            param = self._parameters[i]
            if tuple(param.shape) == (self.specs[i].size,):
                return
            spec = self.specs[i]
            values = np.zeros(spec.size * spec.k, np.float32)
            values[: spec.numel] = param.asnumpy().reshape(-1)
            param.set_data(Tensor(values[spec.start : spec.start + spec.size], dtype=param.dtype), True)

        def scatter(self, grads):
            """Every parameter's range of the mean gradient (reduce-scattered; already a range when the backward
            reduced it)."""
            shards = ()
            for i in range(self.count):
                if self.in_backward[i]:
                    shards = shards + (grads[i],)
                else:
                    shards = shards + (self.shards[i].scatter(grads[i]),)
            return shards

        def load_ranges(self):
            """The working copies <- the parameters' ranges; the copies (values after the assignment). A parameter
            that is its own range is passed as it is."""
            loaded = ()
            for i in range(self.count):
                if self.local[i]:
                    loaded = loaded + (self._parameters[i],)
                else:
                    loaded = loaded + (ops.assign(self.ranges[i], self.shards[i].owned(self._parameters[i])),)
            return loaded

        def store_ranges(self, values):
            """The parameters <- every rank's ``values`` (the updated ranges) all-gathered (a parameter that is its
            own range was updated in place)."""
            for i in range(self.count):
                if not self.local[i]:
                    param = self._parameters[i]
                    ops.assign(param, self.shards[i].gather(values[i]).astype(param.dtype))
            return self.count

        def apply(self, gradients, finite, update_scales=None, factor=None):
            """The whole update of a step from this rank's gradient ranges times ``factor`` (the clipping factor,
            applied range by range): skipped (no state changes) unless ``finite``, the collectives run either way;
            returns ``finite``, after every update. Ranges are passed on as values: MindSpore 2.9 may schedule a
            read of a working copy before an earlier write of it in the same graph (assignment, Adam kernel)."""
            if finite:
                values = self.construct(gradients, update_scales, factor)
            else:
                values = self.load_ranges()
            self.store_ranges(values)
            # The caller goes on from this value: a parameter updated in place (ZeRO-3) has no other reader of the
            # branch's result, which MindSpore 2.9 would otherwise drop with its side effects.
            return F.depend(finite, values)

        def range_scales(self, update_scales):
            scales = ()
            for i in range(self.count):
                scale = update_scales[i]
                if scale is None:
                    scales = scales + (None,)
                else:
                    scales = scales + (self.shards[i].owned_scale(scale),)
            return scales

        def construct(self, gradients, update_scales=None, factor=None):
            """The update of every range from its gradient times ``factor`` (clipping; None: 1), one range after
            the other: each scaled gradient is made after the previous range's update, so one exists at a time."""
            weight_decay, (beta1_power, beta2_power, beta1, beta2, eps, lr) = self.step_scalars()
            if update_scales is None:
                update_scales = (None,) * self.count
            else:
                update_scales = self.range_scales(update_scales)
            loaded = self.load_ranges()
            values = ()
            previous = loaded
            for i in range(self.count):
                if self.local[i]:  # updated in place: passed as the Parameter itself
                    working = self._parameters[i]
                else:
                    working = F.depend(self.ranges[i], loaded[i])
                grad = gradients[i]
                if factor is not None:
                    grad = F.depend(grad, previous) * factor
                value = fused_update(
                    beta1_power,
                    beta2_power,
                    beta1,
                    beta2,
                    eps,
                    lr,
                    weight_decay[i],
                    update_scales[i],
                    working,
                    grad,
                    self.exp_avg[i],
                    self.exp_avg_sq[i],
                )
                values = values + (value,)
                previous = value
            return values

    return ZeroAdamW


def zero_reductions(optimizer, dist=None):
    """``(synchronise, squared_norm)`` of the step under ZeRO-1: the gradients' ranges and the mean loss, and
    the global squared norm from the ranges."""
    world = dist.world_size if dist is not None else 1
    if world == 1:

        def synchronise(grads, loss):
            return optimizer.scatter(grads), loss

        return synchronise, global_squared_norm_kernel()
    all_reduce = ops.AllReduce()
    # Every element is owned by one rank of each shard group (hybrid sharding), of the world otherwise.
    shard_group = getattr(dist, "shard_group", "")
    over_owners = ops.AllReduce(group=shard_group) if shard_group else all_reduce
    inv_world = 1.0 / world

    def synchronise(grads, loss):
        return optimizer.scatter(grads), all_reduce(loss) * inv_world

    global_squared_norm = global_squared_norm_kernel()

    def squared_norm(shards):
        return over_owners(global_squared_norm(shards))

    return synchronise, squared_norm


def log_moment_share(optimizer, rank: int) -> int:
    """Log (and return) this rank's AdamW moment elements against the full moments' (both moments)."""
    held = sum(2 * spec.size for spec in optimizer.specs)
    full = sum(2 * spec.numel for spec in optimizer.specs)
    log.info("zero: rank %d holds %d of %d AdamW moment elements", rank, held, full)
    return held
