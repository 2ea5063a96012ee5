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
Checkpoints keep full moments: :class:`MomentView` gathers on ``asnumpy`` and slices on ``set_data``.
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


def shard_specs(params, dist=None) -> list:
    """The :class:`ShardSpec` of every parameter on this rank of ``dist`` (None: one process)."""
    world = dist.world_size if dist is not None else 1
    rank = dist.rank if dist is not None else 0
    experts = dist.expert_rows if dist is not None else {}
    world_group = ""
    if world > 1:
        from mindspore.communication import GlobalComm

        world_group = GlobalComm.WORLD_COMM_GROUP
    specs = []
    for param in params:
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

    def flat(self, x):
        """``x`` flattened and zero-padded to ``n'`` elements."""
        flat_N = x.reshape(-1)
        if self.pad:
            flat_N = ops.pad(flat_N, (0, self.pad))
        return flat_N

    def scatter(self, grad):
        """This rank's range of the mean gradient over the ``k`` ranks."""
        shard = self.reduce_scatter(self.flat(grad.astype(ms.float32)))
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
        def __init__(self, params, specs, collectives=None, **kwargs):
            # Read by clone_state while the base class builds the moments: only ranges are allocated.
            object.__setattr__(self, "_zero_specs", {spec.name: spec for spec in specs})
            super().__init__(params, **kwargs)
            self.specs = [self._zero_specs[p.name] for p in self.parameters]
            self.ranges = self.clone_state("zero_range", "zeros")
            self.shards = nn.CellList([ParamRange(spec, collectives) for spec in self.specs])
            self.count = len(self.specs)

        def clone_state(self, prefix, init):
            return ParameterTuple(
                Parameter(
                    Tensor(np.zeros(self._zero_specs[p.name].size, np.float32)),
                    name=f"{prefix}.{p.name}",
                    requires_grad=False,
                )
                for p in self.parameters
            )

        def scatter(self, grads):
            """Every parameter's range of the mean gradient (reduce-scattered)."""
            shards = ()
            for i in range(self.count):
                shards = shards + (self.shards[i].scatter(grads[i]),)
            return shards

        def load_ranges(self):
            """The working copies <- the parameters' ranges; the copies (values after the assignment)."""
            loaded = ()
            for i in range(self.count):
                loaded = loaded + (ops.assign(self.ranges[i], self.shards[i].owned(self._parameters[i])),)
            return loaded

        def store_ranges(self, values):
            """The parameters <- every rank's ``values`` (the updated ranges) all-gathered."""
            for i in range(self.count):
                param = self._parameters[i]
                ops.assign(param, self.shards[i].gather(values[i]).astype(param.dtype))
            return self.count

        def apply(self, gradients, finite, update_scales=None):
            """The whole update of a step from this rank's gradient ranges: skipped (no state changes) unless
            ``finite``, the collectives run either way. Ranges are passed on as values: MindSpore 2.9 may schedule
            a read of a working copy before an earlier write of it in the same graph (assignment, Adam kernel)."""
            if finite:
                values = self.construct(gradients, update_scales)
            else:
                values = self.load_ranges()
            self.store_ranges(values)
            return finite

        def range_scales(self, update_scales):
            scales = ()
            for i in range(self.count):
                scale = update_scales[i]
                if scale is None:
                    scales = scales + (None,)
                else:
                    scales = scales + (self.shards[i].owned_scale(scale),)
            return scales

        def construct(self, gradients, update_scales=None):
            weight_decay, (beta1_power, beta2_power, beta1, beta2, eps, lr) = self.step_scalars()
            update = F.partial(fused_update, beta1_power, beta2_power, beta1, beta2, eps, lr)
            if update_scales is None:
                update_scales = (None,) * self.count
            else:
                update_scales = self.range_scales(update_scales)
            loaded = self.load_ranges()
            ranges = ()
            for i in range(self.count):
                ranges = ranges + (F.depend(self.ranges[i], loaded[i]),)
            return self.hyper_map(update, weight_decay, update_scales, ranges, gradients, self.exp_avg, self.exp_avg_sq)

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
    inv_world = 1.0 / world

    def synchronise(grads, loss):
        return optimizer.scatter(grads), all_reduce(loss) * inv_world

    global_squared_norm = global_squared_norm_kernel()

    def squared_norm(shards):
        return all_reduce(global_squared_norm(shards))

    return synchronise, squared_norm


def log_moment_share(optimizer, rank: int) -> int:
    """Log (and return) this rank's AdamW moment elements against the full moments' (both moments)."""
    held = sum(2 * spec.size for spec in optimizer.specs)
    full = sum(2 * spec.numel for spec in optimizer.specs)
    log.info("zero: rank %d holds %d of %d AdamW moment elements", rank, held, full)
    return held


class MomentView:
    """A moment range seen as the full moment by checkpoint code (``name``, ``shape``, ``dtype``, ``asnumpy``,
    ``set_data``), like :class:`train.parallel.expert_parallel.ShardedState`; ``asnumpy`` is a collective (every rank of
    the job calls it, in the same order). For checkpoints written per rank: ``part = ("flat", start, stop)``,
    the elements of the row-major flattened full tensor this rank owns, ``local_part()`` their values (no
    collective), ``set_part(values)`` sets them, ``writer``: this rank owns a non-empty range (the ranges of
    all ranks' writers are disjoint and cover the tensor)."""

    def __init__(self, local, spec: ShardSpec, gather_range, gather_rows=None):
        self.local = local
        self.name = local.name
        self.dtype = local.dtype
        self.spec = spec
        self.shape = spec.full_shape
        self.part = ("flat", spec.offset + spec.start, spec.offset + spec.stop)
        self.writer = spec.stop > spec.start
        self._gather_range = gather_range
        self._gather_rows = gather_rows

    def local_part(self) -> np.ndarray:
        return self.local.asnumpy()[: self.spec.stop - self.spec.start]

    def set_part(self, values) -> None:
        values = np.asarray(values, np.float32).reshape(-1)
        expected = self.spec.stop - self.spec.start
        if values.size != expected:
            raise ValueError(f"{self.name}: {values.size} values for its range {self.part[1:]} of {expected}")
        buffer = np.zeros(self.spec.size, np.float32)
        buffer[:expected] = values
        self.local.set_data(Tensor(buffer))

    def asnumpy(self) -> np.ndarray:
        flat = self.local.asnumpy() if self._gather_range is None else self._gather_range(self.local.value()).asnumpy()
        held = flat[: self.spec.numel].reshape(self.spec.shape)
        return held if self._gather_rows is None else self._gather_rows(Tensor(held)).asnumpy()

    def set_data(self, tensor) -> None:
        full = tensor.asnumpy() if isinstance(tensor, Tensor) else np.asarray(tensor)
        held = full[self.spec.first_row : self.spec.first_row + self.spec.shape[0]] if self.spec.ep > 1 else full
        start = self.spec.start
        self.set_part(np.asarray(held, np.float32).reshape(-1)[start : self.spec.stop])


def moment_views(optimizer, dist=None) -> dict:
    """``{moment name: MomentView}`` of both moments of every parameter of a ZeRO optimizer."""
    from mindmoe.train.parallel.expert_parallel import GatherFromGroup

    jitted = {}

    def compiled(key, cell):
        """One compiled collective per distinct cell (kept alive with it)."""
        if key not in jitted:

            @ms.jit
            def run(x):
                return cell(x)

            jitted[key] = (cell, run)
        return jitted[key][1]

    views = {}
    for shard, spec, m, v in zip(optimizer.shards, optimizer.specs, optimizer.exp_avg, optimizer.exp_avg_sq):
        gather_range = compiled(id(shard.all_gather), shard.all_gather) if spec.k > 1 else None
        gather_rows = None
        if spec.ep > 1:
            rows = ("rows", spec.shape[0])
            if rows not in jitted:
                compiled(rows, GatherFromGroup(dist.ep_group, dist.rank_in_group, spec.shape[0], spec.ep))
            gather_rows = jitted[rows][1]
        for moment in (m, v):
            views[moment.name] = MomentView(moment, spec, gather_range, gather_rows)
    return views
