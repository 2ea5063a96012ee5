"""CPU grouped matmul: each expert's rows times that expert's weight, in blocks of ``b`` rows.

Shape legend (docs/architecture.md): E groups (experts), N blocks, b rows per block, X = N * b sorted
rows, F input features, O output features, n blocks of one chunk.

The token dispatcher pads every expert's group of sorted rows to a multiple of ``b`` (the alignment
:func:`block_rows` asks for), so each block of ``b`` rows belongs to one expert: the kernel gathers
each block's expert weight and runs one BatchMatMul over the blocks. The cost is that of the
X <= A + E * (b - 1) rows it receives, i.e. near the routed FLOPs, with static shapes.

A gathered weight ``[N, O, F]`` is O / b times the rows it multiplies (128x for GLM-4.5-Air-shaped experts
at b = 4), so the kernel never keeps one: the blocks run in chunks whose gathered weights stay under
:data:`CHUNK_BYTES`, one after the other (MindSpore's CPU runtime would otherwise run the independent chunks
at once and hold all their buffers: measured, 8 MiB chunks of one projection peaked as high as no chunks),
the backward gathers again, and the weight gradient is the segment sum over each
chunk's blocks. A half-precision weight (a frozen LoRA base) is gathered in its own dtype and each chunk
cast to the rows' dtype, so no full-precision copy of the experts outlives its chunk either (bf16, which
the CPU Gather lacks, is cast whole first).
"""

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops import functional as F

#: Block sizes the CPU kernel uses (rows per block); larger blocks run BatchMatMul more efficiently.
BLOCK_SIZES = (2, 4, 8, 16, 32, 64)


def block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per block for ``num_rows`` sorted rows over ``num_groups`` experts: the largest size in
    :data:`BLOCK_SIZES` that is at most 1/8 of the mean group, so the padding ``E * (b - 1)`` adds at
    most about 1/8 to the rows; 1 for few rows (decode steps)."""
    target = num_rows // (8 * num_groups)
    block = 1
    for size in BLOCK_SIZES:
        if size <= target:
            block = size
    return block


#: Most bytes of gathered weights one chunk of blocks materialises (fp32).
CHUNK_BYTES = 64 * 2**20


def block_chunks(num_blocks: int, out_features: int, in_features: int) -> tuple:
    """``((start, stop), ...)``: the chunks of blocks whose fp32 gathered weights fit :data:`CHUNK_BYTES`."""
    # Called while a graph compiles: plain integer arithmetic (no max/min builtins).
    per_chunk = CHUNK_BYTES // (out_features * in_features * 4)
    if per_chunk < 1:
        per_chunk = 1
    chunks = ()
    start = 0
    while start < num_blocks:
        stop = start + per_chunk
        if stop > num_blocks:
            stop = num_blocks
        chunks = chunks + ((start, stop),)
        start = stop
    return chunks


def block_experts(num_blocks: int, block: int, num_experts: int, group_sizes_E):
    """The expert of every block: the number of groups that end at or before the block's first row."""
    ends_1E = ops.cumsum(group_sizes_E, 0).astype(ms.float32).expand_dims(0)
    starts_N1 = (ops.arange(num_blocks, dtype=ms.int32) * block).astype(ms.float32).expand_dims(1)
    expert_N = (ends_1E <= starts_N1).astype(ms.int32).sum(1)
    return ops.minimum(expert_N, num_experts - 1)


class _ChunkedBlockMatmul(nn.Cell):
    """``x [N, b, F]`` times the weight of each block's expert ``expert_N``, chunk by chunk; the backward
    scales row r's share of the weight gradient by ``scale [N, b]`` (ones: the plain gradient). Primitives
    only: functional ops do not compile in a bprop.

    ``weight_grad=False`` (a frozen weight, e.g. a LoRA base): the backward computes the input gradient only.
    Autodiff cannot drop the weight gradient of a custom bprop by itself here: the chunks of the backward are
    chained one after another, so every chunk's segment sum would stay alive; a frozen LoRA base paid those
    FLOPs and an fp32 ``[E, O, F]`` running sum per projection and layer."""

    def __init__(self, weight_grad: bool = True):
        super().__init__()
        self.weight_grad = weight_grad
        self.gather = ops.Gather()
        self.cast = ops.Cast()
        self.concat = ops.Concat(0)
        self.segment_sum = ops.UnsortedSegmentSum()
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)
        self.bmm_nn = ops.BatchMatMul()
        self.bmm_tn = ops.BatchMatMul(transpose_a=True)

    def construct(self, x_NbF, w_EOF, expert_N, scale_Nb):
        return self.chunk_products(x_NbF, w_EOF, expert_N, True)

    def bprop(self, x_NbF, w_EOF, expert_N, scale_Nb, out, dout_NbO):
        if not self.weight_grad:
            return (
                self.chunk_products(dout_NbO, w_EOF, expert_N, False),
                ops.zeros_like(w_EOF),
                ops.zeros_like(expert_N),
                ops.zeros_like(scale_Nb),
            )
        chunks = block_chunks(x_NbF.shape[0], w_EOF.shape[1], w_EOF.shape[2])
        scaled_NbO = dout_NbO * self.cast(scale_Nb, dout_NbO.dtype).expand_dims(-1)
        w_dtype = w_EOF.dtype
        if w_dtype == ms.bfloat16:  # no bf16 Gather on CPU: one whole cast
            w_EOF = self.cast(w_EOF, x_NbF.dtype)
        dxs = ()
        dw_EOF = None
        for start, stop in chunks:
            index_n = expert_N[start:stop]
            scaled_nbO = scaled_NbO[start:stop]
            if dw_EOF is not None:  # one chunk at a time, as in the forward
                index_n = ops.depend(ops.depend(index_n, dw_EOF), dxs[-1])
                scaled_nbO = ops.depend(scaled_nbO, index_n)
            weights_nOF = self.cast(self.gather(w_EOF, index_n, 0), dout_NbO.dtype)
            dxs = dxs + (self.bmm_nn(dout_NbO[start:stop], weights_nOF),)
            dw_nOF = self.bmm_tn(scaled_nbO, x_NbF[start:stop])
            part_EOF = self.segment_sum(dw_nOF, index_n, w_EOF.shape[0])
            dw_EOF = part_EOF if dw_EOF is None else dw_EOF + part_EOF
        dx_NbF = dxs[0] if len(dxs) == 1 else self.concat(dxs)
        return dx_NbF, self.cast(dw_EOF, w_dtype), ops.zeros_like(expert_N), ops.zeros_like(scale_Nb)

    def chunk_products(self, rows_NbX, w_EOF, expert_N, forward: bool):
        """Each block's rows times its expert's weight, chunk by chunk: ``x w^T [N, b, O]`` (``forward``) or the
        input gradient ``dout w [N, b, F]``. Each chunk's gather waits for the previous chunk's product: MindSpore's
        CPU runtime runs independent nodes at once, which would hold every chunk's gathered weights together."""
        chunks = block_chunks(rows_NbX.shape[0], w_EOF.shape[1], w_EOF.shape[2])
        if w_EOF.dtype == ms.bfloat16:  # no bf16 Gather on CPU: one whole cast
            w_EOF = self.cast(w_EOF, rows_NbX.dtype)
        bmm = self.bmm_nt if forward else self.bmm_nn
        outs = ()
        after = expert_N
        for start, stop in chunks:
            index_n = ops.depend(expert_N[start:stop], after)
            after = bmm(rows_NbX[start:stop], self.cast(self.gather(w_EOF, index_n, 0), rows_NbX.dtype))
            outs = outs + (after,)
        return outs[0] if len(outs) == 1 else self.concat(outs)


class BlockGroupedMatmul(nn.Cell):
    """``(x [N, b, F], weight [E, O, F], group_sizes [E] int32) -> [N, b, O]``: row r of group e times
    ``weight[e]^T``. Group sizes are multiples of b, in row order; rows past the last group are padding
    (zeros in, zeros out since they are computed with the last expert's weight). ``weight`` may be half
    precision: each chunk's gathered weights are cast to ``x``'s dtype.

    A process holding a share of the experts may pass ``E + 2`` group sizes for its ``E`` weights: the
    first and last groups are the rows of experts held elsewhere, and their outputs are zero (their blocks
    are computed with a held weight and masked), so no zero-padded copy of the weights is made."""

    #: ``weight`` may be stored in half precision (cast per chunk).
    takes_half_weights = True
    #: ``group_sizes`` may have the two groups of experts held elsewhere (zero outputs).
    takes_outside_groups = True

    def __init__(self, weight_grad: bool = True):
        super().__init__()
        self.matmul = _ChunkedBlockMatmul(weight_grad)

    def expert_of_blocks(self, x_NbF, w_EOF, group_sizes_G):
        """Each block's row of ``w_EOF`` and, when ``group_sizes_G`` has the outside groups, ``[N, 1, 1]``
        ones for the blocks of held experts and zeros for the others (else None)."""
        num_held = w_EOF.shape[0]
        outside = group_sizes_G.shape[0] == num_held + 2
        group_N = block_experts(x_NbF.shape[0], x_NbF.shape[1], group_sizes_G.shape[0], group_sizes_G)
        if not outside:
            return ops.stop_gradient(group_N), None
        held_N = ops.logical_and(group_N >= 1, group_N <= num_held)
        expert_N = ops.clip_by_value(group_N - 1, 0, num_held - 1)
        held_N11 = held_N.astype(x_NbF.dtype).reshape(-1, 1, 1)
        return ops.stop_gradient(expert_N), ops.stop_gradient(held_N11)

    def whole(self, x_NbF, w_EOF, expert_N):
        """One gather of every block's weight: for the serving graphs, whose block count is only known when
        they run (no static chunks) and which have no backward."""
        if w_EOF.dtype == ms.bfloat16:  # no bf16 Gather on CPU
            w_EOF = w_EOF.astype(x_NbF.dtype)
        return self.matmul.bmm_nt(x_NbF, ops.gather(w_EOF, expert_N, 0).astype(x_NbF.dtype))

    def _run(self, x_NbF, w_EOF, group_sizes_G, scale_Nb):
        expert_N, held_N11 = self.expert_of_blocks(x_NbF, w_EOF, group_sizes_G)
        if not F.isconstant(x_NbF.shape[0]):
            y_NbO = self.whole(x_NbF, w_EOF, expert_N)
        else:
            if scale_Nb is None:
                scale_Nb = ops.ones(x_NbF.shape[:2], x_NbF.dtype)
            y_NbO = self.matmul(x_NbF, w_EOF, expert_N, scale_Nb)
        if held_N11 is None:
            return y_NbO
        return y_NbO * held_N11

    def construct(self, x_NbF, w_EOF, group_sizes_G):
        return self._run(x_NbF, w_EOF, group_sizes_G, None)


class RowScaledBlockGroupedMatmul(BlockGroupedMatmul):
    """:class:`BlockGroupedMatmul` whose backward scales row r's share of the weight gradient by
    ``scale [N, b]`` (gradient isolation's ``token_grad``; see ``RowScaledWeightGradMatmul``)."""

    def construct(self, x_NbF, w_EOF, group_sizes_G, scale_Nb):
        return self._run(x_NbF, w_EOF, group_sizes_G, scale_Nb)
