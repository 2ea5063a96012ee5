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
rms_norm       :class:`~.cpu_native.NativeRMSNormalize`   ``ops.rms_norm(x, gamma, epsilon)``
               (one compiled pass each way in training;
               :class:`~.cpu.RowRMSNormalize` on GPU, or
               without a C++ compiler)
attention_core :class:`~.cpu.GroupedAttentionCore`        same as CPU: FlashAttentionScore takes a
                                                          boolean mask and returns no probabilities
swiglu         :class:`~.cpu_native.NativeSwiGLU` (one    :func:`~.ascend.swiglu`: ``ops.swiglu`` on
               compiled pass each way for fp32 in         gate and up concatenated on the last axis
               training; :func:`~.cpu.swiglu` on GPU,
               other dtypes, or without a C++ compiler)
rope           :class:`~.cpu_native.NativeRope` (one      :class:`~.ascend.AscendRope`:
               compiled pass each way for fp32 in         ``ops.rotary_position_embedding`` (mode 0/1)
               training); :func:`~.cpu_rope.rope_rotate_half`,
               :func:`~.cpu_rope.rope_interleaved` on GPU,
               other dtypes, or without a C++ compiler
slot_gather,   :class:`~.cpu_native.NativeSlotGather`,    the formulas :func:`~.cpu.gather_source_rows`,
slot_combine   :class:`~.cpu_native.NativeSlotCombine`    :func:`~.cpu.combine_slot_rows` (gathers and a
               (compiled passes for fp32 in training)     batched MatMul)
row_squares    :class:`~.cpu_native.NativeRowSquares`     the formula :func:`~.cpu.row_squares` (batched
               (one pass per row, float64 sums)           ``[1, p] x [p, 1]`` dots)
softmax_nll    :class:`~.cpu_native.NativeSoftmaxNLL`     the formula :class:`~.cpu.SoftmaxNLL`
               (one kernel per chunk)
grouped_matmul :class:`~.cpu_grouped.BlockGroupedMatmul`  ``gmm`` (GroupedMatmul, row-grouped)
               (groups padded to blocks of b rows)        (alignment 1: no padding rows)
token_experts  :class:`~.cpu_token_experts.HostTokenExperts` None: the grouped path (dispatcher,
               (training: tokens in, tokens out, one     ``gmm`` per projection, combine)
               host kernel each way)
all_to_all     ``cpu_collectives.EmulatedAllToAll``       ``ops.AlltoAll`` (split and concat on axis 0)
               (AllGather + local selection)
reduce_scatter ``cpu_collectives.EmulatedReduceScatter``  ``ops.ReduceScatter(op="sum", group=...)``
               (AllReduce, then this rank's rows)
all_gather     ``cpu_collectives.EmulatedAllGather``      ``ops.AllGather(group=...)``
               (AllGather on the world group, else
               zero-padded buffers summed by AllReduce)
dropout_keep   :class:`~.dropout_mask.HostScaledKeep`     :func:`~.dropout_mask.graph_scaled_keep`
               (one host kernel)                          (MindSpore ops)
expand         :func:`~.cpu.expand` (``Tile`` for a static  :func:`~.ascend.expand` (the operand as it
               shape, else ``broadcast_to``: an element-  is: the element-wise op broadcasts it)
               wise op of same-shape operands keeps no
               per-element buffers)
============== ========================================== ==============================================

``blockwise_attention`` (training attention, memory linear in the length): on CPU
:class:`~.cpu_attention.BlockwiseAttention` (blocks, online softmax, recomputing backward; the key blocks
in the future or in no document of the query block are skipped), on Ascend
:class:`~.ascend_attention.AscendFlashAttention` (``ops.flash_attention_score`` with a boolean mask and
``next_tokens=0``: the future is skipped, the other documents are masked).
``indexed_attention`` (DeepSeek Sparse Attention for training: the indexer's scores, top-k, attention and KL
loss, memory linear in the length): :class:`~.cpu_dsa.BlockwiseIndexedAttention` on every device (blocks of
queries, recomputing backward); MindSpore 2.9's Ascend DSA ops serve inference only (see the function).
``grouped_matmul_row_scaled`` and ``grouped_alignment`` go with ``grouped_matmul``.
"""

import mindspore as ms

from mindmoe.model.kernels import (
    ascend,
    ascend_attention,
    ascend_collectives,
    cpu,
    cpu_attention,
    cpu_collectives,
    cpu_dsa,
    cpu_grouped,
    cpu_native,
    cpu_rope,
    cpu_token_experts,
    dropout_mask,
)

#: The MindSpore formulas of every kernel: what GPU runs, what the CPU runs where it has no compiled kernel (or no
#: library), and what Ascend runs where it has no fused op.
FORMULA_KERNELS = {
    "rms_norm": cpu.RowRMSNormalize,
    "attention_core": cpu.GroupedAttentionCore,
    "blockwise_attention": cpu_attention.BlockwiseAttention,
    "indexed_attention": cpu_dsa.BlockwiseIndexedAttention,
    "swiglu": lambda: cpu.swiglu,
    "slot_gather": lambda: cpu.gather_source_rows,
    "slot_combine": lambda: cpu.combine_slot_rows,
    "row_squares": lambda: cpu.row_squares,
    "softmax_nll": cpu.SoftmaxNLL,
    "rope": cpu_rope.rope,
    "grouped_matmul": cpu_grouped.BlockGroupedMatmul,
    "grouped_matmul_row_scaled": cpu_grouped.RowScaledBlockGroupedMatmul,
    "grouped_alignment": lambda: cpu_grouped.block_rows,
    "all_to_all": cpu_collectives.EmulatedAllToAll,
    "reduce_scatter": cpu_collectives.EmulatedReduceScatter,
    "all_gather": cpu_collectives.EmulatedAllGather,
    "dropout_keep": dropout_mask.HostScaledKeep,
    "expand": lambda: cpu.expand,
    "token_experts": cpu_token_experts.HostTokenExperts,
}

#: CPU: the compiled kernels of :mod:`.cpu_native` where this machine's library was built, else the formulas.
CPU_KERNELS = dict(
    FORMULA_KERNELS,
    **{name: cpu_native.when_built(native, FORMULA_KERNELS[name]) for name, native in cpu_native.NATIVE.items()},
)

ASCEND_KERNELS = dict(
    FORMULA_KERNELS,
    rms_norm=ascend.AscendRMSNorm,
    blockwise_attention=ascend_attention.AscendFlashAttention,
    swiglu=lambda: ascend.swiglu,
    rope=ascend.AscendRope,
    grouped_matmul=ascend.AscendGroupedMatmul,
    grouped_matmul_row_scaled=ascend.AscendRowScaledGroupedMatmul,
    grouped_alignment=lambda: ascend.alignment,
    all_to_all=ascend_collectives.AscendAllToAll,
    reduce_scatter=ascend_collectives.AscendReduceScatter,
    all_gather=ascend_collectives.AscendAllGather,
    dropout_keep=dropout_mask.graph_scaled_keep,
    expand=lambda: ascend.expand,
    token_experts=None,  # GroupedMatmul runs the grouped path
)

#: device target -> kernel name -> factory called at build time with the kernel's static arguments.
IMPLEMENTATIONS = {
    "CPU": CPU_KERNELS,
    "GPU": FORMULA_KERNELS,
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


def blockwise_attention(scale: float, block_size: int, device_target: str = None):
    """``(q [B, N, S, D], k [B, G, S, D], v [B, G, S, D], doc_ids [B, S] int32) -> out [B, N, S, D]``:
    training self-attention (keys = queries = positions 0..S-1), ``softmax(q k^T * scale + mask) v``
    where query i sees key j iff ``j <= i`` and ``doc_ids[b, i] == doc_ids[b, j]``; query head n uses
    key/value head ``n // (N / G)`` (HF repeat_kv). Memory linear in S: no ``[S, S]`` scores or
    probabilities are kept for the backward (CPU: blocks of ``block_size`` positions, scores fp32 whatever
    the dtype of q/k/v; Ascend: FlashAttentionScore, fp16/bf16 q/k/v). Gradients flow to q, k and v."""
    return implementation("blockwise_attention", device_target)(scale, block_size)


def indexed_attention(
    scale: float, index_scale: float, topk: int, block_size: int, sparse: bool, device_target: str = None
):
    """DeepSeek Sparse Attention for training, memory linear in S: ``(q [B, N, S, D], k [B, N, S, D], v [B, N, S, E],
    doc_ids [B, S] int32, iq [B, I, S, C], ik [B, 1, S, C], w [B, I, S, 1]) -> (out [B, N, S, E], kl_sum [] fp32)``:
    the lightning indexer's scores ``I = sum_j w_j ReLU(iq_j . ik) * index_scale``, each
    query's top ``topk`` visible keys (every visible key unless ``sparse``), ``softmax(q k^T * scale + mask) v`` over
    them and the sum over queries of ``KL(p || softmax(I + mask))``, ``p`` the head-summed probabilities (no
    gradient); see :class:`~.cpu_dsa.BlockwiseIndexedAttention`. ``q, k, v`` get gradients from ``out`` only,
    ``iq, ik, w`` from ``kl_sum`` only. Every device runs the CPU kernel's MindSpore ops: MindSpore 2.9's Ascend
    ``lightning_indexer`` and ``sparse_flash_attention`` are inference ops (fixed 64 heads of 128 and 512 + 64 wide
    MLA-absorbed heads, 2048 selected keys, one length per sequence instead of document ids, no log-sum-exp in
    graph mode), so no training graph can call them."""
    return implementation("indexed_attention", device_target)(scale, index_scale, topk, block_size, sparse)


def swiglu(device_target: str = None):
    """``(gate [..., I], up [..., I]) -> silu(gate) * up``."""
    return implementation("swiglu", device_target)()


def slot_gather(device_target: str = None):
    """``(x [T, H], source [X] int32) -> [X, H]``: row i is ``x[source[i]]``, zeros where ``source[i] == T`` (the
    MoE dispatch's expert buffer; no gradient to ``source``)."""
    return implementation("slot_gather", device_target)()


def slot_combine(device_target: str = None):
    """``(y [X, H], slot [T * K] int32, weight [T, K]) -> [T, H]``: ``out_t = sum_k weight_tk * y[slot_tk]``, where
    slot X (a dropped assignment) adds nothing (the MoE dispatch's combine; gradients to ``y`` and ``weight``)."""
    return implementation("slot_combine", device_target)()


def row_squares(device_target: str = None):
    """``(x [R, n], piece) -> [R] fp32``: the sum of squares of each row, whose value depends on that row's elements
    only (not on R or the other rows: an expert row gives the same bits on whichever rank holds it). ``piece``, a
    divisor of n or None (all n), is the formula's dot-product length (:func:`~.cpu.row_squares`); the compiled CPU
    kernel sums each row in float64 (:class:`~.cpu_native.NativeRowSquares`). No gradient."""
    return implementation("row_squares", device_target)()


def softmax_nll(device_target: str = None):
    """``(logits [c, V] fp32, labels [c] int32, weight [c] fp32) -> (nll [c], dlogits [c, V])``: the per-token loss
    ``logsumexp(logits_t) - logits_t[label_t]`` and the weighted logit gradient ``(softmax(logits_t) -
    onehot(label_t)) * w_t`` of one chunk of the LM loss (fp32; labels in ``[0, V)``). No gradient."""
    return implementation("softmax_nll", device_target)(expand(device_target))


def rope(interleaved: bool, device_target: str = None):
    """``(x_rot [B, N, S, R], cos [S, R], sin [S, R]) -> x_rot * cos + rotate(x_rot) * sin``: RoPE of every
    channel of ``x_rot`` with one position table for the batch; ``rotate`` pairs channel i with i + R/2
    (rotate-half) or 2i with 2i+1 (``interleaved``). Partial rotation and per-sequence tables are
    :func:`mindmoe.model.rope.apply_rope`'s."""
    return implementation("rope", device_target)(interleaved)


def grouped_matmul(device_target: str = None, weight_grad: bool = True, frozen_weight=None):
    """``(x_sorted [N, b, F], weight [E, O, F], group_sizes [E] int32[, scale [N, b]]) -> [N, b, O]``: the sorted rows
    (``X = N * b``, flattened in order) fall into E contiguous groups of ``group_sizes[e]`` rows, each a
    multiple of b (the :func:`grouped_alignment`); row r of group e gives ``x_r weight[e]^T``. Rows past
    the last group are zeros and give zeros; they are never combined, so their gradient is not specified
    (there are none with alignment 1). An implementation whose ``takes_outside_groups`` is true also takes
    ``E + 2`` group sizes for E weights (a process holding a share of the experts): the first and last
    groups' rows give zeros, with zero gradients; otherwise the caller pads the weights with zero experts.
    ``weight_grad=False``: the weight is frozen (a LoRA base); its gradient is never used, and an
    implementation with a hand-written backward skips computing it. ``frozen_weight``: with
    ``weight_grad=False``, the Parameter that every call passes as ``weight``; an implementation that reads
    weights on the host may read it in place instead of taking it as an input (the CPU one: no graph keeps a
    copy of it). An instance serves one product of the model (the CPU one keeps what its forward took for its
    backward). ``scale``: the row scale of :func:`grouped_matmul_row_scaled`, which has this signature; unused
    here, so a caller passes it to either."""
    return implementation("grouped_matmul", device_target)(weight_grad, frozen_weight)


def grouped_matmul_row_scaled(device_target: str = None):
    """``(x_sorted, weight, group_sizes, scale [N, b])``: :func:`grouped_matmul` whose weight gradient takes
    row r's share times ``scale_r`` (the input gradient is unscaled)."""
    return implementation("grouped_matmul_row_scaled", device_target)()


def grouped_alignment(device_target: str = None):
    """``(num_rows, num_groups) -> b``: the multiple of rows every group of :func:`grouped_matmul` must have
    when about ``num_rows`` rows are grouped (the dispatcher pads the groups with zero rows)."""
    return implementation("grouped_alignment", device_target)()


def all_to_all(group: str, group_size: int, rank_in_group: int, device_target: str = None):
    """``x [G, n, ...] -> [G, n, ...]`` over communication ``group`` of G ranks (this one ``rank_in_group``):
    block j goes to rank j, output block s is the block rank s sent here (AlltoAllV with n rows to every
    rank: a sender with fewer rows for a rank pads them with zeros). Its backward is the reverse exchange."""
    return implementation("all_to_all", device_target)(group, group_size, rank_in_group)


def reduce_scatter(group: str, group_size: int, rank_in_group: int, device_target: str = None):
    """``x [G * m, ...] -> [m, ...]`` over communication ``group`` of G ranks (this one ``rank_in_group``): the
    element-wise sum of every rank's ``x``, of which this rank keeps rows ``rank_in_group * m`` to
    ``(rank_in_group + 1) * m``. No backward (the optimizer step uses it on gradients)."""
    return implementation("reduce_scatter", device_target)(group, group_size, rank_in_group)


def all_gather(group: str, group_size: int, rank_in_group: int, device_target: str = None):
    """``x [m, ...] -> [G * m, ...]`` over communication ``group`` of G ranks: every rank's ``x`` concatenated
    on axis 0 in rank order. No backward (the optimizer step uses it on updated parameters)."""
    return implementation("all_gather", device_target)(group, group_size, rank_in_group)


def dropout_keep(threshold: int, scale: float, device_target: str = None):
    """``(row [Z] int32, col [F] int32) -> [Z, F] fp32``: ``scale`` where ``h * h + h >= threshold`` for
    ``h = row_z * col_f`` in wrapping int32 arithmetic, else 0 (the scaled keep mask of one LoRA dropout draw,
    :mod:`mindmoe.model.lora.dropout`). No gradient."""
    return implementation("dropout_keep", device_target)(threshold, scale)


def token_experts(specs, shapes, scaling, num_experts, first_expert, num_held, top_k, device_target: str = None):
    """The routed experts from tokens to tokens in one kernel, or None where the grouped path (dispatcher, grouped
    matmuls, combine) is the device's way: ``(x [T, H], topk [T, K] int32, row [T * K] int32, sources [1] int32,
    weight [T, K], scale [T], then per projection gate, up, down: weight, lora_A, lora_B, row_Z, col_F) -> y [T, H]``
    (``row``: each assignment's row in the grouped path's expert-sorted buffer), ``y_t = sum_k w_tk
    expert_{i_tk}(x_t)`` over the ``num_held`` experts from ``first_expert``, with the adapters and dropout of
    ``specs`` (:class:`~.cpu_token_experts.ProjectionSpec`). CPU: :class:`~.cpu_token_experts.HostTokenExperts` (no
    expert row in the graph); Ascend: None. Training graphs only (static token count)."""
    factory = implementation("token_experts", device_target)
    if factory is None:
        return None
    return factory(specs, shapes, scaling, num_experts, first_expert, num_held, top_k)


def expand(device_target: str = None):
    """``(x, shape) -> x`` broadcast to ``shape``, for an operand of an element-wise op with a tensor of that
    shape: same values either way, but MindSpore 2.9's CPU element-wise kernels keep 16 bytes per output element
    for the graph's life when they broadcast an operand themselves."""
    return implementation("expand", device_target)()


__all__ = [
    "IMPLEMENTATIONS",
    "all_gather",
    "all_to_all",
    "attention_core",
    "blockwise_attention",
    "dropout_keep",
    "expand",
    "grouped_alignment",
    "grouped_matmul",
    "grouped_matmul_row_scaled",
    "implementation",
    "indexed_attention",
    "reduce_scatter",
    "rms_norm",
    "rope",
    "row_squares",
    "slot_combine",
    "slot_gather",
    "softmax_nll",
    "swiglu",
    "token_experts",
]
