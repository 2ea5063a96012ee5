"""Kernel functions: the numeric building blocks that have a device-specific implementation.

The model calls these and never an op of one device directly. Kernels with a hand-written
backward are MindSpore cells (``Cell.bprop`` is how MindSpore 2.9 takes a custom backward, and a
cell cannot be created inside a compiled graph), so every kernel is obtained at build time, in a
cell's ``__init__``, and called in ``construct``::

    self.normalize = kernels.rms_norm(dim, eps)        # build time: picks the device's implementation
    y_ZH = self.normalize(x_ZH, weight_H)              # in the graph

The device target is ``mindspore.get_context("device_target")`` when the model is built; the
choice is static, so the compiled graph holds one implementation.

============== ========================================== ==============================================
kernel         CPU (and GPU)                              Ascend
============== ========================================== ==============================================
rms_norm       :class:`~.cpu.RowRMSNormalize`             ``ops.rms_norm(x, gamma, epsilon)``
attention_core :class:`~.cpu.GroupedAttentionCore`        same as CPU: FlashAttentionScore takes a
                                                          boolean mask and returns no probabilities
swiglu         :func:`~.cpu.swiglu`                       same as CPU: ``ops.swiglu`` splits one
                                                          concatenated input instead of gate and up
grouped_matmul :class:`~.cpu_grouped.BlockGroupedMatmul`  ``gmm`` (GroupedMatmul, row-grouped)
               (groups padded to blocks of b rows)        (alignment 1: no padding rows)
============== ========================================== ==============================================

``grouped_matmul_row_scaled`` and ``grouped_alignment`` go with ``grouped_matmul``. The collectives
(``all_to_all``, ``reduce_scatter``, ``all_gather``) are to join this table the same way.
"""

import mindspore as ms

from mindmoe.model.kernels import ascend, cpu, cpu_grouped

CPU_KERNELS = {
    "rms_norm": cpu.RowRMSNormalize,
    "attention_core": cpu.GroupedAttentionCore,
    "swiglu": lambda: cpu.swiglu,
    "grouped_matmul": cpu_grouped.BlockGroupedMatmul,
    "grouped_matmul_row_scaled": cpu_grouped.RowScaledBlockGroupedMatmul,
    "grouped_alignment": lambda: cpu_grouped.block_rows,
}

ASCEND_KERNELS = dict(
    CPU_KERNELS,
    rms_norm=ascend.AscendRMSNorm,
    grouped_matmul=ascend.AscendGroupedMatmul,
    grouped_matmul_row_scaled=ascend.AscendRowScaledGroupedMatmul,
    grouped_alignment=lambda: ascend.alignment,
)

#: device target -> kernel name -> factory called at build time with the kernel's static arguments.
IMPLEMENTATIONS = {
    "CPU": CPU_KERNELS,
    "GPU": CPU_KERNELS,
    "Ascend": ASCEND_KERNELS,
}


def implementation(name: str, device_target: str = None):
    """The factory of kernel ``name`` for ``device_target`` (default: the current MindSpore context's)."""
    device = device_target or ms.get_context("device_target")
    if device not in IMPLEMENTATIONS:
        raise ValueError(f"device_target={device!r}: no kernels for it (known: {', '.join(IMPLEMENTATIONS)})")
    return IMPLEMENTATIONS[device][name]


def rms_norm(dim: int, eps: float, device_target: str = None):
    """``(x [Z, H] fp32, weight [H] fp32) -> x * rsqrt(mean(x^2, -1) + eps) * weight`` (``dim`` = H)."""
    return implementation("rms_norm", device_target)(dim, eps)


def attention_core(scale: float, device_target: str = None):
    """``(q [B, G, Q, D], k [B, G, P, D], v [B, G, P, D], mask [B, G, Q, P] fp32) -> (out [B, G, Q, D],
    probs [B, G, Q, P])`` = ``softmax(q k^T * scale + mask) v``; see :class:`~.cpu.GroupedAttentionCore`."""
    return implementation("attention_core", device_target)(scale)


def swiglu(device_target: str = None):
    """``(gate [..., I], up [..., I]) -> silu(gate) * up``."""
    return implementation("swiglu", device_target)()


def grouped_matmul(device_target: str = None):
    """``(x_sorted [N, b, F], weight [E, O, F], group_sizes [E] int32) -> [N, b, O]``: the sorted rows
    (``X = N * b``, flattened in order) fall into E contiguous groups of ``group_sizes[e]`` rows, each a
    multiple of b (the :func:`grouped_alignment`); row r of group e gives ``x_r weight[e]^T``. Rows past
    the last group are zeros and give zeros; they are never combined, so their gradient is not specified
    (there are none with alignment 1)."""
    return implementation("grouped_matmul", device_target)()


def grouped_matmul_row_scaled(device_target: str = None):
    """``(x_sorted, weight, group_sizes, scale [N, b])``: :func:`grouped_matmul` whose weight gradient takes
    row r's share times ``scale_r`` (the input gradient is unscaled)."""
    return implementation("grouped_matmul_row_scaled", device_target)()


def grouped_alignment(device_target: str = None):
    """``(num_rows, num_groups) -> b``: the multiple of rows every group of :func:`grouped_matmul` must have
    when about ``num_rows`` rows are grouped (the dispatcher pads the groups with zero rows)."""
    return implementation("grouped_alignment", device_target)()


__all__ = [
    "IMPLEMENTATIONS",
    "attention_core",
    "grouped_alignment",
    "grouped_matmul",
    "grouped_matmul_row_scaled",
    "implementation",
    "rms_norm",
    "swiglu",
]
