"""The host kernels' threads (``model/kernels/host_threads.py``): whole experts per thread, NumPy's BLAS on one
thread inside, and the token-experts kernel's results the same bits whatever the thread count."""

import numpy as np
import pytest
from mindspore import Tensor
from threadpoolctl import threadpool_info

from mindmoe.model.kernels import host_threads
from mindmoe.model.kernels.cpu_token_experts import token_experts_backward, token_experts_forward
from mindmoe.model.moe.dispatch import grouped_rows
from tests.unit.test_token_experts import host_projections


def test_split_keeps_each_experts_items_together_in_order_and_balances_rows():
    items = [(e, i, rows) for i, (e, rows) in enumerate([(0, 5), (1, 40), (0, 7), (2, 30), (3, 10), (1, 2), (4, 1)])]
    parts = host_threads.split_by_expert(items, lambda item: item[2], 2)
    assert sorted(item for part in parts for item in part) == sorted(items)
    for part in parts:
        for e in {item[0] for item in part}:
            mine = [item for item in part if item[0] == e]
            assert mine == [item for item in items if item[0] == e]  # every item of e, in the input's order
    # Largest expert first onto the lighter list: 42 | 30, +12 -> 42 | 42, +10 -> 52 | 42, +1 -> 52 | 43.
    assert [sum(item[2] for item in part) for part in parts] == [52, 43]
    assert host_threads.split_by_expert(items[:1], lambda item: item[2], 4) == [items[:1]]  # no empty parts
    assert host_threads.split_by_expert([], lambda item: item[2], 2) == []


@pytest.mark.parametrize("threads", [1, 2])
def test_each_part_runs_with_blas_on_one_thread(monkeypatch, threads):
    monkeypatch.setattr(host_threads, "host_threads", lambda: threads)

    def blas_threads(part):
        return blas_thread_counts()

    items = [(e, None) for e in range(4)]
    results = host_threads.map_experts(blas_threads, items, lambda item: 1)
    assert len(results) == threads
    assert all(counts == {1} for counts in results)


def blas_thread_counts():
    """Thread counts of NumPy's BLAS (other libraries, e.g. torch's, are not the kernels')."""
    return {
        info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas" and "numpy" in info["filepath"]
    }


def test_blas_stays_on_one_thread_until_the_last_kernel_leaves():
    """Two kernels the runtime started at once: the first to finish must not give BLAS its threads back under the
    other."""
    before = blas_thread_counts()
    outer = host_threads.one_blas_thread()
    outer.__enter__()
    with host_threads.one_blas_thread():
        assert blas_thread_counts() == {1}
    assert blas_thread_counts() == {1}
    outer.__exit__(None, None, None)
    assert blas_thread_counts() == before


def test_token_experts_give_the_same_bits_on_one_two_or_three_threads(monkeypatch):
    """Every expert's products, its weight gradients (three source blocks added in order) and each token's float64 sums
    of the experts' outputs and input gradients do not depend on how the experts are split over threads."""
    rng = np.random.default_rng(3)
    tokens, experts, top_k, first, held, sources = 96, 8, 2, 1, 6, 3
    projections = host_projections(rng, experts)(slice(first, first + held))
    x = rng.standard_normal((tokens, 16)).astype(np.float32)
    topk = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weight = rng.random((tokens, top_k)).astype(np.float32)
    dy = rng.standard_normal((tokens, 16)).astype(np.float32)
    scale = np.where(rng.random(tokens) < 0.3, 0.5, 1.0).astype(np.float32)

    def run(threads):
        monkeypatch.setattr(host_threads, "host_threads", lambda: threads)
        row_A = grouped_rows(Tensor(topk), experts, 1)[0].asnumpy()
        y, saved = token_experts_forward(x, topk, row_A, weight, projections, experts, first, held, sources)
        dx, dw, grads = token_experts_backward(dy, scale, x, topk, row_A, weight, projections, saved)
        return [y, dx, dw] + [grads[i][name] for i in range(3) for name in ("weight", "lora_A", "lora_B")]

    one = run(1)
    assert any(part.any() for part in one)
    for threads in (2, 3):
        for got, expected in zip(run(threads), one):
            assert got.tobytes() == expected.tobytes(), threads
