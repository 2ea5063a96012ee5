"""CPU kernel functions on the compiled kernels of ``native/`` (:mod:`.native`), as MindSpore
``ops.Custom(func_type="aot")`` ops with a hand-written backward.

They serve training graphs (``cell.training``): an evaluation, generation or export graph runs the MindSpore formula of
the kernel they extend, so no exported MindIR holds a custom op that needs this machine's library. Where no library
could be built (:func:`.native.library` is None) the factories return the formula kernels themselves.

Shape legend (docs/architecture.md): Z rows of a flattened input, H the normalised axis.
"""

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindmoe.model.kernels import cpu, cpu_rope, native
from mindmoe.model.kernels.cpu import RowRMSNormalize


def _custom(lib: str, name: str, out_shape, out_dtype):
    return ops.Custom(f"{lib}:{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")


class NativeRMSNormalize(RowRMSNormalize):
    """:class:`~.cpu.RowRMSNormalize` whose training forward and whose backward are one pass each over the rows
    (``MindmoeRmsNormForward`` / ``MindmoeRmsNormBackward``): same formulas; the weight gradient is summed in
    double. On the benchmark's dense step the graph formula ran 10 element-wise kernels per norm over ``[Z, H]``
    (three in the forward, seven in the backward) besides its row sums and broadcasts."""

    def __init__(self, lib: str, dim: int, eps: float):
        super().__init__(dim, eps)
        self.eps_1 = Tensor(np.array([eps], np.float32))
        self.native_forward = _custom(lib, "MindmoeRmsNormForward", lambda x, w, e: x, lambda x, w, e: x)
        self.native_backward = _custom(
            lib, "MindmoeRmsNormBackward", lambda x, w, e, d: (x, w), lambda x, w, e, d: (x, w)
        )

    def construct(self, x_ZH, weight_H):
        if self.training:
            return self.native_forward(x_ZH, weight_H, self.eps_1)
        return super().construct(x_ZH, weight_H)

    def bprop(self, x_ZH, weight_H, out_ZH, dout_ZH):
        dx_ZH, dweight_H = self.native_backward(x_ZH, weight_H, self.eps_1, dout_ZH)
        return dx_ZH, dweight_H


class _NativeSwiglu(nn.Cell):
    """fp32 ``silu(gate) * up`` and its gradients in one pass each (``MindmoeSwigluForward`` / ``Backward``)."""

    def __init__(self, lib: str):
        super().__init__()
        self.native_forward = _custom(lib, "MindmoeSwigluForward", lambda g, u: g, lambda g, u: g)
        self.native_backward = _custom(lib, "MindmoeSwigluBackward", lambda g, u, d: (g, u), lambda g, u, d: (g, u))

    def construct(self, gate, up):
        return self.native_forward(gate, up)

    def bprop(self, gate, up, out, dout):
        dgate, dup = self.native_backward(gate, up, dout)
        return dgate, dup


class NativeSwiGLU(nn.Cell):
    """:func:`~.cpu.swiglu` whose fp32 training forward and backward are one compiled pass each over the elements
    (the sigmoid's ``exp`` a vectorized polynomial; within 5e-7 of float64 in the tests); other dtypes and evaluation
    graphs run the formula. The graph formula ran a ``Sigmoid``, two ``Mul`` kernels forward and five element-wise
    kernels backward."""

    def __init__(self, lib: str):
        super().__init__()
        self.fused = _NativeSwiglu(lib)

    def construct(self, gate, up):
        if self.training and gate.dtype == ms.float32 and up.dtype == ms.float32:
            return self.fused(gate, up)
        return cpu.swiglu(gate, up)


class _NativeRope(nn.Cell):
    """fp32 RoPE of ``x_rot [..., S, R]`` with ``[S, R]`` tables and its input gradient, one pass each
    (``MindmoeRope{Half,Interleaved}{Forward,Backward}``). The tables get no gradient: they come from positions and
    constants, never from a parameter."""

    def __init__(self, lib: str, interleaved: bool):
        super().__init__()
        layout = "Interleaved" if interleaved else "Half"
        self.native_forward = _custom(lib, f"MindmoeRope{layout}Forward", lambda x, c, s: x, lambda x, c, s: x)
        self.native_backward = _custom(lib, f"MindmoeRope{layout}Backward", lambda d, c, s: d, lambda d, c, s: d)

    def construct(self, x_rot, cos, sin):
        return self.native_forward(x_rot, cos, sin)

    def bprop(self, x_rot, cos, sin, out, dout):
        return self.native_backward(dout, cos, sin), ops.zeros_like(cos), ops.zeros_like(sin)


class NativeRope(nn.Cell):
    """The CPU ``rope`` kernel (:func:`~.cpu_rope.rope`) whose fp32 training forward and backward are one compiled
    pass each; other dtypes and evaluation graphs run the formula. The formula's forward split ``x_rot``, negated and
    concatenated a half and broadcast both tables, and its backward undid each of those."""

    def __init__(self, lib: str, interleaved: bool):
        super().__init__()
        self.fused = _NativeRope(lib, interleaved)
        self.formula = cpu_rope.rope(interleaved)

    def construct(self, x_rot, cos, sin):
        if self.training and x_rot.dtype == ms.float32 and cos.dtype == ms.float32 and sin.dtype == ms.float32:
            return self.fused(x_rot, cos, sin)
        return self.formula(x_rot, cos, sin)


class _NativeGatherRows(nn.Cell):
    def __init__(self, lib: str):
        super().__init__()
        self.native_forward = _custom(lib, "MindmoeGatherRowsForward", lambda x, i: [i[0], x[1]], lambda x, i: x)
        self.native_backward = _custom(lib, "MindmoeGatherRowsBackward", lambda x, i, d: x, lambda x, i, d: x)

    def construct(self, x_TH, source_X):
        return self.native_forward(x_TH, source_X)

    def bprop(self, x_TH, source_X, out, dout):
        return self.native_backward(x_TH, source_X, dout), ops.zeros_like(source_X)


class NativeSlotGather(nn.Cell):
    """:func:`~.cpu.gather_source_rows` (the MoE dispatch's slot buffer) whose fp32 training forward copies each slot's
    row once and whose backward adds each slot's gradient to its token, one pass each; the formula concatenated a
    zero row to ``x`` (a copy of it) to gather from, and its backward summed segments into ``T + 1`` rows and sliced
    them."""

    def __init__(self, lib: str):
        super().__init__()
        self.fused = _NativeGatherRows(lib)

    def construct(self, x_TH, source_X):
        if self.training and x_TH.dtype == ms.float32:
            return self.fused(x_TH, source_X)
        return cpu.gather_source_rows(x_TH, source_X)


class _NativeCombineRows(nn.Cell):
    def __init__(self, lib: str):
        super().__init__()
        self.native_forward = _custom(lib, "MindmoeCombineRowsForward", lambda y, r, w: [w[0], y[1]], lambda y, r, w: y)
        self.native_backward = _custom(
            lib, "MindmoeCombineRowsBackward", lambda y, r, w, d: (y, w), lambda y, r, w, d: (y, w)
        )

    def construct(self, y_XH, slot_A, weight_TK):
        return self.native_forward(y_XH, slot_A, weight_TK)

    def bprop(self, y_XH, slot_A, weight_TK, out, dout):
        dy_XH, dweight_TK = self.native_backward(y_XH, slot_A, weight_TK, dout)
        return dy_XH, ops.zeros_like(slot_A), dweight_TK


class NativeSlotCombine(nn.Cell):
    """:func:`~.cpu.combine_slot_rows` whose fp32 training forward sums each token's weighted slot rows and whose
    backward gives the slots' and the weights' gradients, one pass each; the formula concatenated a zero row to the
    ``[X, H]`` slots (a copy), gathered the tokens' ``[T K, H]`` rows and ran ``T`` batched ``[1, K] x [K, H]``
    products, and its backward two batched products and a segment sum."""

    def __init__(self, lib: str):
        super().__init__()
        self.fused = _NativeCombineRows(lib)

    def construct(self, y_XH, slot_A, weight_TK):
        if self.training and y_XH.dtype == ms.float32 and weight_TK.dtype == ms.float32:
            return self.fused(y_XH, slot_A, weight_TK)
        return cpu.combine_slot_rows(y_XH, slot_A, weight_TK)


class NativeRowSquares(nn.Cell):
    """:func:`~.cpu.row_squares` as one pass over each row (``MindmoeRowSquares``), summed in float64 and rounded
    once; ``piece`` (the formula's dot-product length) is not used. The global gradient norm takes it for every
    parameter each step: MindSpore's CPU MatMul ran the formula's ``[1, p] x [p, 1]`` dots at about 2.7 GB/s (75 ms
    of the benchmark's 1.5 s MoE step for the 24 expert tensors). Any step may call it: it has no gradient and
    reads each element once."""

    def __init__(self, lib: str):
        super().__init__()
        self.native = _custom(lib, "MindmoeRowSquares", lambda x: [x[0]], lambda x: x)

    def construct(self, x_Rn, piece):
        return self.native(x_Rn.astype(ms.float32))


class NativeSoftmaxNLL(nn.Cell):
    """:class:`~.cpu.SoftmaxNLL` as one compiled kernel (``MindmoeSoftmaxNll``): per row the max, the exponentials
    (the ``exp`` polynomial of the SwiGLU) and their sum, then the scaling, where the formula ran about nine kernels
    over ``[c, V]`` (max, subtract, exp, sum, gather, scale, scatter and two tiles). The LM loss calls it for the
    training step's gradients only (``TokenNLL(grads=True)``); evaluation computes the loss by the formula. A label
    outside ``[0, V)`` fails the op. ``expand`` is not used."""

    def __init__(self, lib: str, expand=None):
        super().__init__()
        self.native = _custom(lib, "MindmoeSoftmaxNll", lambda x, lab, w: (lab, x), lambda x, lab, w: (w, x))

    def construct(self, logits_cV, labels_c, weight_c):
        return self.native(logits_cV, labels_c, weight_c)


#: Kernel name -> the class of its compiled implementation, built as ``cls(lib, *the kernel's arguments)``.
NATIVE = {
    "rms_norm": NativeRMSNormalize,
    "swiglu": NativeSwiGLU,
    "rope": NativeRope,
    "slot_gather": NativeSlotGather,
    "slot_combine": NativeSlotCombine,
    "row_squares": NativeRowSquares,
    "softmax_nll": NativeSoftmaxNLL,
}


def when_built(native, formula):
    """A kernel factory: ``native(lib, *args)`` on this machine's library (:func:`library`), else ``formula(*args)``
    (the MindSpore formula's factory, as GPU runs it)."""

    def factory(*args):
        lib = library()
        return formula(*args) if lib is None else native(lib, *args)

    return factory


def library():
    """:func:`.native.library` (a module attribute, so a benchmark can swap it for ``lambda: None``)."""
    return native.library()
