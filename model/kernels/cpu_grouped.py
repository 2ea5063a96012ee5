"""CPU grouped matmul: each expert's rows times that expert's weight, one host matrix product per expert
(large experts) or one BatchMatMul of every block's gathered weight (small experts).

Shape legend (docs/architecture.md): E groups (experts), N blocks, b rows per block, X = N * b sorted
rows, F input features, O output features.

For large experts the training graph calls one host kernel per product (``ops.Custom`` of type ``pyfunc``:
MindSpore runs a Python function on the arrays of its inputs, in the graph): for each group of rows with its
weight it runs
``rows @ weight[e]^T`` (forward), ``dout @ weight[e]`` (input gradient) and ``(scale * dout)^T @ rows``
(weight gradient) in NumPy's BLAS, in fp32 (whole experts per thread over the process's cores, each product on one
BLAS thread: ``host_threads.py``, as the token kernel's). So the cost is the routed FLOPs of the rows received, a
half-precision weight (a frozen LoRA base) is up-cast one expert at a time, the groups of experts held
elsewhere cost nothing, and the graph has three nodes per projection whatever the number of experts.
The kernel it replaced for them gathered every block's expert weight (``O / b`` times the rows it multiplies)
and ran BatchMatMuls in chunks of blocks: its graph had five nodes per chunk and MindSpore's compiled
graph kept about 3 MiB of host memory per chunk, more than the experts' weights on a GLM-4.5-Air-shaped
model, the same on every expert-parallel rank (each ran every row's blocks and masked the others').

The dispatcher still pads every expert's group of sorted rows to a multiple of ``b`` (:func:`block_rows`).
Where the experts are small beside the rows (a gathered block weight ``[O, F]`` at most
:data:`GATHER_RATIO` times a block's rows in and out, ``b (F + O)``, and all of them under
:data:`GATHER_BYTES`), the training graph instead gathers each block's expert weight and runs one
BatchMatMul, in MindSpore ops (:class:`_GatheredBlockMatmul`): a host kernel's fixed cost per expert
(a Python call and a NumPy product of a few rows) and its copies of the inputs would then cost more than
the products. The serving graphs, whose row count is only known when they run (a ``pyfunc`` kernel needs
static shapes, and an exported MindIR must hold MindSpore ops only), always gather
(:meth:`BlockGroupedMatmul.whole`).
"""

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.ops import functional as F

from mindmoe.model.kernels.host_threads import map_experts

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


#: Gather the blocks' weights when a block's weight ``O * F`` is at most this times its rows' ``b * (F + O)``.
GATHER_RATIO = 2
#: ... and the gathered fp32 weights of all blocks are at most this many bytes ...
GATHER_BYTES = 64 * 2**20
#: ... and the weight is at least this wide both ways: a rank-r LoRA factor's products (a few rows times r
#: columns per expert) cost little on either path, and on the host kernel an expert-parallel share runs only
#: its own experts' rows (the gathered path multiplies every block and masks the others').
GATHER_MIN_WIDTH = 32


def gathers_weights(num_blocks: int, block: int, out_features: int, in_features: int) -> bool:
    """Whether a static-shape product of ``num_blocks`` blocks of ``block`` rows runs as one gathered
    BatchMatMul (:class:`_GatheredBlockMatmul`) rather than on the host kernel. Plain integer arithmetic:
    it runs while a graph compiles."""
    per_block = out_features * in_features
    small = per_block <= GATHER_RATIO * block * (in_features + out_features)
    wide = out_features >= GATHER_MIN_WIDTH and in_features >= GATHER_MIN_WIDTH
    return small and wide and num_blocks * per_block * 4 <= GATHER_BYTES


def block_experts(num_blocks: int, block: int, num_experts: int, group_sizes_E):
    """The expert of every block: the number of groups that end at or before the block's first row."""
    ends_1E = ops.cumsum(group_sizes_E, 0).astype(ms.float32).expand_dims(0)
    starts_N1 = (ops.arange(num_blocks, dtype=ms.int32) * block).astype(ms.float32).expand_dims(1)
    expert_N = (ends_1E <= starts_N1).astype(ms.int32).sum(1)
    return ops.minimum(expert_N, num_experts - 1)


def held_groups(sizes_G, num_weights: int):
    """``[(e, start, stop), ...]``: the rows of weight e, for every weight with rows. ``sizes_G`` has one size per
    weight or, for a process holding a share of the experts, ``num_weights + 2``: the first and last groups are
    the rows of experts held elsewhere, and no weight is theirs."""
    sizes = np.asarray(sizes_G, np.int64)
    if len(sizes) not in (num_weights, num_weights + 2):
        raise ValueError(f"grouped matmul: {len(sizes)} group sizes for {num_weights} weights")
    first = 1 if len(sizes) == num_weights + 2 else 0
    ends = np.cumsum(sizes)
    groups = []
    for e in range(num_weights):
        stop = int(ends[first + e])
        start = stop - int(sizes[first + e])
        if stop > start:
            groups.append((e, start, stop))
    return groups


def _group_rows(group):
    """Rows of a held group ``(e, start, stop)``: the load :func:`map_experts` balances."""
    return group[2] - group[1]


def _fp32(array):
    return array if array.dtype == np.float32 else array.astype(np.float32)


def host_products(rows_NbX, w_EOF, sizes_G, transpose_weight: bool):
    """Row r of group e times ``w[e]^T`` (``transpose_weight``, the forward: ``[N, b, O]``) or ``w[e]`` (the input
    gradient: ``[N, b, F]``); the rows of no held weight give zeros. fp32 products, in the rows' dtype."""
    rows_XI = rows_NbX.reshape(-1, rows_NbX.shape[-1])
    width = w_EOF.shape[1] if transpose_weight else w_EOF.shape[2]
    out_XW = np.zeros((rows_XI.shape[0], width), np.float32)

    def run(groups):
        for e, start, stop in groups:
            weight = _fp32(w_EOF[e])
            out_XW[start:stop] = _fp32(rows_XI[start:stop]) @ (weight.T if transpose_weight else weight)

    map_experts(run, held_groups(sizes_G, w_EOF.shape[0]), _group_rows)
    return out_XW.astype(rows_NbX.dtype, copy=False).reshape(rows_NbX.shape[:2] + (width,))


def host_weight_grad(dout_NbO, x_NbF, sizes_G, scale_Nb, num_weights: int):
    """``[E, O, F]`` fp32: the sum over group e's rows r of ``scale_r dout_r^T x_r``; zero for a weight with no rows."""
    dout_XO = dout_NbO.reshape(-1, dout_NbO.shape[-1])
    x_XF = x_NbF.reshape(-1, x_NbF.shape[-1])
    scale_X1 = _fp32(scale_Nb.reshape(-1, 1))
    grad_EOF = np.zeros((num_weights, dout_XO.shape[1], x_XF.shape[1]), np.float32)

    def run(groups):
        for e, start, stop in groups:
            grad_EOF[e] = (_fp32(dout_XO[start:stop]) * scale_X1[start:stop]).T @ _fp32(x_XF[start:stop])

    map_experts(run, held_groups(sizes_G, num_weights), _group_rows)
    return grad_EOF


def _host_kernel(function, out_shape, out_dtype):
    return ops.Custom(function, out_shape=out_shape, out_dtype=out_dtype, func_type="pyfunc")


class _HostGroupedMatmul(nn.Cell):
    """``(x [N, b, F], w [E, O, F], group_sizes [G], scale [N, b]) -> [N, b, O]`` on the host kernels; the backward
    scales row r's share of the weight gradient by ``scale_r``. ``weight_grad=False`` (a frozen weight, e.g. a LoRA
    base): the backward computes the input gradient only.

    MindSpore's ``pyfunc`` kernel keeps a host copy of each of its inputs for as long as the compiled graph
    lives (refreshed at every launch; the function receives views of it). The forward keeps views of its
    inputs and the backward kernels read ``x``, ``w`` and the group sizes from them instead of taking them
    again: one copy of the weight and of the rows per instance, not three. So an instance serves one call
    site (its backward runs after its forward, ordered explicitly; a recomputed forward has the same
    inputs). Likewise the weight gradient's kernel reads the output gradient the input gradient's kernel took
    (ordered after it). The zero int8 inputs of the backward kernels (``[F]``, ``[E, O]``) only carry their
    output shapes.

    ``frozen_weight`` (the Parameter of a weight that never trains, fp16 or fp32; ``weight_grad=False``):
    the forward kernel does not take the weight but reads the Parameter's host memory in place at every
    launch (``asnumpy`` is a view on CPU, of the buffer the compiled graphs hold), so no graph keeps a copy
    of it. On a GLM-4.5-Air-shaped LoRA base each graph (training and evaluation) otherwise kept a host copy
    of every routed expert. (``set_data`` after compiling gives the Parameter a new buffer, which MindSpore
    2.9's compiled graphs do not see, this kernel would: the trainer sets frozen weights before compiling.)"""

    def __init__(self, weight_grad: bool = True, frozen_weight=None):
        super().__init__()
        if frozen_weight is not None and weight_grad:
            raise ValueError("grouped matmul: a frozen_weight is read in place and gets no weight gradient")
        self.weight_grad = weight_grad
        self.reads_frozen_weight = frozen_weight is not None
        self.cast = ops.Cast()
        inputs = {}

        def forward(x_NbF, w_EOF, sizes_G):
            inputs.update(x=x_NbF, w=w_EOF, sizes=sizes_G)
            return host_products(x_NbF, w_EOF, sizes_G, True)

        def forward_frozen(x_NbF, sizes_G):
            return forward(x_NbF, frozen_weight.asnumpy(), sizes_G)

        def input_grad(dout_NbO, width_F):
            inputs.update(dout=dout_NbO)
            return host_products(dout_NbO, inputs["w"], inputs["sizes"], False)

        def weight_grad_of(scale_Nb, shape_EO, width_F):
            return host_weight_grad(inputs["dout"], inputs["x"], inputs["sizes"], scale_Nb, inputs["w"].shape[0])

        self.forward = _host_kernel(forward, lambda x, w, g: x[:2] + [w[1]], lambda x, w, g: x)
        if frozen_weight is not None:
            width_O = frozen_weight.shape[1]
            self.forward_frozen = _host_kernel(forward_frozen, lambda x, g: x[:2] + [width_O], lambda x, g: x)
        self.input_grad = _host_kernel(input_grad, lambda d, f: d[:2] + f, lambda d, f: d)
        self.weight_grad_of = _host_kernel(
            weight_grad_of, lambda s, c, f: [c[0], c[1], f[0]], lambda s, c, f: ms.float32
        )

    def construct(self, x_NbF, w_EOF, sizes_G, scale_Nb):
        if self.reads_frozen_weight:
            return self.forward_frozen(x_NbF, sizes_G)
        return self.forward(x_NbF, w_EOF, sizes_G)

    def bprop(self, x_NbF, w_EOF, sizes_G, scale_Nb, out, dout_NbO):
        # The output gradient need not depend on the forward's values (a linear loss): order them explicitly.
        dout_NbO = ops.depend(dout_NbO, out)
        width_F = ops.zeros((x_NbF.shape[2],), ms.int8)
        dx_NbF = self.input_grad(dout_NbO, width_F)
        if not self.weight_grad:
            return dx_NbF, ops.zeros_like(w_EOF), ops.zeros_like(sizes_G), ops.zeros_like(scale_Nb)
        # It reads the output gradient the input gradient's kernel took (ordered after it): no second copy.
        scale_Nb = ops.depend(scale_Nb, dx_NbF)
        dw_EOF = self.weight_grad_of(scale_Nb, ops.zeros(w_EOF.shape[:2], ms.int8), width_F)
        return dx_NbF, self.cast(dw_EOF, w_EOF.dtype), ops.zeros_like(sizes_G), ops.zeros_like(scale_Nb)


class _GatheredBlockMatmul(nn.Cell):
    """``(x [N, b, F], w [E, O, F], expert_N [N], scale [N, b]) -> [N, b, O]``: each block's rows times the weight of
    its expert ``expert_N``, gathered, in one BatchMatMul; the backward gathers again for the input gradient and
    sums each block's ``dout^T x`` (``row_scaled``: ``(scale * dout)^T x``; else ``scale`` is unused) into its
    expert's weight gradient. ``weight_grad=False`` (a frozen weight): the input gradient only. Primitives only:
    functional ops do not compile in a bprop. The row scale is tiled to ``dout``'s shape: a ``[N, b, 1]`` operand
    broadcast by the multiplication would keep 16 bytes per element for the graph's life on CPU."""

    def __init__(self, weight_grad: bool = True, row_scaled: bool = False):
        super().__init__()
        self.weight_grad = weight_grad
        self.row_scaled = row_scaled
        self.tile = ops.Tile()
        self.gather = ops.Gather()
        self.cast = ops.Cast()
        self.segment_sum = ops.UnsortedSegmentSum()
        self.bmm_nt = ops.BatchMatMul(transpose_b=True)
        self.bmm_nn = ops.BatchMatMul()
        self.bmm_tn = ops.BatchMatMul(transpose_a=True)

    def gathered(self, w_EOF, expert_N, dtype):
        if w_EOF.dtype == ms.bfloat16:  # no bf16 Gather on CPU: one whole cast
            w_EOF = self.cast(w_EOF, dtype)
        return self.cast(self.gather(w_EOF, expert_N, 0), dtype)

    def construct(self, x_NbF, w_EOF, expert_N, scale_Nb):
        return self.bmm_nt(x_NbF, self.gathered(w_EOF, expert_N, x_NbF.dtype))

    def bprop(self, x_NbF, w_EOF, expert_N, scale_Nb, out, dout_NbO):
        dx_NbF = self.bmm_nn(dout_NbO, self.gathered(w_EOF, expert_N, dout_NbO.dtype))
        if not self.weight_grad:
            return dx_NbF, ops.zeros_like(w_EOF), ops.zeros_like(expert_N), ops.zeros_like(scale_Nb)
        scaled_NbO = dout_NbO
        if self.row_scaled:
            scale_Nb1 = self.cast(scale_Nb, dout_NbO.dtype).expand_dims(-1)
            scaled_NbO = dout_NbO * self.tile(scale_Nb1, (1, 1, dout_NbO.shape[2]))
        dw_EOF = self.segment_sum(self.bmm_tn(scaled_NbO, x_NbF), expert_N, w_EOF.shape[0])
        return dx_NbF, self.cast(dw_EOF, w_EOF.dtype), ops.zeros_like(expert_N), ops.zeros_like(scale_Nb)


class BlockGroupedMatmul(nn.Cell):
    """``(x [N, b, F], weight [E, O, F], group_sizes [E] int32) -> [N, b, O]``: row r of group e times
    ``weight[e]^T``. Group sizes are multiples of b, in row order; rows past the last group are padding
    (zeros in, zeros out). ``weight`` may be half precision (up-cast one expert at a time).

    A process holding a share of the experts may pass ``E + 2`` group sizes for its ``E`` weights: the
    first and last groups are the rows of experts held elsewhere; their outputs are zero and cost nothing."""

    #: ``weight`` may be stored in half precision.
    takes_half_weights = True
    #: ``group_sizes`` may have the two groups of experts held elsewhere (zero outputs).
    takes_outside_groups = True
    #: The backward scales each row's share of the weight gradient (:class:`RowScaledBlockGroupedMatmul`).
    row_scaled = False

    def __init__(self, weight_grad: bool = True, frozen_weight=None):
        super().__init__()
        if frozen_weight is not None and frozen_weight.dtype not in (ms.float16, ms.float32):
            frozen_weight = None  # NumPy has no bf16: such a weight is cast in the graph and taken as an input
        self.matmul = _HostGroupedMatmul(weight_grad, frozen_weight)
        self.gathered_matmul = _GatheredBlockMatmul(weight_grad, self.row_scaled)

    def whole(self, x_NbF, w_EOF, group_sizes_G):
        """One gather of every block's weight and one BatchMatMul: for the serving graphs, whose block count is
        only known when they run and which have no backward."""
        expert_N, held_NbO = self.expert_of_blocks(x_NbF, w_EOF, group_sizes_G)
        gathered = self.gathered_matmul
        y_NbO = gathered.bmm_nt(x_NbF, gathered.gathered(w_EOF, expert_N, x_NbF.dtype))
        return y_NbO if held_NbO is None else y_NbO * held_NbO

    def expert_of_blocks(self, x_NbF, w_EOF, group_sizes_G):
        """Each block's row of ``w_EOF`` and, when ``group_sizes_G`` has the outside groups, ``[N, b, O]`` ones
        for the blocks of held experts and zeros for the others (else None)."""
        num_held = w_EOF.shape[0]
        group_N = block_experts(x_NbF.shape[0], x_NbF.shape[1], group_sizes_G.shape[0], group_sizes_G)
        if group_sizes_G.shape[0] == num_held:
            return ops.stop_gradient(group_N), None
        held_N11 = ops.logical_and(group_N >= 1, group_N <= num_held).astype(x_NbF.dtype).reshape(-1, 1, 1)
        expert_N = ops.clip_by_value(group_N - 1, 0, num_held - 1)
        # Tiled to the output's shape: a broadcast multiplication keeps 16 bytes per element on CPU.
        held_NbO = ops.tile(held_N11, (1, x_NbF.shape[1], w_EOF.shape[1]))
        return ops.stop_gradient(expert_N), ops.stop_gradient(held_NbO)

    def _run(self, x_NbF, w_EOF, group_sizes_G, scale_Nb):
        if not F.isconstant(x_NbF.shape[0]):
            return self.whole(x_NbF, w_EOF, group_sizes_G)
        if gathers_weights(x_NbF.shape[0], x_NbF.shape[1], w_EOF.shape[1], w_EOF.shape[2]):
            expert_N, held_NbO = self.expert_of_blocks(x_NbF, w_EOF, group_sizes_G)
            if scale_Nb is None:
                scale_Nb = ops.ones(x_NbF.shape[:2], ms.float32)
            y_NbO = self.gathered_matmul(x_NbF, w_EOF, expert_N, scale_Nb)
            return y_NbO if held_NbO is None else y_NbO * held_NbO
        if w_EOF.dtype == ms.bfloat16:  # NumPy has no bf16: one whole cast
            w_EOF = w_EOF.astype(ms.float32)
        if scale_Nb is None:
            scale_Nb = ops.ones(x_NbF.shape[:2], ms.float32)
        return self.matmul(x_NbF, w_EOF, group_sizes_G, scale_Nb)

    def construct(self, x_NbF, w_EOF, group_sizes_G, scale_Nb=None):
        # ``scale_Nb``: the row scale a row-scaled product takes (:class:`RowScaledBlockGroupedMatmul`); unused here.
        return self._run(x_NbF, w_EOF, group_sizes_G, None)


class RowScaledBlockGroupedMatmul(BlockGroupedMatmul):
    """:class:`BlockGroupedMatmul` whose backward scales row r's share of the weight gradient by
    ``scale [N, b]`` (gradient isolation's ``token_grad``; see ``RowScaledWeightGradMatmul``)."""

    row_scaled = True

    def construct(self, x_NbF, w_EOF, group_sizes_G, scale_Nb):
        return self._run(x_NbF, w_EOF, group_sizes_G, scale_Nb)
