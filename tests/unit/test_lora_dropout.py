"""LoRA dropout masks keyed by (seed, parameter name, data-parallel rank, draws so far), against a NumPy
transcription of the hash in :mod:`model.lora.dropout`: the forward and the adapter gradients of a
compiled train step use the documented mask, a fresh layer set to a saved draw count continues the same
masks (what a resumed run does), and masks stay off in evaluation."""

import zlib

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from mindmoe.model import kernels
from mindmoe.model.config import ModelConfig
from mindmoe.model.lora import LoraConfig
from mindmoe.model.lora.dropout import (
    DropoutStream,
    drop_threshold,
    dropout_draws,
    dropout_streams,
    set_dropout_state,
)
from mindmoe.model.lora.layers import AdapterSpec, LoraLinear
from mindmoe.model.lora.plan import plan_adapters
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.transformer import MoETransformer

ROWS, IN, OUT, RANK, P, SCALING = 6, 40, 7, 3, 0.3, 2.0


U32 = np.uint64(0xFFFFFFFF)
SIGN = np.uint64(0x80000000)


def np_mix32(x):
    """lowbias32 on uint32 values, computed in uint64 and masked to 32 bits."""
    x = np.asarray(x, np.uint64) & U32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & U32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & U32
    x ^= x >> np.uint64(16)
    return x


def np_factors(rows, cols, seed, name, rank, draws):
    """The odd row and column factors of one draw (uint64 products wrap mod 2**64, a multiple of 2**32)."""
    salt = np.uint64(zlib.crc32(f"{seed}:{name}".encode()))
    key = np_mix32(np_mix32(np_mix32(draws) ^ np.uint64(rank)) ^ salt)
    row = np_mix32(np.arange(rows, dtype=np.uint64) ^ key) | np.uint64(1)
    col = np_mix32(np.arange(cols, dtype=np.uint64) ^ key ^ SIGN) | np.uint64(1)
    return row, col


def np_drops(h, p):
    """Drop where ``h * h + h`` (mod 2**32), read as a signed int32, is below round(p * 2**31) * 2 - 2**31."""
    g = (h * h + h) & U32
    return (g ^ SIGN) < np.uint64(round(p * 2**31) * 2)


def np_keep(rows, cols, p, seed, name, rank, draws):
    row, col = np_factors(rows, cols, seed, name, rank, draws)
    return ~np_drops((row[:, None] * col[None, :]) & U32, p)


def make_layer(seed=11, name="layers.0.self_attn.q_proj"):
    rng = np.random.default_rng(seed)
    layer = LoraLinear(IN, OUT, True, 0.5, rng, AdapterSpec(RANK, SCALING, P, rng), name)
    layer.lora_B.set_data(Tensor(rng.normal(size=(OUT, RANK)).astype(np.float32)))
    return layer


def train_step(layer):
    """``(y, d lora_A, d lora_B)`` of ``sum(y * G)`` through a compiled value_and_grad (as the train step)."""

    class Weighted(nn.Cell):
        def __init__(self, inner, weight):
            super().__init__()
            self.inner, self.weight = inner, weight

        def construct(self, x):
            return (self.inner(x) * self.weight).sum()

    weight = Tensor(np.random.default_rng(5).normal(size=(ROWS, OUT)).astype(np.float32))
    grad_fn = ms.value_and_grad(Weighted(layer, weight), None, (layer.lora_A, layer.lora_B))

    @ms.jit
    def step(x):
        _, grads = grad_fn(x)
        return layer(x), grads  # a second forward: one more draw

    return step, weight.asnumpy()


def test_train_step_uses_the_documented_mask_in_forward_and_gradients_and_draws_once_per_forward():
    layer = make_layer()
    layer.set_train(True)
    x = np.random.default_rng(3).normal(size=(ROWS, IN)).astype(np.float32)
    step, weight = train_step(layer)
    w, b = layer.weight.asnumpy(), layer.bias.asnumpy()
    lora_A, lora_B = layer.lora_A.asnumpy(), layer.lora_B.asnumpy()
    for call in range(3):
        y, (grad_A, grad_B) = step(Tensor(x))
        # The gradient's forward is draw 2 * call, the returned forward draw 2 * call + 1.
        for draw, check in ((2 * call, "grad"), (2 * call + 1, "y")):
            keep = np_keep(ROWS, IN, P, 11, "layers.0.self_attn.q_proj", 0, draw)
            x_drop = x * keep / (1 - P)
            low = x_drop @ lora_A.T
            if check == "y":
                expected = x @ w.T + b + SCALING * low @ lora_B.T
                np.testing.assert_allclose(y.asnumpy(), expected, rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_allclose(grad_B.asnumpy(), SCALING * weight.T @ low, rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(
                    grad_A.asnumpy(), SCALING * (weight @ lora_B).T @ x_drop, rtol=1e-4, atol=1e-5
                )
        assert dropout_draws(layer) == 2 * call + 2


def test_a_fresh_layer_set_to_the_saved_state_continues_the_masks_and_ranks_differ():
    x = np.random.default_rng(4).normal(size=(ROWS, IN)).astype(np.float32)

    @ms.jit
    def forward(cell, x):
        return cell(x)

    first = make_layer()
    first.set_train(True)
    outputs = [forward(first, Tensor(x)).asnumpy() for _ in range(3)]
    assert not np.allclose(outputs[1], outputs[2])
    resumed = make_layer()
    resumed.set_train(True)
    set_dropout_state(resumed, 0, 2)  # before its graph compiles, as the trainer does on resume
    np.testing.assert_array_equal(forward(resumed, Tensor(x)).asnumpy(), outputs[2])
    other_rank = make_layer()
    other_rank.set_train(True)
    set_dropout_state(other_rank, 1, 2)
    assert not np.allclose(forward(other_rank, Tensor(x)).asnumpy(), outputs[2])


def set_dropout_state_of(streams, rank, draws):
    for stream in streams:
        stream.rank.set_data(Tensor(np.int32(rank)))
        stream.draws.set_data(Tensor(np.int32(draws)))


def test_a_stream_drops_a_3d_input_by_the_documented_mask_at_any_rank_and_draw_count():
    """The routed experts' [E, C, F] inputs: rows are the flattened E * C; the layer tests use rank 0 and
    a few draws, so this one also covers keys built from a large count and another rank."""
    stream = DropoutStream("layers.1.mlp.experts.gate_proj", 7, 0.2)
    set_dropout_state_of([stream], rank=3, draws=123_456_789)

    @ms.jit
    def drop(x):
        return stream.drop(x)

    x = np.ones((4, 5, 24), np.float32)
    for draw in (123_456_789, 123_456_790):
        keep = np_keep(20, 24, 0.2, 7, "layers.1.mlp.experts.gate_proj", 3, draw).reshape(x.shape)
        np.testing.assert_array_equal(drop(Tensor(x)).asnumpy(), np.float32(keep * np.float32(1 / 0.8)))


def test_a_share_of_the_expert_buffer_is_dropped_as_those_rows_of_the_whole_buffer():
    """Under ``parallel.ep`` (allgather) a process runs experts 2..3 of an [E, C, F] buffer: its mask is those
    experts' rows of the one-process mask (the documented rows E * C), so both drop the same elements."""
    name = "layers.1.mlp.experts.up_proj"
    stream = DropoutStream(name, 7, 0.3)

    @ms.jit
    def drop_share(x):
        return stream.drop(x, 2 * 5)  # first held expert 2, C = 5

    share = drop_share(Tensor(np.ones((2, 5, 24), np.float32))).asnumpy()
    whole_keep = np_keep(4 * 5, 24, 0.3, 7, name, 0, 0).reshape(4, 5, 24)
    np.testing.assert_array_equal(share, np.float32(whole_keep[2:4] * np.float32(1 / 0.7)))
    assert not np.array_equal(whole_keep[2:4], whole_keep[0:2])  # the offset matters


def assert_independent(a, b, p):
    """Two independent masks agree with probability p^2 + (1-p)^2 (within 5 standard errors)."""
    expected = p * p + (1 - p) ** 2
    tolerance = 5 * np.sqrt(expected * (1 - expected) / a.size)
    assert abs((a == b).mean() - expected) < tolerance, ((a == b).mean(), expected)


def test_masks_keep_one_minus_p_and_are_independent_across_elements_draws_ranks_and_names():
    rows, cols = 2048, 512
    for p in (0.05, 0.5):
        mask = np_keep(rows, cols, p, 0, "a", 0, 0)
        assert abs(mask.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / mask.size)
        assert_independent(mask[1:], mask[:-1], p)  # neighbouring rows
        assert_independent(mask[:, 1:], mask[:, :-1], p)  # neighbouring features
        square, upper = mask[:cols, :cols], np.triu_indices(cols, 1)
        assert_independent(square[upper], square.T[upper], p)  # (z, f) vs (f, z): rows and columns hash apart
        # A 2x2 block of independent elements has an odd number of drops with probability (1 - (1-2p)^4) / 2.
        parity = mask[:-1, :-1] ^ mask[1:, :-1] ^ mask[:-1, 1:] ^ mask[1:, 1:]
        expected = (1 - (1 - 2 * p) ** 4) / 2
        assert abs(parity.mean() - expected) < 5 * np.sqrt(expected * (1 - expected) / parity.size)
        others = {
            "next draw": np_keep(rows, cols, p, 0, "a", 0, 1),
            "other rank": np_keep(rows, cols, p, 0, "a", 1, 0),
            "other projection": np_keep(rows, cols, p, 0, "b", 0, 0),
            "other seed": np_keep(rows, cols, p, 1, "a", 0, 0),
        }
        for other in others.values():
            assert_independent(mask, other, p)


def test_the_finaliser_drops_exactly_p_and_decorrelates_rows_whose_factors_have_a_small_ratio():
    # h -> h * h + h maps the odd values one-to-one onto the even ones (checked mod 2**20 exhaustively),
    # so a uniform odd product is dropped with probability exactly round(p * 2**31) / 2**31.
    odd = np.arange(1, 1 << 20, 2, dtype=np.uint64)
    assert np.array_equal(np.sort((odd * odd + odd) % (1 << 20)), np.arange(0, 1 << 20, 2, dtype=np.uint64))
    h = np.random.default_rng(0).integers(0, 1 << 32, size=1 << 20, dtype=np.uint64) | np.uint64(1)
    for p in (0.05, 0.5):
        for ratio in (3, 5, -1, -3):  # without the finaliser, ratio 3 drops alike 6.7x as often at p = 0.05
            assert_independent(np_drops(h, p), np_drops((h * np.uint64(ratio % (1 << 32))) & U32, p), p)


def test_evaluation_neither_drops_nor_draws():
    layer = make_layer()
    layer.set_train(False)
    x = np.random.default_rng(6).normal(size=(ROWS, IN)).astype(np.float32)

    @ms.jit
    def forward(x):
        return layer(x)

    expected = (
        x @ layer.weight.asnumpy().T
        + layer.bias.asnumpy()
        + SCALING * (x @ layer.lora_A.asnumpy().T) @ layer.lora_B.asnumpy().T
    )
    np.testing.assert_allclose(forward(Tensor(x)).asnumpy(), expected, rtol=1e-5, atol=1e-5)
    assert dropout_draws(layer) == 0


def test_every_adapted_projection_of_a_model_has_its_own_stream_outside_the_parameter_list():
    cfg = ModelConfig(
        vocab_size=48,
        hidden_size=16,
        num_layers=2,
        first_k_dense=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=24,
        num_experts=4,
        moe_intermediate_size=8,
        max_position_embeddings=32,
    )
    plan = plan_adapters(cfg, LoraConfig(enabled=True, r=2, dropout=0.1), seed=3)
    model = MoETransformer(cfg, seed=0, lora=plan)
    names = sorted(stream.name for stream in dropout_streams(model))
    assert names == sorted(name.removesuffix(".weight") for name in plan.adapted)
    assert "layers.1.mlp.experts.down_proj" in names
    assert not any("dropout" in p.name for p in model.get_parameters())
    model.set_train(True)
    ids = Tensor(np.random.default_rng(0).integers(0, 48, size=(2, 8)).astype(np.int32))
    docs = Tensor(np.zeros((2, 8), np.int32))

    @ms.jit
    def forward(ids, docs):
        return model(ids, docs)[OUT_HEAD]

    forward(ids, docs)
    forward(ids, docs)
    assert dropout_draws(model) == 2


def test_the_cpu_host_kernel_and_the_ascend_graph_ops_give_the_documented_mask_bits():
    """kernels.dropout_keep: CPU computes the mask on the host, Ascend with MindSpore ops (run here on CPU);
    both against the NumPy transcription of the finaliser, on factors covering every sign combination."""
    rng = np.random.default_rng(9)
    row = rng.integers(-(2**31), 2**31, size=300, dtype=np.int64).astype(np.int32) | 1
    col = rng.integers(-(2**31), 2**31, size=70, dtype=np.int64).astype(np.int32) | 1
    threshold, scale = drop_threshold(0.3), 1 / 0.7
    h = (row.astype(np.uint64)[:, None] & U32) * (col.astype(np.uint64)[None, :] & U32) & U32
    expected = np.where(np_drops(h, 0.3), np.float32(0), np.float32(scale))
    for device in ("CPU", "Ascend"):
        mask = ms.jit(kernels.dropout_keep(threshold, scale, device_target=device))
        np.testing.assert_array_equal(mask(Tensor(row), Tensor(col)).asnumpy(), expected, err_msg=device)
    assert 0.25 < (expected == 0).mean() < 0.35
