"""Building a model whose weights a checkpoint will provide: parameters as shapes and dtypes only.

Inside :func:`checkpoint_weights` the initial values of the weights are neither drawn nor allocated:
:func:`model.linear.normal_init` and the constant initialisers (norm scales, biases) return
MindSpore's deferred tensors, and MindSpore 2.9's ``no_init_parameters`` keeps the parameters built
from them uninitialised (``Parameter.has_init``). A loader then gives each parameter its storage
(``set_data`` of a tensor sharing the loaded buffer), so a process holds each weight once, in its
own dtype. :func:`finish_deferred` initialises what the checkpoint did not provide: the constants
with their value; a random weight left unloaded is an error, never a silent random base weight.

Parameters built from eager tensors (LoRA adapters, which draw from their own generator, and the
router's correction bias) are initialised as usual inside the context.
"""

from contextlib import ExitStack, contextmanager

import mindspore as ms
import numpy as np
from mindspore import Tensor
from mindspore.common.initializer import Constant, Initializer, initializer

_depth = 0  # nesting of checkpoint_weights (MindSpore's switch is one class attribute, entered once)


class CheckpointProvided(Initializer):
    """The initializer of a random weight whose value comes from a checkpoint: materialising one is a bug."""

    def _initialize(self, arr):
        raise RuntimeError(
            "a weight built for a checkpoint was used before the checkpoint provided it "
            "(model.deferred_init.finish_deferred names the parameters)"
        )


@contextmanager
def checkpoint_weights():
    """Build the model inside: its weights get values only from the checkpoint loaded next."""
    global _depth
    with ExitStack() as stack:
        if _depth == 0:
            from mindspore.nn.utils import no_init_parameters

            stack.enter_context(no_init_parameters())
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1


def deferring() -> bool:
    """True while a model is built inside :func:`checkpoint_weights`."""
    return _depth > 0


def provided(shape, dtype=ms.float32) -> Tensor:
    """A deferred tensor for a random weight the checkpoint provides."""
    return initializer(CheckpointProvided(), tuple(shape), dtype)


def constant(shape, value: float, dtype=ms.float32) -> Tensor:
    """``value`` everywhere; deferred (and still ``value`` if no checkpoint provides it) while :func:`deferring`."""
    if deferring():
        return initializer(Constant(value), tuple(shape), dtype)
    return Tensor(np.full(tuple(shape), value, np.float32), dtype=dtype)


def rows_of(deferred: Tensor, rows: range) -> Tensor:
    """Rows ``rows`` of a deferred ``[E, ...]`` tensor, still deferred (nothing of the other rows exists)."""
    return initializer(deferred.init, (len(rows), *deferred.shape[1:]), deferred.dtype)


def is_deferred(tensor) -> bool:
    return isinstance(tensor, Tensor) and tensor.has_init


def finish_deferred(model) -> None:
    """Initialise the constants no checkpoint provided; raise naming any random weight still unloaded."""
    unloaded = []
    for param in model.get_parameters():
        if not param.has_init:
            continue
        if isinstance(getattr(param.init_mode, "init", None), CheckpointProvided):
            unloaded.append(param.name)
        else:
            param.init_data()
    if unloaded:
        raise RuntimeError(
            f"{len(unloaded)} weights were built for a checkpoint that did not provide them: "
            f"{', '.join(unloaded[:10])}{' ...' if len(unloaded) > 10 else ''}"
        )
