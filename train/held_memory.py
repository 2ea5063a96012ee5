"""The bytes a rank holds in Parameters, by kind: the ``held_bytes`` row every run writes to ``metrics.jsonl``
before its first step (``{"step": <the step it starts after>, "held_bytes": {"weights", "gradients",
"optimizer"}}``).

``weights``: the model's Parameters (trained or not; ZeRO-3: this rank's ranges); ``gradients``: the buffers that
accumulate gradients across micro-batches (none without accumulation: a step's gradients are transient tensors of
its graph, which the peak memory counts and this does not); ``optimizer``: every other Parameter of the optimizer
and the step (AdamW moments, ZeRO working copies or masters, the step counter, loss-scale state).
"""

import logging
import math

log = logging.getLogger("mindmoe.train")

GIB = 1024**3


def parameter_bytes(param) -> int:
    return math.prod(param.shape) * param.itemsize


def held_bytes(model, compiled_step) -> dict:
    """``{"weights", "gradients", "optimizer"}`` bytes of this rank's Parameters (module docstring), of ``model``
    and its :class:`train.step.CompiledStep`."""
    optimizer, grad_buffers, step_state = (
        compiled_step.optimizer,
        compiled_step.grad_buffers,
        compiled_step.loss_scale_state,
    )
    weights = list(model.get_parameters())
    seen = {id(p) for p in weights}
    buffers = list(grad_buffers or ())
    seen.update(id(b) for b in buffers)
    state = [p for p in [*optimizer.get_parameters(), *step_state] if id(p) not in seen]
    unique = {id(p): p for p in state}
    return {
        "weights": sum(parameter_bytes(p) for p in weights),
        "gradients": sum(parameter_bytes(b) for b in buffers),
        "optimizer": sum(parameter_bytes(p) for p in unique.values()),
    }


def describe(held: dict) -> str:
    parts = ", ".join(f"{kind} {held[kind] / GIB:.3f}" for kind in ("weights", "gradients", "optimizer"))
    return f"held by rank 0 (GiB): {parts}; total {sum(held.values()) / GIB:.3f}"
