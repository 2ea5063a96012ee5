"""Releasing the compiled graphs of a phase that is over, so the next phase's graph reuses their memory.

A compiled MindSpore graph keeps host memory for as long as it is cached (measured on CPU: its kernels'
buffers, a ``pyfunc`` kernel's copies of its inputs, the memory pool it filled), and deleting the Python
function that compiled it frees nothing. ``mindspore.ms_memory_recycle`` drops every cached graph and
returns their memory to the process (not a ``pyfunc`` kernel's copies of its inputs: a 64 MiB input's copy
survived it, measured); a function called again afterwards compiles again. The trainer calls
it where the cached graphs will not run again soon: after a LoRA run's base validation when no validation
comes before the last step (the evaluation graph is compiled again for the final one), and after the last
training step, before the final validation. The graphs' memory pool is then reused rather than added to
(about a third of a GLM-4.5-Air-shaped LoRA run's peak, measured before the host kernels read frozen weights
in place); the evaluation graph's host-kernel copies of its inputs stay beside the training graph's.
"""

import gc

import mindspore as ms

# ``ms_memory_recycle`` walks MindSpore's dict of the cells' compile caches while it frees their graphs; a cell
# that a freed graph held last dies then and its ``__del__`` removes its entry: "dictionary changed size during
# iteration" (MindSpore 2.9, seen when a process had built many models). The entries it got through are cleared,
# so calling it again goes on from there; each retry is owed to one more dead cell.
_CHANGED_SIZE = "dictionary changed size during iteration"
_MAX_RETRIES = 1000


def release_compiled_graphs() -> None:
    """Drop every compiled graph of this process and recycle its memory (the next call of a compiled
    function compiles it again)."""
    gc.collect()  # cells already unreachable leave the dict first
    for _ in range(_MAX_RETRIES):
        try:
            ms.ms_memory_recycle()
            return
        except RuntimeError as err:
            if _CHANGED_SIZE not in str(err):
                raise
    ms.ms_memory_recycle()


def validates_before_last_step(eval_every: int, start_step: int, max_steps: int) -> bool:
    """Whether steps ``start_step + 1 .. max_steps - 1`` include a validation (every ``eval_every`` steps)."""
    if not eval_every:
        return False
    first = (start_step // eval_every + 1) * eval_every
    return first < max_steps
