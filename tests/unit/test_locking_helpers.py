"""The one helper for top-K set equality and run lengths (used by locking, flip rate and the serving
lock state) vs Python sets and a per-token loop."""

import numpy as np
from mindspore import Tensor, nn

from mindmoe.model.moe.locking import run_lengths, same_expert_set, same_set_as_previous


class Helpers(nn.Cell):
    def construct(self, a_BSK, b_BSK, continues_BS, positions_BS):
        return same_expert_set(a_BSK, b_BSK), same_set_as_previous(a_BSK), run_lengths(continues_BS, positions_BS)


def test_set_equality_ignores_order_and_run_lengths_restart_where_a_run_breaks():
    rng = np.random.default_rng(0)
    batch, seq_len, top_k, experts = 3, 12, 2, 4
    a_BSK = np.stack(
        [np.stack([rng.permutation(experts)[:top_k] for _ in range(seq_len)]) for _ in range(batch)]
    ).astype(np.int32)
    # Half the rows of b hold a's experts in reverse order, the rest fresh draws.
    b_BSK = np.where(rng.random((batch, seq_len, 1)) < 0.5, a_BSK[..., ::-1], rng.integers(0, experts, a_BSK.shape))
    b_BSK = b_BSK.astype(np.int32)
    continues_BS = rng.random((batch, seq_len)) < 0.6
    continues_BS[:, 0] = False
    positions_BS = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()
    same, previous, runs = (
        out.asnumpy() for out in Helpers()(Tensor(a_BSK), Tensor(b_BSK), Tensor(continues_BS), Tensor(positions_BS))
    )

    expected_same = [[set(a_BSK[b, s]) == set(b_BSK[b, s]) for s in range(seq_len)] for b in range(batch)]
    np.testing.assert_array_equal(same, expected_same)
    expected_previous = [[set(a_BSK[b, s]) == set(a_BSK[b, s - 1]) for s in range(1, seq_len)] for b in range(batch)]
    np.testing.assert_array_equal(previous, expected_previous)
    expected_runs = np.ones((batch, seq_len), int)
    for b in range(batch):
        for s in range(1, seq_len):
            expected_runs[b, s] = expected_runs[b, s - 1] + 1 if continues_BS[b, s] else 1
    np.testing.assert_array_equal(runs, expected_runs)
