"""The CPU tokens-to-tokens expert kernel (``kernels.token_experts``) against a per-token PyTorch autograd transcription
of the routed SwiGLU experts with LoRA adapters (PEFT's ``x W^T + scaling * B(A(dropout(x)))``), the adapters'
dropout masks, a share of the experts and gradient isolation's per-token weight-gradient scale."""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Parameter, Tensor, nn, ops

from mindmoe.model import kernels
from mindmoe.model.kernels.cpu_token_experts import ProjectionSpec, expert_order
from mindmoe.model.kernels.dropout_mask import host_scaled_keep
from mindmoe.model.lora.dropout import drop_threshold
from mindmoe.model.moe.dispatch import grouped_rows

T, H, WIDTH, E, K, R, SCALING, P = 10, 16, 24, 6, 2, 4, 2.0, 0.3
PROJ_SHAPES = {"gate_proj": (WIDTH, H), "up_proj": (WIDTH, H), "down_proj": (H, WIDTH)}


def scaled_grad(value, scale):
    """``value`` forward; its gradient scaled by ``scale`` (the per-row weight-gradient scale)."""
    return value.detach() + scale * (value - value.detach())


def torch_reference(x, topk, rows, weight, scale, arrays, masks, first, held, trainable):
    """``(y, grads)`` per token: sum over its choices of weight * expert(x_t) for the held experts."""
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(weight, requires_grad=True)
    params = {name: torch.tensor(a.astype(np.float32), requires_grad=True) for name, a in arrays.items()}
    y = []
    for t in range(T):
        acc = torch.zeros(H)
        for k in range(K):
            g = int(topk[t, k])
            if not first <= g < first + held:
                continue
            e, z, s = g - first, int(rows[t * K + k]), float(scale[t])

            def project(proj, inp, e=e, z=z, s=s):
                w = params[proj][e]
                out = inp @ (scaled_grad(w, s) if trainable else w.detach()).T
                a, b = scaled_grad(params[proj + ".A"][e], s), scaled_grad(params[proj + ".B"][e], s)
                dropped = inp * torch.tensor(masks[proj][z])
                return out + SCALING * ((dropped @ a.T) @ b.T)

            h = torch.nn.functional.silu(project("gate_proj", xt[t])) * project("up_proj", xt[t])
            acc = acc + wt[t, k] * project("down_proj", h)
        y.append(acc)
    y = torch.stack(y)
    upstream = torch.tensor(np.random.default_rng(5).standard_normal((T, H)).astype(np.float32))
    (y * upstream).sum().backward()
    grads = {name: p.grad.numpy() for name, p in params.items() if p.grad is not None}
    return y.detach().numpy(), upstream.numpy(), xt.grad.numpy(), wt.grad.numpy(), grads


class Wrapped(nn.Cell):
    def __init__(self, kernel, weights, trainable):
        super().__init__()
        self.kernel = kernel
        self.trainable = trainable
        self.gate_proj, self.up_proj, self.down_proj = weights

    def construct(self, x, topk, row, sources, weight, scale, ga, gb, gz, gf, ua, ub, uz, uf, da, db, dz, df, upstream):
        placeholder = ops.zeros((1,), ms.float32)
        gw = self.gate_proj if self.trainable else placeholder
        uw = self.up_proj if self.trainable else placeholder
        dw = self.down_proj if self.trainable else placeholder
        y = self.kernel(
            x, topk, row, sources, weight, scale, gw, ga, gb, gz, gf, uw, ua, ub, uz, uf, dw, da, db, dz, df
        )
        return (y * upstream).sum()


@pytest.mark.parametrize(
    "first,held,trainable,base_dtype",
    [(0, E, False, np.float16), (2, 3, False, np.float32), (3, 3, True, np.float32)],
    ids=["all-experts-fp16-frozen", "share-frozen", "share-trainable"],
)
def test_token_experts_match_torch(first, held, trainable, base_dtype):
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, H)).astype(np.float32)
    topk = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    weight = rng.random((T, K)).astype(np.float32)
    scale = np.where(rng.random(T) < 0.3, 0.25, 1.0).astype(np.float32)
    # Each assignment's row in the grouped path's sorted buffer (its MindSpore ops), which keys its dropout masks.
    block = 2
    rows, _, num_rows = grouped_rows(Tensor(topk), E, block)
    rows = rows.asnumpy()
    arrays, factors, masks = {}, {}, {}
    threshold, keep_scale = drop_threshold(P), 1.0 / (1.0 - P)
    for proj, (out_f, in_f) in PROJ_SHAPES.items():
        arrays[proj] = (rng.standard_normal((held, out_f, in_f)) * 0.2).astype(base_dtype)
        arrays[proj + ".A"] = (rng.standard_normal((held, R, in_f)) * 0.3).astype(np.float32)
        arrays[proj + ".B"] = (rng.standard_normal((held, out_f, R)) * 0.3).astype(np.float32)
        row_Z = (rng.integers(-(2**31), 2**31, num_rows, dtype=np.int64) | 1).astype(np.int32)
        col_F = (rng.integers(-(2**31), 2**31, in_f, dtype=np.int64) | 1).astype(np.int32)
        factors[proj] = (row_Z, col_F)
        masks[proj] = host_scaled_keep(row_Z, col_F, threshold, keep_scale)
    assert 0.5 < np.mean([m.mean() for m in masks.values()]) < 1.5  # some dropped, the rest scaled

    weights = [Parameter(Tensor(arrays[p]), name=p, requires_grad=trainable) for p in PROJ_SHAPES]
    specs = [
        ProjectionSpec(
            frozen_weight=None if trainable else w, trainable=trainable, lora=True, dropout=(threshold, keep_scale)
        )
        for w in weights
    ]
    shapes = [(arrays[p].shape, arrays[p + ".A"].shape, arrays[p + ".B"].shape) for p in PROJ_SHAPES]
    kernel = kernels.token_experts(specs, shapes, SCALING, E, first, held, K, device_target="CPU")
    net = Wrapped(kernel, weights, trainable)
    y_ref, upstream, dx_ref, dw_ref, grads_ref = torch_reference(
        x, topk, rows, weight, scale, arrays, masks, first, held, trainable
    )
    sources = Tensor(np.array([1], np.int32))
    inputs = [Tensor(x), Tensor(topk), Tensor(rows), sources, Tensor(weight), Tensor(scale)]
    for proj in PROJ_SHAPES:
        inputs += [Tensor(arrays[proj + ".A"]), Tensor(arrays[proj + ".B"])]
        inputs += [Tensor(factors[proj][0]), Tensor(factors[proj][1])]
    inputs.append(Tensor(upstream))
    positions = (0, 4) + tuple(range(6, 18))
    loss, (input_grads, param_grads) = ms.value_and_grad(net, grad_position=positions, weights=net.trainable_params())(
        *inputs
    )
    np.testing.assert_allclose(float(loss.asnumpy()), float((y_ref * upstream).sum()), rtol=2e-5)
    np.testing.assert_allclose(input_grads[0].asnumpy(), dx_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(input_grads[1].asnumpy(), dw_ref, rtol=1e-4, atol=1e-5)
    for i, proj in enumerate(PROJ_SHAPES):
        got_A, got_B = input_grads[2 + 4 * i], input_grads[3 + 4 * i]
        np.testing.assert_allclose(got_A.asnumpy(), grads_ref[proj + ".A"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got_B.asnumpy(), grads_ref[proj + ".B"], rtol=1e-4, atol=1e-5)
        assert not input_grads[4 + 4 * i].asnumpy().any()  # the dropout factors get none
    if trainable:
        for proj, grad in zip(PROJ_SHAPES, param_grads):
            np.testing.assert_allclose(grad.asnumpy(), grads_ref[proj], rtol=1e-4, atol=1e-5)
        assert len(param_grads) == 3


def test_the_kernels_order_is_the_grouped_rows_order():
    """The kernel orders the assignments by their grouped rows (an input): by expert, token order within an expert."""
    rng = np.random.default_rng(3)
    topk = np.stack([rng.choice(E, K, replace=False) for _ in range(40)]).astype(np.int32)
    for block in (1, 4):
        rows, _, _ = grouped_rows(Tensor(topk), E, block)
        expert_A, order, counts = expert_order(topk, rows.asnumpy(), E)
        np.testing.assert_array_equal(order, np.argsort(topk.reshape(-1), kind="stable"))
        np.testing.assert_array_equal(counts, np.bincount(topk.reshape(-1), minlength=E))


def sorted_rows(topk, num_experts):
    """Each assignment's row in the expert-sorted buffer of block 1 (the grouped path's MindSpore ops)."""
    return grouped_rows(Tensor(topk), num_experts, 1)[0].asnumpy()


def test_token_experts_is_none_on_ascend():
    """Ascend keeps the grouped path (GroupedMatmul): there is no tokens-to-tokens kernel there."""
    assert kernels.token_experts([], [], 1.0, E, 0, E, K, device_target="Ascend") is None


def host_projections(rng, experts):
    """``rows -> [Projection]`` (gate, up, down: trainable, with adapters, no dropout) over random weights of
    ``experts`` experts, for the host kernel's NumPy functions; ``rows`` selects the experts a rank holds."""
    from mindmoe.model.kernels.cpu_token_experts import Projection

    arrays = {}
    for proj, (out_f, in_f) in PROJ_SHAPES.items():
        arrays[proj] = (rng.standard_normal((experts, out_f, in_f)) * 0.2).astype(np.float32)
        arrays[proj + ".A"] = (rng.standard_normal((experts, R, in_f)) * 0.3).astype(np.float32)
        arrays[proj + ".B"] = (rng.standard_normal((experts, out_f, R)) * 0.3).astype(np.float32)
    none = np.zeros(1, np.int32)

    def projections(rows=slice(None)):
        spec = ProjectionSpec(trainable=True, lora=True)
        return [
            Projection(spec, arrays[p][rows], arrays[p + ".A"][rows], arrays[p + ".B"][rows], none, none, SCALING)
            for p in PROJ_SHAPES
        ]

    return projections


def test_each_source_ranks_tokens_are_multiplied_apart_as_their_own_micro_batch_would_be():
    """An expert group's gathered tokens (``sources`` equal blocks, one per rank): every product and gradient is
    bit for bit what running each block alone gives, the weight and adapter gradients the blocks' sum in rank order
    (what one process accumulating the ranks' micro-batches computes)."""
    from mindmoe.model.kernels.cpu_token_experts import token_experts_backward, token_experts_forward

    rng = np.random.default_rng(11)
    tokens, held, first = 24, 4, 2
    projections = host_projections(rng, held)()
    blocks = []
    for _ in range(2):
        x = rng.standard_normal((tokens, H)).astype(np.float32)
        topk = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32)
        weight = rng.random((tokens, K)).astype(np.float32)
        dy = rng.standard_normal((tokens, H)).astype(np.float32)
        blocks.append((x, topk, weight, dy, np.ones(tokens, np.float32)))

    def run(x, topk, weight, dy, scale, sources):
        row_A = sorted_rows(topk, E)
        y, saved = token_experts_forward(x, topk, row_A, weight, projections, E, first, held, sources)
        return (y, *token_experts_backward(dy, scale, x, topk, row_A, weight, projections, saved))

    alone = [run(*block, sources=1) for block in blocks]
    together = run(*(np.concatenate(parts) for parts in zip(*blocks)), sources=2)
    for got, *parts in zip(together[:3], *(result[:3] for result in alone)):  # y, dx, d(combine weight)
        assert got.tobytes() == np.concatenate(parts).tobytes()
    for got, first_block, second_block in zip(together[3], alone[0][3], alone[1][3]):
        assert sorted(got) == ["lora_A", "lora_B", "weight"]
        for name in got:
            assert got[name].tobytes() == (first_block[name] + second_block[name]).tobytes(), name
    with pytest.raises(ValueError, match="25 tokens do not split into 2"):
        run(*(part[:25] for part in (np.concatenate(parts) for parts in zip(*blocks))), sources=2)


def test_a_tokens_expert_outputs_add_up_to_the_same_bits_whichever_ranks_hold_the_experts():
    """Top-4 of 8 experts: the float64 partial sums of two ranks holding 4 experts each, added in either order and
    rounded once, are bit for bit the one process's ``y`` and input gradient (float32 partial sums are not)."""
    from mindmoe.model.kernels.cpu_token_experts import token_experts_backward, token_experts_forward

    rng = np.random.default_rng(5)
    tokens, experts, top_k = 64, 8, 4
    all_projections = host_projections(rng, experts)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    topk = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weight = rng.random((tokens, top_k)).astype(np.float32)
    dy = rng.standard_normal((tokens, H)).astype(np.float32)

    def run(first, held, dtype):
        projections = all_projections(slice(first, first + held))
        row_A = sorted_rows(topk, experts)
        y, saved = token_experts_forward(x, topk, row_A, weight, projections, experts, first, held)
        dx = token_experts_backward(dy, np.ones(tokens, np.float32), x, topk, row_A, weight, projections, saved)[0]
        return y.astype(dtype), dx.astype(dtype)

    whole = [part.astype(np.float32) for part in run(0, experts, np.float64)]
    halves = run(0, 4, np.float64), run(4, 4, np.float64)
    for i in range(2):  # y, dx
        for order in ((0, 1), (1, 0)):
            total = (halves[order[0]][i] + halves[order[1]][i]).astype(np.float32)
            assert total.tobytes() == whole[i].tobytes(), (i, order)
    rounded = run(0, 4, np.float32)[0] + run(4, 4, np.float32)[0]
    assert rounded.tobytes() != whole[0].tobytes()  # each rank rounding its own sum first
