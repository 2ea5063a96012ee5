"""Greedy decoding as the serving tests check it: a reference that recomputes the whole sequence at every step, and
the exported decode graph fed the same tokens one step at a time."""

import numpy as np
from mindspore import Tensor


def greedy_by_recompute(last_logits, ids: np.ndarray, steps: int):
    """``(sequence [B, S + steps], [logits [B, V] of each step])``: greedy decoding where ``last_logits(sequence)``
    recomputes the last position's logits from the whole sequence (no cache)."""
    sequence, step_logits = ids, []
    for _ in range(steps):
        logits = last_logits(sequence)
        step_logits.append(logits)
        sequence = np.concatenate([sequence, logits.argmax(-1).astype(np.int32)[:, None]], 1)
    return sequence, step_logits


def assert_decode_steps_match(exported, ids: np.ndarray, sequence: np.ndarray, expected_logits: list, atol: float):
    """Prefill ``ids``, then decode ``sequence``'s next tokens one at a time into a cache padded to the capacity;
    every step's logits (prefill's first) within ``atol`` of ``expected_logits``. Returns the last cache."""
    steps = len(expected_logits)
    logits, cache = exported.prefill(Tensor(ids))[:2]
    capacity = ids.shape[1] + steps
    padding = [(0, 0)] * cache.ndim
    padding[exported.cache_length_axis] = (0, capacity - ids.shape[1])
    cache = Tensor(np.pad(cache.asnumpy(), padding))
    np.testing.assert_allclose(logits.asnumpy(), expected_logits[0], rtol=0, atol=atol)
    for step in range(1, steps):
        position = ids.shape[1] + step - 1
        logits, cache = exported.decode(
            Tensor(sequence[:, position : position + 1]), cache, Tensor(np.full(ids.shape[0], position, np.int32))
        )
        np.testing.assert_allclose(logits.asnumpy(), expected_logits[step], rtol=0, atol=atol, err_msg=f"{step=}")
    return cache
