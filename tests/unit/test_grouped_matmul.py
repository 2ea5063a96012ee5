"""``kernels.grouped_matmul``: the CPU implementation against NumPy (values) and a torch transcription
(gradients), and the Ascend one against the MindSpore 2.9 op it calls (GroupedMatmul has no CPU kernel,
so only its existence and arguments are checked here)."""

import ast
import inspect
import re

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor

from mindmoe.model import kernels
from mindmoe.model.kernels import ascend, cpu_grouped

IN_FEATURES, OUT_FEATURES = 7, 5


def problem(group_blocks, block, padding_blocks, seed=0):
    """Sorted rows ``[N, b, F]`` whose groups have ``group_blocks[e] * b`` rows (each group's last rows
    zero, as the dispatcher pads them), ``padding_blocks`` zero blocks after the last group, whose output
    is never combined (zero upstream gradient)."""
    rng = np.random.default_rng(seed)
    sizes = np.array(group_blocks, np.int32) * block
    rows = int(sizes.sum()) + padding_blocks * block
    x = rng.normal(size=(rows, IN_FEATURES)).astype(np.float32)
    x[sizes.sum() :] = 0
    weight = rng.normal(size=(len(sizes), OUT_FEATURES, IN_FEATURES)).astype(np.float32)
    upstream = rng.normal(size=(rows, OUT_FEATURES)).astype(np.float32)
    upstream[sizes.sum() :] = 0
    scale = rng.uniform(0.1, 1.0, size=rows).astype(np.float32)
    return x, weight, sizes, upstream, scale


def np_grouped(x, weight, sizes):
    out = np.zeros((x.shape[0], weight.shape[1]), np.float64)
    start = 0
    for e, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size].astype(np.float64) @ weight[e].T
        start += size
    return out


def torch_grads(x, weight, sizes, upstream, scale):
    """``(dx, dweight)`` of ``sum(out * upstream)``; row r's weight-gradient term times ``scale_r``."""
    x_t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    w_t = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    up = torch.tensor(upstream, dtype=torch.float64)
    s = torch.tensor(scale, dtype=torch.float64).unsqueeze(1)
    start, loss = 0, 0.0
    for e, size in enumerate(sizes):
        rows = slice(start, start + int(size))
        # value x w^T, input gradient unscaled; weight gradient from the scaled upstream rows
        loss = loss + ((x_t[rows] @ w_t[e].detach().T) * up[rows]).sum()
        loss = loss + ((x_t[rows].detach() @ w_t[e].T) * up[rows] * s[rows]).sum()
        start += int(size)
    loss.backward()
    return x_t.grad.numpy(), w_t.grad.numpy()


def run(kernel, x, weight, sizes, upstream, block, scale=None):
    x_NbF = Tensor(x.reshape(-1, block, IN_FEATURES))
    extra = () if scale is None else (Tensor(scale.reshape(-1, block)),)

    def weighted(x_in, w_in):
        out = kernel(x_in, w_in, Tensor(sizes), *extra)
        return (out * Tensor(upstream.reshape(out.shape))).sum(), out

    (_, out), (dx, dw) = ms.jit(ms.value_and_grad(weighted, (0, 1), has_aux=True))(x_NbF, Tensor(weight))
    return out.asnumpy().reshape(-1, OUT_FEATURES), dx.asnumpy().reshape(x.shape), dw.asnumpy()


@pytest.mark.parametrize(
    "group_blocks,block,padding_blocks", [([2, 0, 3, 1], 4, 2), ([0, 0, 5], 2, 0), ([1, 2, 1, 1, 3], 1, 3)]
)
def test_cpu_grouped_matmul_matches_numpy_and_torch_gradients(group_blocks, block, padding_blocks, static_path):
    """Empty groups, all rows in one group, trailing padding blocks; then the row-scaled variant, whose weight
    gradient takes each row's share times its scale and whose input gradient is unscaled."""
    x, weight, sizes, upstream, scale = problem(group_blocks, block, padding_blocks)
    out, dx, dw = run(kernels.grouped_matmul("CPU"), x, weight, sizes, upstream, block)
    np.testing.assert_allclose(out, np_grouped(x, weight, sizes), rtol=1e-5, atol=1e-5)
    assert not out[sizes.sum() :].any()
    expected_dx, expected_dw = torch_grads(x, weight, sizes, upstream, np.ones_like(scale))
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-5, atol=1e-5)
    assert not dw[np.array(group_blocks) == 0].any()

    out_s, dx_s, dw_s = run(kernels.grouped_matmul_row_scaled("CPU"), x, weight, sizes, upstream, block, scale)
    _, expected_dw_s = torch_grads(x, weight, sizes, upstream, scale)
    np.testing.assert_allclose(out_s, out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx_s, dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw_s, expected_dw_s, rtol=1e-5, atol=1e-5)
    assert not np.allclose(dw_s, dw, rtol=1e-3)


@pytest.mark.parametrize("group_blocks,block", [([2, 1, 0, 3, 1], 4), ([0, 2, 2, 0], 2), ([3, 0, 1, 0], 1)])
def test_cpu_grouped_matmul_gives_zeros_for_the_groups_of_experts_held_elsewhere(group_blocks, block, static_path):
    """A share of the experts (``parallel.ep``): E weights with E + 2 groups, whose first and last are rows of
    experts held elsewhere. Their outputs and input gradients are zero, and every value and gradient equals
    the kernel's contract with zero weights for those two groups (the reference's padded weights)."""
    x, padded, sizes, upstream, scale = problem(group_blocks, block, padding_blocks=1, seed=4)
    padded[0] = padded[-1] = 0
    held = padded[1:-1]
    kernel = kernels.grouped_matmul("CPU")
    assert kernel.takes_outside_groups
    out, dx, dw = run(kernel, x, held, sizes, upstream, block)
    np.testing.assert_allclose(out, np_grouped(x, padded, sizes), rtol=1e-5, atol=1e-5)
    outside = np.zeros(x.shape[0], bool)
    outside[: sizes[0]] = True
    outside[sizes[:-1].sum() :] = True
    assert not out[outside].any() and not dx[outside].any()
    expected_dx, expected_dw = torch_grads(x, padded, sizes, upstream, scale)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-5)
    _, plain_dw = torch_grads(x, padded, sizes, upstream, np.ones_like(scale))
    np.testing.assert_allclose(dw, plain_dw[1:-1], rtol=1e-5, atol=1e-5)
    _, dx_s, dw_s = run(kernels.grouped_matmul_row_scaled("CPU"), x, held, sizes, upstream, block, scale)
    np.testing.assert_allclose(dx_s, expected_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw_s, expected_dw[1:-1], rtol=1e-5, atol=1e-5)


def test_cpu_grouped_matmul_of_a_frozen_weight_gives_the_input_gradient_only(static_path):
    """``weight_grad=False`` (a frozen LoRA base): the same values and input gradient as the plain kernel, with
    and without the groups of experts held elsewhere, and of an fp16 weight; the weight gradient it returns is
    zero (it is never computed)."""
    x, weight, sizes, upstream, scale = problem([2, 1, 0, 3, 1], 4, padding_blocks=1, seed=5)
    kernel = kernels.grouped_matmul("CPU", weight_grad=False)
    out, dx, dw = run(kernel, x, weight, sizes, upstream, 4)
    np.testing.assert_allclose(out, np_grouped(x, weight, sizes), rtol=1e-5, atol=1e-5)
    expected_dx, _ = torch_grads(x, weight, sizes, upstream, scale)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-5)
    assert not dw.any()
    padded = weight.copy()
    padded[0] = padded[-1] = 0
    out, dx, dw = run(kernel, x, padded[1:-1], sizes, upstream, 4)
    np.testing.assert_allclose(out, np_grouped(x, padded, sizes), rtol=1e-5, atol=1e-5)
    expected_dx, _ = torch_grads(x, padded, sizes, upstream, scale)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-5)
    half_out, half_dx, _ = run(kernel, x, weight.astype(np.float16), sizes, upstream, 4)
    rounded = weight.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(half_out, np_grouped(x, rounded, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(half_dx, torch_grads(x, rounded, sizes, upstream, scale)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cpu_grouped_matmul_reads_a_frozen_weight_in_place(dtype, monkeypatch):
    """``frozen_weight`` (a LoRA base): the host kernel reads the Parameter instead of taking it as an input, with
    the values and input gradient of the contract, and a compiled graph sees values written into the Parameter's
    memory (as the graph's other ops do: it holds no copy of its own). A bf16 weight (NumPy has none) keeps the
    input path."""
    monkeypatch.setattr(cpu_grouped, "GATHER_RATIO", 0)  # the host kernel (the gathered path takes the weight)
    x, weight, sizes, upstream, scale = problem([2, 1, 0, 3, 1], 4, padding_blocks=1, seed=7)
    param = ms.Parameter(Tensor(weight.astype(dtype)), name="w", requires_grad=False)
    kernel = kernels.grouped_matmul("CPU", weight_grad=False, frozen_weight=param)
    assert kernel.matmul.reads_frozen_weight
    x_NbF = Tensor(x.reshape(-1, 4, IN_FEATURES))

    @ms.jit
    def step(x_in):
        def weighted(x_val):
            out = kernel(x_val, param, Tensor(sizes))
            return (out * Tensor(upstream.reshape(out.shape))).sum(), out

        return ms.value_and_grad(weighted, 0, has_aux=True)(x_in)

    for values in (weight, weight[::-1] * 2):
        param.asnumpy()[...] = values.astype(dtype)  # in place: the buffer the compiled graph holds
        rounded = values.astype(dtype).astype(np.float32)
        (_, out), dx = step(x_NbF)
        np.testing.assert_allclose(out.asnumpy().reshape(-1, OUT_FEATURES), np_grouped(x, rounded, sizes), atol=1e-5)
        expected_dx, _ = torch_grads(x, rounded, sizes, upstream, scale)
        np.testing.assert_allclose(dx.asnumpy().reshape(x.shape), expected_dx, rtol=1e-5, atol=1e-5)
    bf16 = ms.Parameter(Tensor(weight, ms.bfloat16), name="w16", requires_grad=False)
    assert not kernels.grouped_matmul("CPU", weight_grad=False, frozen_weight=bf16).matmul.reads_frozen_weight
    with pytest.raises(ValueError, match="frozen_weight"):
        cpu_grouped.BlockGroupedMatmul(weight_grad=True, frozen_weight=param)


@pytest.mark.parametrize("outside", [False, True])
def test_cpu_grouped_matmul_of_an_unknown_row_count_gathers_each_blocks_weight(outside):
    """The serving graphs' path (a block count known only when the graph runs, so no host kernel): every block
    times its expert's weight in one BatchMatMul; with the groups of experts held elsewhere, those give zeros."""
    x, weight, sizes, _, _ = problem([2, 1, 0, 3, 1], 4, padding_blocks=1, seed=6)
    if outside:
        weight[0] = weight[-1] = 0
    held = weight[1:-1] if outside else weight
    kernel = kernels.grouped_matmul("CPU")
    out = kernel.whole(Tensor(x.reshape(-1, 4, IN_FEATURES)), Tensor(held.astype(np.float16)), Tensor(sizes))
    rounded = weight.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(out.asnumpy().reshape(-1, OUT_FEATURES), np_grouped(x, rounded, sizes), atol=1e-5)


def test_cpu_products_gather_small_experts_and_run_large_ones_on_the_host_kernel():
    """The tiny model's experts (hidden 192, width 32) at top-8 of 2,048 tokens (its default micro-batch) gather
    at 64 and 128 experts (b = 32, 16) and run on the host kernel at 256 (b = 8: a block's weight is 3.4x its
    rows); GLM-4.5-Air-shaped experts (512 x 512, b = 4), rank-r LoRA factors and products whose gathered
    weights pass 64 MiB never gather."""
    rows = 2048 * 8
    for experts, block, gathers in ((64, 32, True), (128, 16, True), (256, 8, False)):
        assert cpu_grouped.block_rows(rows, experts) == block
        num_blocks = rows // block + experts
        assert cpu_grouped.gathers_weights(num_blocks, block, 32, 192) is gathers
        assert cpu_grouped.gathers_weights(num_blocks, block, 192, 32) is gathers
    assert not cpu_grouped.gathers_weights(6144 // 4 + 128, 4, 512, 512)
    assert not cpu_grouped.gathers_weights(6144 // 8 + 128, 8, 8, 512)  # a rank-8 LoRA factor
    assert not cpu_grouped.gathers_weights(6144 // 8 + 128, 8, 512, 8)
    assert not cpu_grouped.gathers_weights(2**20, 64, 32, 192)


def test_cpu_block_size_keeps_padding_near_an_eighth_and_is_one_for_few_rows():
    rule = kernels.grouped_alignment("CPU")
    assert rule(8, 64) == 1 and rule(64 * 8 * 2 - 1, 64) == 1  # decode steps, few rows per expert
    assert rule(16384, 64) == 32  # 64 experts top-8 at 2048 tokens: 256 rows per expert on average
    for rows, experts in ((16384, 64), (4096, 8), (100_000, 256)):
        block = rule(rows, experts)
        assert block in (1,) + cpu_grouped.BLOCK_SIZES and experts * (block - 1) <= rows / 8


def test_ascend_target_gets_the_grouped_matmul_op_with_no_padding():
    assert isinstance(kernels.grouped_matmul("Ascend"), ascend.AscendGroupedMatmul)
    assert isinstance(kernels.grouped_matmul_row_scaled("Ascend"), ascend.AscendRowScaledGroupedMatmul)
    assert kernels.grouped_alignment("Ascend")(16384, 64) == 1
    assert isinstance(kernels.grouped_matmul(), cpu_grouped.BlockGroupedMatmul)  # this machine: CPU


def documented_parameters(function) -> set:
    """Parameter names of the signature line that opens ``function``'s docstring (``gmm(*args, **kwargs)``
    is an overload dispatcher whose Python signature says nothing)."""
    first_line = inspect.getdoc(function).splitlines()[0]
    match = re.fullmatch(r"\w+\((.*)\)\s*->.*", first_line)
    assert match, first_line
    return {part.split("=")[0].strip() for part in match.group(1).split(",")}


def test_the_ascend_kernels_call_mindspore_2_9_gmm_with_arguments_it_takes():
    """GroupedMatmul fails on CPU, so the call cannot run here: check that the op exists in the installed
    MindSpore, that every ``gmm`` call in ``kernels/ascend.py`` passes only parameters it documents, and
    that the row-grouped and reduction-grouped modes used exist."""
    from mindspore.ops.auto_generate import GroupedMatmul, grouped_matmul
    from mindspore.ops.function import math_func

    assert ms.__version__.startswith("2.9")
    assert ascend.gmm is math_func.gmm
    params = documented_parameters(math_func.gmm)
    assert {"x", "weight", "group_list", "group_type", "group_list_type"} <= params
    doc = inspect.getdoc(math_func.gmm)
    assert "If `group_type` is 2" in doc and "If `group_list_type` is 1" in doc
    assert {"split_item", "group_type", "transpose_b"} <= set(inspect.signature(GroupedMatmul.__init__).parameters)
    assert "group_list" in inspect.signature(grouped_matmul).parameters
    calls = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(ascend)))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "gmm"
    ]
    assert len(calls) == 4
    for call in calls:
        assert len(call.args) == 2 and all(isinstance(arg, ast.List) for arg in call.args)  # x, weight lists
        assert {keyword.arg for keyword in call.keywords} <= params
        assert {"group_list", "group_list_type"} <= {keyword.arg for keyword in call.keywords}
