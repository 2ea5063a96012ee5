"""ZeRO-2 and ZeRO-3 (``parallel.zero=2`` / ``3``): gradients, and under ZeRO-3 parameters, held as ranges.

The layout is ZeRO-1's (train/parallel/zero.py): a parameter flattened, zero-padded to ``k * size`` and split
into ``k`` ranges, one per rank of the ``k`` holding the same copy of it. What changes is where each stage
reduces and what a rank holds between steps:

    zero=1   full weight, full gradient (reduce-scattered after the backward), ranged moments and working copy
    zero=2   full weight; the gradient reduce-scattered inside the backward, as each parameter's gradient is
             produced: the accumulation buffers and the update hold ranges only
    zero=3   the weight itself is the range (a flat ``[size]`` parameter); the forward all-gathers it where a
             cell reads it and drops the whole tensor after use, the backward reduce-scatters its gradient

Both work through the seam every cell reads its parameters through (model/weights.py): this module replaces
the identity seam with :class:`ToOwnedRange` (zero=2) or :class:`GatherRange` (zero=3), each a cell with a
custom backward (``Cell.bprop``: MindSpore 2.9's AllGather differentiates into ReduceScatter, which the CPU
backend lacks). A parameter that has no seam stays whole and is sharded as ``zero=1`` shards it.

Under zero=2 the gradient goes to the optimizer's range of the parameter, which is what the step differentiates
(a Parameter the seam holds outside the cell tree, so the model's parameters and checkpoints do not change);
under zero=3 to the parameter itself, which the update then changes in place (fp32: it is its own master).
A whole tensor under zero=3 exists between its all-gather and its last use in the step's graph (MindSpore
keeps it for the backward of the products that read it, as FSDP without ``reshard_after_forward``);
``train.recompute`` recomputes each layer, all-gather included, in the backward instead.
"""

from mindspore import nn, ops

from mindmoe.model.weights import seams


class _RangeGradient(nn.Cell):
    """``(weight, range) -> weight``; the backward gives ``range`` this rank's range of the mean gradient."""

    def __init__(self, shard):
        super().__init__()
        self.param_range = shard

    def construct(self, weight, owned_range):
        return weight

    def bprop(self, weight, owned_range, out, dout):
        return ops.zeros_like(weight), self.param_range.scatter(dout).astype(owned_range.dtype)


class ToOwnedRange(nn.Cell):
    """A seam whose backward hands the gradient to ``owned_range``, the optimizer's fp32 range of the parameter, held
    as a plain attribute (a cell attribute would add it to the model's parameters); ``route``: the cell of
    ``(held, owned_range) -> the weight`` whose ``bprop`` does so (:class:`_RangeGradient` for zero=2,
    :class:`_GatheredToMaster` for zero=3 over half-precision weights)."""

    def __init__(self, route, owned_range):
        super().__init__()
        object.__setattr__(self, "owned_range", owned_range)
        self.route = route

    def construct(self, held):
        return self.route(held, self.owned_range)


class GatherRange(nn.Cell):
    """The zero=3 seam: ``range [size] -> the whole parameter`` (all-gather over its ``k`` ranks); the backward
    reduce-scatters the whole gradient back to this rank's range."""

    def __init__(self, shard):
        super().__init__()
        self.param_range = shard

    def construct(self, owned_range):
        return self.param_range.gather(owned_range)

    def bprop(self, owned_range, out, dout):
        return (self.param_range.scatter(dout).astype(owned_range.dtype),)


class _GatheredToMaster(nn.Cell):
    """``(range, master) -> the whole parameter``; the backward gives ``master`` (fp32) this rank's range of the
    mean gradient and the half-precision range none."""

    def __init__(self, shard):
        super().__init__()
        self.param_range = shard

    def construct(self, owned_range, master):
        return self.param_range.gather(owned_range)

    def bprop(self, owned_range, master, out, dout):
        return ops.zeros_like(owned_range), self.param_range.scatter(dout).astype(master.dtype)


def seamed_names(model) -> set:
    """The names of ``model``'s parameters read through a seam (model/weights.py)."""
    return set(seams(model))


def held_ranges(model) -> dict:
    """``{name: ShardSpec}`` of ``model``'s parameters held as ranges (ZeRO-3), for an optimizer built again
    (a DSA stage change): their own shape is now their range's."""
    return dict(getattr(model, "held_range_specs", {}))


def install(model, optimizer, collectives=None) -> int:
    """Replace the seams of the parameters ``optimizer`` reduces in the backward (``optimizer.stage`` 2 or 3) and,
    at stage 3, shrink each of them to its range (the same Parameter object, so every holder sees it). Call after
    everything that reads the parameters' whole shapes was built, and again for an optimizer built anew; returns
    the number of seams replaced."""
    from mindmoe.train.parallel.zero import ParamRange

    found = seams(model)
    held = held_ranges(model)
    replaced = 0
    for i, param in enumerate(optimizer.parameters):
        if not optimizer.in_backward[i]:
            continue
        cell, attribute = found[param.name]
        shard = ParamRange(optimizer.specs[i], collectives)
        if optimizer.stage == 2:
            setattr(cell, attribute, ToOwnedRange(_RangeGradient(shard), optimizer.ranges[i]))
        else:
            # fp32 weights are their own masters; half-precision ones have theirs in the optimizer.
            if optimizer.local[i]:
                seam = GatherRange(shard)
            else:
                seam = ToOwnedRange(_GatheredToMaster(shard), optimizer.ranges[i])
            setattr(cell, attribute, seam)
            optimizer.shrink(i)
            held[param.name] = optimizer.specs[i]
        replaced += 1
    model.held_range_specs = held
    return replaced


def shard_state(model, optimizer, previous=None) -> None:
    """What the trainer does once an optimizer is built and the step's functions traced nothing yet: ZeRO-2/3 seams
    and ranges (:func:`install`), then half-precision weights: the masters of ``previous`` (the optimizer this one
    replaces, at a DSA stage change) carried over by name, and the weights cast to their storage dtype."""
    if getattr(optimizer, "stage", 0) >= 2:
        install(model, optimizer)
    if getattr(optimizer, "masters", None) is None:
        return
    if previous is not None and getattr(previous, "masters", None) is not None:
        carried = {param.name: master for param, master in zip(previous.parameters, previous.ranges)}
        for param, master in zip(optimizer.parameters, optimizer.ranges):
            if param.name in carried and carried[param.name].shape == master.shape:
                master.set_data(carried[param.name].value())
    optimizer.store_half()
