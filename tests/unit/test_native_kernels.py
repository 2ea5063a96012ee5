"""The compiled CPU kernels (``model/kernels/native``): numerics against float64 NumPy, the training/evaluation
split, and how the library is built, cached, shared and refused."""

import subprocess
import sys
import textwrap

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from mindmoe.model import kernels
from mindmoe.model.kernels import cpu, cpu_native, cpu_rope, native
from mindmoe.model.rope import apply_rope, default_inv_freq, rope_tables

needs_library = pytest.mark.skipif(native.library() is None, reason=f"no native library here: {native.status()}")


def rms_norm_reference(x, weight, upstream, eps):
    """float64 ``y = x r w`` (``r = 1 / sqrt(mean(x^2) + eps)``) and the gradients of ``sum(y * upstream)``."""
    x, weight, upstream = (a.astype(np.float64) for a in (x, weight, upstream))
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    xhat = x * r
    g = upstream * weight
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return xhat * weight, dx, (upstream * xhat).sum(0)


class Grads(nn.Cell):
    """A kernel's output and the gradients of ``sum(out * upstream)`` to its inputs (``upstream`` the last argument)."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel
        self.grad = ops.GradOperation(get_all=True, sens_param=True)

    def construct(self, *args):
        return self.kernel(*args[:-1]), self.grad(self.kernel)(*args)


def relative_error(actual, expected):
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@needs_library
@pytest.mark.parametrize("rows,dim,eps", [(37, 24, 1e-5), (5, 64, 1e-6), (3, 7, 1e-2), (1, 512, 1e-5)])
def test_native_rms_norm_and_its_gradients_match_float64(rows, dim, eps):
    rng = np.random.default_rng(rows + dim)
    x = (rng.normal(size=(rows, dim)) * 3).astype(np.float32)
    weight = rng.normal(1.0, 0.3, size=dim).astype(np.float32)
    upstream = rng.normal(size=(rows, dim)).astype(np.float32)
    norm = kernels.rms_norm(dim, eps, "CPU")
    assert isinstance(norm, cpu_native.NativeRMSNormalize)
    net = Grads(norm)
    net.set_train(True)
    out, (dx, dweight) = net(Tensor(x), Tensor(weight), Tensor(upstream))
    expected = rms_norm_reference(x, weight, upstream, eps)
    for actual, want in zip((out, dx, dweight), expected):
        assert relative_error(actual.asnumpy(), want) < 2e-6


@needs_library
def test_native_rms_norm_serves_training_graphs_only():
    """Evaluation (and so export) graphs run the MindSpore formula: the same bits as RowRMSNormalize's."""
    rng = np.random.default_rng(3)
    x, weight = rng.normal(size=(9, 32)).astype(np.float32), rng.normal(1.0, 0.3, size=32).astype(np.float32)
    native_norm, graph_norm = kernels.rms_norm(32, 1e-5, "CPU"), cpu.RowRMSNormalize(32, 1e-5)
    native_norm.set_train(False)
    evaluated = ms.jit(native_norm)(Tensor(x), Tensor(weight)).asnumpy()
    np.testing.assert_array_equal(evaluated, ms.jit(graph_norm)(Tensor(x), Tensor(weight)).asnumpy())
    native_norm.set_train(True)
    trained = ms.jit(native_norm)(Tensor(x), Tensor(weight)).asnumpy()
    assert relative_error(trained, rms_norm_reference(x, weight, x, 1e-5)[0]) < 2e-6


@needs_library
def test_native_rms_norm_propagates_nan_and_inf_to_its_row_only():
    x = np.ones((3, 8), np.float32)
    x[1, 2] = np.nan
    x[2, 5] = np.inf
    net = Grads(kernels.rms_norm(8, 1e-5, "CPU"))
    net.set_train(True)
    out, (dx, dweight) = net(Tensor(x), Tensor(np.ones(8, np.float32)), Tensor(np.ones((3, 8), np.float32)))
    out, dx = out.asnumpy(), dx.asnumpy()
    np.testing.assert_allclose(out[0], np.ones(8), rtol=1e-5)
    assert np.isnan(out[1]).all() and not np.isfinite(out[2]).all()
    assert np.isfinite(dx[0]).all() and np.isnan(dx[1]).all()
    assert not np.isfinite(dweight.asnumpy()).any()


def swiglu_reference(gate, up, upstream):
    gate, up, upstream = (a.astype(np.float64) for a in (gate, up, upstream))
    s = 1.0 / (1.0 + np.exp(-gate))
    return gate * s * up, upstream * up * s * (1.0 + gate * (1.0 - s)), upstream * gate * s


@needs_library
def test_native_swiglu_and_its_gradients_match_float64():
    rng = np.random.default_rng(5)
    # every magnitude the sigmoid's polynomial exp meets, to where exp(-gate) overflows, and some odd shapes
    gate = np.concatenate([rng.normal(size=2000) * 4, np.linspace(-87.0, 88.0, 20001)]).astype(np.float32)
    gate = gate[: 3 * 7 * 1047].reshape(3, 7, 1047)
    up, upstream = (rng.normal(size=gate.shape).astype(np.float32) for _ in range(2))
    net = Grads(kernels.swiglu("CPU"))
    net.set_train(True)
    out, (dgate, dup) = net(Tensor(gate), Tensor(up), Tensor(upstream))
    want_out, want_dgate, want_dup = swiglu_reference(gate, up, upstream)
    # elementwise relative error where the value is a normal float (below that the kernel flushes as MindSpore does)
    normal = np.abs(want_out) > 1e-30
    assert float((np.abs(out.asnumpy() - want_out) / np.abs(want_out))[normal].max()) < 5e-7
    assert relative_error(dgate.asnumpy(), want_dgate) < 1e-6
    assert relative_error(dup.asnumpy(), want_dup) < 1e-6


@needs_library
def test_native_swiglu_keeps_ieee_specials_and_leaves_other_cases_to_the_formula():
    gate = np.array([np.nan, np.inf, -np.inf, 100.0, -100.0, 0.0, -0.0], np.float32)
    act = kernels.swiglu("CPU")
    act.set_train(True)
    out = ms.jit(act)(Tensor(gate), Tensor(np.ones_like(gate))).asnumpy()
    assert np.isnan(out[0]) and out[1] == np.inf and np.isnan(out[2])  # -inf * sigmoid(-inf) = -inf * 0
    np.testing.assert_array_equal(out[3:], [100.0, 0.0, 0.0, 0.0])
    half = Tensor(gate[3:].astype(np.float16))
    np.testing.assert_array_equal(ms.jit(act)(half, half).asnumpy(), ms.jit(cpu.swiglu)(half, half).asnumpy())
    act.set_train(False)
    x = Tensor(np.linspace(-9, 9, 64).astype(np.float32))
    np.testing.assert_array_equal(ms.jit(act)(x, x).asnumpy(), ms.jit(cpu.swiglu)(x, x).asnumpy())


def rotate(v, interleaved, transpose=False):
    """The RoPE pair rotation ``(a, b) -> (-b, a)`` on the last axis, or its transpose ``(a, b) -> (b, -a)``."""
    if interleaved:
        a, b = v[..., 0::2], v[..., 1::2]
        pair = (b, -a) if transpose else (-b, a)
        return np.stack(pair, -1).reshape(v.shape)
    a, b = np.split(v, 2, -1)
    return np.concatenate((b, -a) if transpose else (-b, a), -1)


class RopeAndGrads(nn.Cell):
    def __init__(self, rotate_kernel, interleaved):
        super().__init__()
        self.rotate_kernel = rotate_kernel
        self.interleaved = interleaved
        self.grad = ops.GradOperation(sens_param=True)

    def forward(self, x, cos, sin):
        return apply_rope(x, cos, sin, self.interleaved, self.rotate_kernel)

    def construct(self, x, cos, sin, upstream):
        return self.forward(x, cos, sin), self.grad(self.forward)(x, cos, sin, upstream)


@needs_library
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 16), (12, 4)])
def test_native_rope_and_its_gradient_match_float64(interleaved, head_dim, rotary_dim):
    rng = np.random.default_rng(head_dim)
    x = rng.normal(size=(2, 3, 5, head_dim)).astype(np.float32)
    upstream = rng.normal(size=x.shape).astype(np.float32)
    cos, sin = rope_tables(default_inv_freq(rotary_dim, 100.0), 5, interleaved)
    native_kernel = kernels.rope(interleaved, "CPU")
    assert isinstance(native_kernel, cpu_native.NativeRope)
    net = RopeAndGrads(native_kernel, interleaved)
    net.set_train(True)
    out, dx = net(Tensor(x), cos, sin, Tensor(upstream))
    c, s = (t.asnumpy().astype(np.float64) for t in (cos, sin))
    x64, dy = x.astype(np.float64), upstream.astype(np.float64)
    want_out = x64.copy()
    want_out[..., :rotary_dim] = x64[..., :rotary_dim] * c + rotate(x64[..., :rotary_dim], interleaved) * s
    assert relative_error(out.asnumpy(), want_out) < 1e-6
    want = dy.copy()
    want[..., :rotary_dim] = dy[..., :rotary_dim] * c + rotate(dy[..., :rotary_dim] * s, interleaved, transpose=True)
    assert relative_error(dx.asnumpy(), want) < 1e-6


@needs_library
def test_native_slot_gather_and_combine_match_float64():
    """The MoE dispatch's buffers: empty slots (source T) and dropped assignments (slot X) included."""
    rng = np.random.default_rng(11)
    tokens, top_k, slots, hidden = 9, 2, 14, 5
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    source = rng.integers(0, tokens + 1, size=slots).astype(np.int32)  # value T: an empty slot
    gather = kernels.slot_gather("CPU")
    assert isinstance(gather, cpu_native.NativeSlotGather)
    upstream = rng.normal(size=(slots, hidden)).astype(np.float32)
    net = Grads(gather)
    net.set_train(True)
    out, (dx, _) = net(Tensor(x), Tensor(source), Tensor(upstream))
    padded = np.concatenate([x, np.zeros((1, hidden), np.float32)])
    np.testing.assert_array_equal(out.asnumpy(), padded[source])
    want_dx = np.zeros((tokens + 1, hidden))
    np.add.at(want_dx, source, upstream.astype(np.float64))
    assert relative_error(dx.asnumpy(), want_dx[:tokens]) < 1e-6

    y = rng.normal(size=(slots, hidden)).astype(np.float32)
    slot = rng.permutation(tokens * top_k + 4)[: tokens * top_k].clip(max=slots).astype(np.int32)  # some dropped (X)
    weight = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    combine = kernels.slot_combine("CPU")
    upstream = rng.normal(size=(tokens, hidden)).astype(np.float32)
    net = Grads(combine)
    net.set_train(True)
    out, (dy, _, dweight) = net(Tensor(y), Tensor(slot), Tensor(weight), Tensor(upstream))
    y_padded = np.concatenate([y, np.zeros((1, hidden), np.float32)]).astype(np.float64)
    picked = y_padded[slot].reshape(tokens, top_k, hidden)
    assert relative_error(out.asnumpy(), (weight[..., None] * picked).sum(1)) < 1e-6
    want_dy = np.zeros((slots + 1, hidden))
    np.add.at(want_dy, slot, (weight[..., None] * upstream[:, None, :]).reshape(-1, hidden))
    assert relative_error(dy.asnumpy(), want_dy[:slots]) < 1e-6
    assert relative_error(dweight.asnumpy(), (picked * upstream[:, None, :]).sum(-1)) < 1e-6


@needs_library
@pytest.mark.parametrize("device", ["CPU", "GPU"])  # GPU: the formula, as it runs there
def test_row_squares_match_float64_and_a_row_does_not_depend_on_the_others(device):
    """Each row's sum of squares (rows of 3, 4,000 and 262,144 elements; a float16 input is read as float32); the
    same row among other rows gives the same bits."""
    rng = np.random.default_rng(13)
    squares = kernels.row_squares(device)
    if device == "CPU":
        assert isinstance(squares, cpu_native.NativeRowSquares)

    def run(x, piece):
        @ms.jit
        def graph(a):
            return squares(a, piece)

        return graph(Tensor(x)).asnumpy()

    for rows, n, piece in ((5, 3, None), (4, 4000, 1000), (2, 262144, 4096)):
        x = (rng.normal(size=(rows, n)) * rng.uniform(0.1, 10, size=(rows, 1))).astype(np.float32)
        got = run(x, piece)
        assert got.dtype == np.float32 and got.shape == (rows,)
        np.testing.assert_allclose(got, (x.astype(np.float64) ** 2).sum(1), rtol=2e-6 if device == "GPU" else 1e-7)
        assert run(x[1:2], piece).tobytes() == got[1:2].tobytes()
    half = rng.normal(size=(3, 40)).astype(np.float16)
    got = run(half, None)
    np.testing.assert_allclose(got, (half.astype(np.float64) ** 2).sum(1), rtol=2e-6)


@needs_library
@pytest.mark.parametrize("device", ["CPU", "GPU"])  # GPU: the formula, as it runs there
def test_softmax_nll_and_its_logit_gradient_match_float64(device):
    """Logits up to +-80 (exp overflows without the max), zero and fractional weights; a NaN logit spoils its row
    only; on CPU a label outside the vocabulary fails the op."""
    rng = np.random.default_rng(19)
    rows, vocab = 37, 1000
    logits = (rng.normal(size=(rows, vocab)) * rng.uniform(0.1, 20, size=(rows, 1))).astype(np.float32)
    logits[3, 5] = 80.0
    labels = rng.integers(0, vocab, size=rows).astype(np.int32)
    labels[3] = 5
    weight = rng.uniform(0, 2, size=rows).astype(np.float32)
    weight[::7] = 0.0
    kernel = kernels.softmax_nll(device)
    assert isinstance(kernel, cpu_native.NativeSoftmaxNLL if device == "CPU" else cpu.SoftmaxNLL)
    nll, dlogits = (t.asnumpy() for t in ms.jit(kernel)(Tensor(logits), Tensor(labels), Tensor(weight)))
    x = logits.astype(np.float64)
    top = x.max(1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(x - top).sum(1))
    probs = np.exp(x - lse[:, None])
    onehot = np.eye(vocab)[labels]
    np.testing.assert_allclose(nll, lse - x[np.arange(rows), labels], rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(dlogits, (probs - onehot) * weight[:, None], rtol=0, atol=1e-6)  # weights up to 2

    logits[4, 9] = np.nan
    nll, dlogits = (t.asnumpy() for t in ms.jit(kernel)(Tensor(logits), Tensor(labels), Tensor(weight)))
    assert np.isnan(nll[4]) and np.isnan(dlogits[4]).all()
    assert np.isfinite(np.delete(nll, 4)).all() and np.isfinite(np.delete(dlogits, 4, 0)).all()
    if device == "CPU":
        labels[0] = vocab
        with pytest.raises(RuntimeError):
            ms.jit(kernel)(Tensor(logits), Tensor(labels), Tensor(weight))[0].asnumpy()


def test_without_a_library_the_cpu_kernels_are_the_graph_formulas(monkeypatch):
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    assert type(kernels.rms_norm(8, 1e-6, "CPU")) is cpu.RowRMSNormalize
    assert type(kernels.rms_norm(8, 1e-6, "GPU")) is cpu.RowRMSNormalize
    assert kernels.swiglu("CPU") is cpu.swiglu
    assert kernels.rope(True, "CPU") is cpu_rope.rope_interleaved
    assert kernels.slot_gather("CPU") is cpu.gather_source_rows
    assert kernels.slot_combine("CPU") is cpu.combine_slot_rows
    assert kernels.row_squares("CPU") is cpu.row_squares
    assert type(kernels.softmax_nll("CPU")) is cpu.SoftmaxNLL


def test_the_switch_and_a_missing_compiler_are_reported_not_raised(monkeypatch):
    try:
        native.reset()
        monkeypatch.setenv(native.SWITCH_ENV, "0")
        assert native.library() is None and f"{native.SWITCH_ENV}=0" in native.status()
        native.reset()
        monkeypatch.delenv(native.SWITCH_ENV)
        monkeypatch.setenv("CXX", "no-such-compiler-x")
        assert native.library() is None
        assert "no C++ compiler" in native.status() and "no-such-compiler-x" in native.status()
    finally:
        monkeypatch.undo()
        native.reset()


def test_a_build_is_cached_by_source_and_a_broken_source_names_the_compiler_error(tmp_path):
    source = tmp_path / "k.cc"
    source.write_text('extern "C" int MindmoeTest() { return 7; }\n')
    root = tmp_path / "cache"
    first = native.build(source, root)
    stamp = first.stat().st_mtime_ns
    assert native.build(source, root) == first and first.stat().st_mtime_ns == stamp
    source.write_text('extern "C" int MindmoeTest() { return 8; }\n')
    assert native.build(source, root) != first
    source.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match=r"exited with 1:[\s\S]*k\.cc:1"):
        native.build(source, root)
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        native.build(source, root, cxx="")
    assert not [p for p in root.rglob(".*.so")]  # no partial library left behind


def test_processes_building_at_once_share_one_library(tmp_path):
    source = tmp_path / "k.cc"
    source.write_text('extern "C" int MindmoeTest() { return 7; }\n')
    script = textwrap.dedent(
        f"""
        from mindmoe.model.kernels import native
        print(native.build({str(source)!r}, {str(tmp_path / "cache")!r}))
        """
    )
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    paths = {run.communicate(timeout=300)[0].strip() for run in runs}
    assert all(run.returncode == 0 for run in runs)
    assert len(paths) == 1
    assert [p.name for p in (tmp_path / "cache").rglob("*.so")] == ["libmindmoe_cpu.so"]
