"""Checkpoint views of ZeRO ranges (train/parallel/zero.py): a moment's range, or under ZeRO-3 a parameter's
(train/parallel/fsdp.py), seen by checkpoint code as the full tensor it is a part of."""

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindmoe.train.parallel.ranges import ShardSpec


class MomentView:
    """A range (a moment's; under ZeRO-3 also a parameter's) seen as the full tensor by checkpoint code
    (``name``, ``shape``, ``dtype``, ``asnumpy``, ``set_data``), like
    :class:`train.parallel.expert_parallel.ShardedState`; ``asnumpy`` is a collective (every rank of the job
    calls it, in the same order). For checkpoints written per rank: ``part = ("flat", start, stop)``, the
    elements of the row-major flattened full tensor this rank owns, ``local_part()`` their values (no
    collective), ``set_part(values)`` sets them, ``writer``: this rank owns a non-empty range (the ranges of
    all ranks' writers are disjoint and cover the tensor)."""

    def __init__(self, local, spec: ShardSpec, gather_range, gather_rows=None, name=None):
        self.local = local
        self.name = name or local.name
        self.dtype = local.dtype
        self.spec = spec
        self.shape = spec.full_shape
        self.part = ("flat", spec.offset + spec.start, spec.offset + spec.stop)
        self.writer = spec.stop > spec.start and spec.replica == 0
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
    """``{moment name: MomentView}`` of both moments of every parameter of a ZeRO optimizer, and ``{parameter name:
    MomentView}`` of every parameter that is its own range (ZeRO-3) or has an fp32 master (half-precision weights)."""
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
    for i, (param, spec) in enumerate(zip(optimizer.parameters, optimizer.specs)):
        # ZeRO-3: the parameter is its own range (train/parallel/fsdp.py); half-precision weights: the checkpoint
        # holds their fp32 masters.
        held = param if optimizer.local[i] else optimizer.ranges[i] if optimizer.masters is not None else None
        if held is not None:
            shard = optimizer.shards[i]
            gather_range = compiled(id(shard.all_gather), shard.all_gather) if spec.k > 1 else None
            gather_rows = jitted[("rows", spec.shape[0])][1] if spec.ep > 1 else None
            views[param.name] = MomentView(held, spec, gather_range, gather_rows, name=param.name)
    return views
