"""ZeRO (``parallel.zero`` 1-3): the AdamW state, then the gradients, then the weights of a parameter split over
the ranks that hold the same copy of it; this module is the optimizer side, train/parallel/fsdp.py the model side.

Layout (train/parallel/ranges.py). A trained parameter of ``n`` elements held identically by ``k`` ranks (dense
parameters: every rank of the job, or of its shard group under ``parallel.shard_size``; expert shards under
``parallel.ep``: the ranks of their ``expert_dp_group`` in the group, or ``k = 1``) is flattened and padded with
zeros to ``n' = k * ceil(n / k)``; rank ``i`` of those ``k`` owns the flat range ``[i n'/k, (i + 1) n'/k)``. Its
moments ``exp_avg`` / ``exp_avg_sq`` exist for that range only (fp32 ``[n'/k]``), and so does an fp32 copy of the
range, the ``var`` the fused Adam kernel updates in place: a working copy read from the fp32 parameter every step,
or with half-precision weights (``train.dtype``) the persistent fp32 master; a ZeRO-3 fp32 parameter, held as its
range, is updated in place and needs none.

A step (train/step.py):

    gradients -> this rank's ranges of the mean gradient: reduce-scattered after the backward (stage 1) or inside
                 it by the seams (stages 2-3); under hybrid sharding then all-reduced across the shard groups
    |g|^2      = the ranges' squares summed, all-reduced over a shard group (each element is owned once there)
    each range, one after the other: times the clipping factor, the update of train/fused_adamw.py (decoupled
                 decay, bias correction, ``update_scales`` mapped to the range's elements)
    the ranges -> the parameters: all-gathered (stages 1-2), cast into the held range (stage 3, half precision)

The update is element-wise, so every range gets exactly the values :class:`FusedAdamW` gives it. Checkpoints see
ranges as full tensors (:class:`train.parallel.range_views.MomentView`), written by their owners.
"""

import logging

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.ops import functional as F

from mindmoe.model import kernels
from mindmoe.train.fused_adamw import fused_update
from mindmoe.train.grad_norm import global_squared_norm_kernel
from mindmoe.train.parallel.ranges import ShardSpec, flat_range

log = logging.getLogger("mindmoe.train")


class ParamRange(nn.Cell):
    """One parameter's range and its collectives (``collectives``: ``(reduce_scatter, all_gather)`` factories
    called with ``(group, k, rank)``, default the kernel functions; tests pass stand-ins)."""

    def __init__(self, spec: ShardSpec, collectives=None, reduce_dtype=None):
        super().__init__()
        scatter, gather = collectives or (kernels.reduce_scatter, kernels.all_gather)
        #: The dtype gradients are reduced in (``train.grad_reduce_dtype``; None: fp32).
        self.reduce_dtype = ms.float32 if reduce_dtype is None else reduce_dtype
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
        shard = self.over_replicas(self.reduce_scatter(self.flat(grad.astype(self.reduce_dtype))))
        shard = shard.astype(ms.float32)
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

        def __init__(
            self, params, specs, collectives=None, stage=1, seamed=frozenset(), masters=None, reduce_dtype=None, **kw
        ):
            ranged = {spec.name for spec in specs if stage == 3 and spec.name in seamed}
            self_ranged = set() if masters is not None else ranged
            # Read by clone_state while the base class builds the moments: only ranges are allocated.
            object.__setattr__(self, "_zero_specs", {spec.name: spec for spec in specs})
            super().__init__(params, **kw)
            self.stage = stage
            self.specs = [self._zero_specs[p.name] for p in self.parameters]
            #: Gradient reduced in the backward (stage >= 2, seamed); ``ranged``: the parameter is held as its range
            #: (3); ``local``: it is also its own master (fp32 weights).
            self.in_backward = tuple(stage >= 2 and p.name in seamed for p in self.parameters)
            self.ranged = tuple(p.name in ranged for p in self.parameters)
            self.local = tuple(p.name in self_ranged for p in self.parameters)
            #: ``masters``: the dtype the parameters are stored in (half precision), whose fp32 masters are the
            #: ranges (persistent); None: the ranges are working copies read from the fp32 parameters every step.
            self.masters = masters
            # A parameter that is its own range needs none (one placeholder element).
            self.ranges = self.clone_state("zero_range", "zeros", skip=self_ranged)
            self.shards = nn.CellList([ParamRange(spec, collectives, reduce_dtype) for spec in self.specs])
            self.count = len(self.specs)
            if masters is not None:
                for i, param in enumerate(self.parameters):
                    if not param.has_init:  # a deferred weight (model.deferred_init): a checkpoint sets the master
                        values = param.astype(ms.float32).asnumpy()  # numpy has no bf16
                        self.ranges[i].set_data(Tensor(flat_range(values, self.specs[i])))

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
            values = param.astype(ms.float32).asnumpy() if param.dtype == ms.bfloat16 else param.asnumpy()
            param.set_data(Tensor(flat_range(values, self.specs[i]), dtype=param.dtype), True)

        def store_half(self) -> None:
            """Every parameter <- its fp32 value in the storage dtype ``masters`` (called once, after the masters
            were taken from them)."""
            for param in self.parameters:
                if param.has_init:  # deferred: storage now, values from the masters once a checkpoint set them
                    param.set_data(Tensor(np.zeros(param.shape, np.float32)))
                param.set_dtype(self.masters)

        def refresh_weights(self) -> None:
            """The parameters <- their masters (after a checkpoint set the masters); a collective, every rank
            calls it."""
            if self.masters is None:
                return

            @ms.jit
            def refresh():
                return self.store_ranges(self.ranges)

            refresh()

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
                elif self.masters is not None:  # persistent fp32 masters
                    loaded = loaded + (self.ranges[i],)
                else:
                    loaded = loaded + (ops.assign(self.ranges[i], self.shards[i].owned(self._parameters[i])),)
            return loaded

        def store_ranges(self, values):
            """The parameters <- every rank's ``values`` (the updated ranges) all-gathered (a parameter that is its
            own range was updated in place)."""
            for i in range(self.count):
                param = self._parameters[i]
                if self.ranged[i] and not self.local[i]:  # ZeRO-3 over masters: this rank's range, cast
                    ops.assign(param, values[i].astype(param.dtype))
                elif not self.local[i]:
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
