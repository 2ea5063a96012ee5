"""The global gradient norm of the train step (train.grad_norm) against NumPy."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from mindmoe.model import kernels
from mindmoe.train.grad_norm import squared_norm_of


@pytest.mark.parametrize("device", ["CPU", "GPU"])  # GPU: the kernel's formula, as it runs there
def test_the_global_norm_under_jit_matches_numpy_float64_for_any_rank(device):
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=shape).astype(np.float32) for shape in ((7,), (3, 4, 5), (1000, 33))]
    squared_norm = squared_norm_of(kernels.row_squares(device))

    @ms.jit
    def global_norm(a, b, c):
        return ops.sqrt(squared_norm((a, b, c)))

    @ms.jit
    def one_norm(g):
        return squared_norm((g,))

    squares = [float(one_norm(Tensor(a)).asnumpy()) for a in arrays]
    for array, square in zip(arrays, squares):
        np.testing.assert_allclose(square, np.sum(array.astype(np.float64) ** 2), rtol=1e-5)
    expected = np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in arrays))
    np.testing.assert_allclose(float(global_norm(*map(Tensor, arrays)).asnumpy()), expected, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["compiled", "formula"])
def test_the_norm_is_the_same_bits_whatever_share_of_the_experts_a_rank_holds(kernel, monkeypatch):
    """``layout_free_norm``: one process holding all 4 experts and each of 2 ranks holding 2 (its rows of every expert
    tensor, the other rank's row sums gathered) compute the same float32 norm, equal to NumPy's in float64."""
    from types import SimpleNamespace

    from mindmoe.train.grad_norm import expert_row_squares, layout_free_norm, piece_length

    if kernel == "formula":  # what GPU and Ascend run (and a CPU without a compiler)
        monkeypatch.setitem(kernels.CPU_KERNELS, "row_squares", kernels.FORMULA_KERNELS["row_squares"])
    squares = kernels.row_squares()
    rng = np.random.default_rng(1)
    shapes = {
        "norm": (7,),
        "experts.A": (4, 3, 4000),
        "proj": (30, 20),
        "experts.B": (4, 40, 3),
        "experts.W": (4, 6, 5),
    }
    grads = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    params = [SimpleNamespace(name=name, shape=shape) for name, shape in shapes.items()]
    experts = {name for name in shapes if name.startswith("experts.")}

    def norm(arrays, gather_rows=None, group_size=1):
        return ms.jit(layout_free_norm(params, experts, gather_rows, group_size))(tuple(map(Tensor, arrays)))

    whole = norm(list(grads.values())).asnumpy()
    expected = sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values())
    np.testing.assert_allclose(float(whole), expected, rtol=1e-6)

    def share(rank):
        return [g[2 * rank : 2 * rank + 2] if name in experts else g for name, g in grads.items()]

    pieces = [piece_length(int(np.prod(shapes[name][1:]))) for name in sorted(experts)]
    assert pieces == [4000, 120, 30]  # rows of 12,000 elements in 3 dot products
    assert piece_length(8128 * 512) == 4096 and piece_length(4099) == 1  # a prime row size: one element each

    @ms.jit
    def rows(a, b, w):
        return ops.stack([expert_row_squares(g, piece, squares) for g, piece in zip((a, b, w), pieces)])

    rank_rows = [rows(*(Tensor(grads[name][2 * r : 2 * r + 2]) for name in sorted(experts))) for r in (0, 1)]

    def gatherer(rank):
        def gather(rows_Pe):  # this rank's rows in its place among the group's (AllGather's rank order)
            return ops.concat([rows_Pe if r == rank else rank_rows[r] for r in (0, 1)])

        return gather

    for rank in (0, 1):
        assert norm(share(rank), gatherer(rank), 2).asnumpy().tobytes() == whole.tobytes(), rank
    # The dense layout (one MatMul per tensor) is what a model without experts keeps.
    assert layout_free_norm(params, set()).__name__ == "global_squared_norm"


def test_expert_parameter_names_are_the_routed_experts_and_their_adapters():
    from mindmoe.train.grad_norm import expert_parameter_names
    from mindmoe.train.init_model import build_model
    from tests.helpers.runs import compose_config

    cfg = compose_config(["lora.enabled=true", "lora.r=2", "moe.bias_update_rate=0", "model.mtp_layers=1"])
    _, model = build_model(cfg, vocab_size=64)
    names = expert_parameter_names(model)
    assert names == {p.name for p in model.get_parameters() if ".mlp.experts." in p.name}
    assert "layers.1.mlp.experts.up_proj.lora_B" in names and "mtp_layers.0.mlp.experts.down_proj" in names


def test_expert_shards_are_every_expert_tensor_with_its_first_row_and_a_whole_model_is_refused(monkeypatch):
    """The expert-parallel views take their tensors where the norm does: a placement holding the second half of the
    experts gives every expert tensor (MTP depth included) the first row E/2; the whole model raises."""
    from mindmoe.model.moe.token_dispatcher import ExpertPlacement
    from mindmoe.train.grad_norm import expert_parameter_names
    from mindmoe.train.init_model import build_model
    from mindmoe.train.lora_setup import held_expert_rows
    from mindmoe.train.parallel import expert_parallel
    from mindmoe.train.parallel.expert_parallel import expert_shards
    from tests.helpers.runs import compose_config

    class SecondHalf(ExpertPlacement):
        def held_experts(self, num_experts):
            return range(num_experts // 2, num_experts)

    overrides = ["lora.enabled=true", "lora.r=2", "moe.bias_update_rate=0", "model.mtp_layers=1"]
    cfg = compose_config(overrides)
    _, model = build_model(cfg, vocab_size=64, expert_dispatcher=SecondHalf())
    experts = cfg.model.num_experts
    # Its layers keep the local dispatcher: refused as before; taken once that dispatcher counts as expert-parallel.
    with pytest.raises(ValueError, match=r"parallel.ep=2: layers\.1\.mlp routes its tokens with a \w+, not an"):
        expert_shards(model, experts, 2)
    local = type(model.layers[1].mlp.routed.dispatcher)
    monkeypatch.setattr(
        expert_parallel, "EXPERT_PARALLEL_DISPATCHERS", (*expert_parallel.EXPERT_PARALLEL_DISPATCHERS, local)
    )
    shards = expert_shards(model, experts, 2)
    assert set(shards) == expert_parameter_names(model) and set(shards.values()) == {experts // 2}
    assert "mtp_layers.0.mlp.experts.gate_proj.lora_A" in shards
    assert held_expert_rows(model)["layers.1.mlp.experts.down_proj"] == range(experts // 2, experts)

    _, whole = build_model(cfg, vocab_size=64)
    with pytest.raises(ValueError, match=rf"parallel.ep=2: layers\.1\.mlp\.experts\.\w+ holds {experts} of {experts}"):
        expert_shards(whole, experts, 2)
