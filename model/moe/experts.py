"""Routed experts stored as 3-D weights, one SwiGLU per expert.

Weights use the per-expert HF layout ``[E, out, in]`` (``gate_proj``/``up_proj``
``[E, I, H]``, ``down_proj`` ``[E, H, I]``) so a HF ``mlp.experts.{e}.*_proj.weight``
is row e of the stacked tensor.

Shape legend: E experts (``e`` when a process holds a share of them), C rows per expert (capacity
slots or all tokens), N blocks of b expert-sorted rows (grouped dispatch), H hidden, I expert width,
F / O input / output features of one projection.
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindmoe.model import kernels
from mindmoe.model.deferred_init import is_deferred, rows_of
from mindmoe.model.kernels.cpu_token_experts import ProjectionSpec
from mindmoe.model.linear import is_half, normal_init
from mindmoe.model.lora import EXPERT_PROJECTIONS
from mindmoe.model.weights import add_seams


class RowScaledWeightGradMatmul(nn.Cell):
    """``x @ w^T`` per expert whose backward scales row c's share of ``dw`` by ``scale[e, c]``.

    This is gradient isolation's ``token_grad`` mode: a locked token still passes its full
    gradient back to the activations (and so to the router and earlier layers), but trains
    the expert weights it was locked to only with weight lambda. ``Cell.bprop`` is used
    because hooks are dropped under jit and ``ops.custom_vjp`` does not exist.
    """

    def __init__(self):
        super().__init__()
        self.forward_bmm = ops.BatchMatMul(transpose_b=True)
        self.input_grad_bmm = ops.BatchMatMul()
        self.weight_grad_bmm = ops.BatchMatMul(transpose_a=True)

    def construct(self, x_ECF, w_EOF, scale_EC):
        return self.forward_bmm(x_ECF, w_EOF)

    def bprop(self, x_ECF, w_EOF, scale_EC, out, dout_ECO):
        dx_ECF = self.input_grad_bmm(dout_ECO, w_EOF)
        dw_EOF = self.weight_grad_bmm(dout_ECO * scale_EC.expand_dims(-1).astype(dout_ECO.dtype), x_ECF)
        return dx_ECF, dw_EOF, ops.zeros_like(scale_EC)


class BatchedMatmul(nn.Cell):
    """``x @ w^T`` per expert, the :class:`RowScaledWeightGradMatmul` signature with its autodiff backward: the row
    scale is not used (experts built without gradient isolation)."""

    def __init__(self):
        super().__init__()
        self.bmm = ops.BatchMatMul(transpose_b=True)

    def construct(self, x_ECF, w_EOF, scale_EC):
        return self.bmm(x_ECF, w_EOF)


def _held_rows(weight_EOF, held_experts):
    if held_experts is None or len(held_experts) == weight_EOF.shape[0]:
        return weight_EOF
    if is_deferred(weight_EOF):  # built for a checkpoint: the other rows never exist
        return rows_of(weight_EOF, held_experts)
    rows = weight_EOF.astype(ms.float32).asnumpy()[held_experts.start : held_experts.stop]  # numpy has no bf16
    return Tensor(rows, dtype=weight_EOF.dtype)


class RoutedExperts(nn.Cell):
    """``(x, group_sizes, row_scale) -> y``: expert e applied to row-block e of ``x [E, C, H]`` (``group_sizes``
    None: one batched matmul per projection), or to group e of expert-sorted rows ``x [N, b, H]`` in groups of
    ``group_sizes [E]`` (of all E experts; a process holding a share runs only its own: one grouped matmul per
    projection). The arguments are what a dispatcher's ``expert_args`` returns.

    ``row_scaled`` (gradient isolation's ``token_grad``, fixed at build): every product whose weights train takes
    ``row_scale`` (``[E, C]`` or ``[N, b]``), by which it scales each row's share of its weight gradient; otherwise
    the products ignore it. Each projection is one product either way, its kernel chosen here.

    ``held_experts`` (a range of expert indices, default all): the experts this process holds. The
    initial weights are drawn for all ``num_experts`` and sliced, so a process holding a share starts
    from the rows a single process would (and the random stream of later parameters is the same).
    ``first_expert`` is the index of row 0 among all experts. ``dtypes``: storage dtype per projection name
    (default fp32); a half weight (``lora.base_dtype``) is up-cast per call to the input's dtype.
    ``frozen``: the projection names whose weights never train (a LoRA base); their grouped matmuls compute
    no weight gradient.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        std: float,
        rng: np.random.Generator,
        held_experts: range = None,
        dtypes: dict = None,
        frozen: tuple = (),
        row_scaled: bool = False,
    ):
        super().__init__()
        self.row_scaled = row_scaled
        self.first_expert = 0 if held_experts is None else held_experts.start
        self.num_experts = num_experts
        self.num_held = num_experts if held_experts is None else len(held_experts)
        dtypes = dtypes or {}
        gate_dtype, up_dtype, down_dtype = (dtypes.get(p, ms.float32) for p in ("gate_proj", "up_proj", "down_proj"))
        self.gate_proj = Parameter(
            _held_rows(normal_init((num_experts, intermediate_size, hidden_size), std, rng, gate_dtype), held_experts),
            name="gate_proj",
        )
        self.up_proj = Parameter(
            _held_rows(normal_init((num_experts, intermediate_size, hidden_size), std, rng, up_dtype), held_experts),
            name="up_proj",
        )
        self.down_proj = Parameter(
            _held_rows(normal_init((num_experts, hidden_size, intermediate_size), std, rng, down_dtype), held_experts),
            name="down_proj",
        )
        add_seams(self, "gate_proj", "up_proj", "down_proj")
        self.half_weights = any(is_half(d) for d in (gate_dtype, up_dtype, down_dtype))
        self.bmm = RowScaledWeightGradMatmul() if row_scaled else BatchedMatmul()
        # Projections whose weights never train (a LoRA base): their grouped matmul computes no weight gradient.
        self.gate_proj_frozen, self.up_proj_frozen, self.down_proj_frozen = (
            p in frozen for p in ("gate_proj", "up_proj", "down_proj")
        )
        for proj in ("gate_proj", "up_proj", "down_proj"):
            self.add_grouped_site(proj, proj in frozen)
        self.activation = kernels.swiglu()
        self.pad_other_experts = ops.Pad(((1, 1), (0, 0), (0, 0)))
        self.token_kernel = None  # build_token_kernel

    def token_specs(self):
        """The :class:`~model.kernels.cpu_token_experts.ProjectionSpec` of each projection, or None when a frozen
        weight cannot be read on the host (bf16: NumPy has none)."""
        specs = []
        for proj in EXPERT_PROJECTIONS:
            weight = getattr(self, proj)
            if getattr(self, proj + "_frozen"):
                if weight.dtype not in (ms.float16, ms.float32):
                    return None
                specs.append(ProjectionSpec(frozen_weight=weight))
            else:
                specs.append(ProjectionSpec(trainable=True))
        return specs

    def token_shapes(self):
        """Per projection ``(weight, lora_A, lora_B)`` shapes (None for an absent adapter)."""
        return [(tuple(getattr(self, p).shape), None, None) for p in EXPERT_PROJECTIONS]

    def build_token_kernel(self, top_k: int) -> bool:
        """Create the device's tokens-to-tokens kernel (:func:`model.kernels.token_experts`) for :meth:`tokens`;
        False where the device has none (Ascend: the grouped path) or a frozen weight is bf16 on the host."""
        specs = self.token_specs()
        if specs is not None:
            scaling = getattr(self, "scaling", 1.0)
            self.token_kernel = kernels.token_experts(
                specs, self.token_shapes(), scaling, self.num_experts, self.first_expert, self.num_held, top_k
            )
        return self.token_kernel is not None

    def token_slots(self, proj: str, num_rows: int):
        """``(weight, lora_A, lora_B, row_Z, col_F)`` of ``proj`` for the token kernel: a frozen weight is read in
        place (a placeholder here), and this class has no adapters."""
        weight = ops.zeros((1,), ms.float32) if getattr(self, proj + "_frozen") else self.held_weight(proj)
        if weight.dtype != ms.float32:
            weight = weight.astype(ms.float32)
        none_f32, none_i32 = ops.zeros((1,), ms.float32), ops.zeros((1,), ms.int32)
        return weight, none_f32, none_f32, none_i32, none_i32

    def tokens(self, x_TH, topk_TK, row_A, sources_1, weight_TK, scale_T, num_rows: int):
        """``y [T, H] = sum_k weight_tk * expert_{topk_tk}(x_t)`` over this process's experts in one kernel
        (:meth:`build_token_kernel`); ``row_A`` ([T * K] int32) and ``num_rows``: each assignment's row in the
        expert-sorted buffer and its rows (they key the adapters' dropout masks); ``sources_1`` ([1] int32): the number
        of ranks whose tokens ``x_TH`` concatenates; ``scale_T`` scales each token's share of the weight gradients."""
        g = self.token_slots("gate_proj", num_rows)
        u = self.token_slots("up_proj", num_rows)
        d = self.token_slots("down_proj", num_rows)
        return self.token_kernel(
            x_TH, topk_TK, row_A, sources_1, weight_TK, scale_T,
            g[0], g[1], g[2], g[3], g[4], u[0], u[1], u[2], u[3], u[4], d[0], d[1], d[2], d[3], d[4],
        )  # fmt: skip

    def add_grouped_site(self, site: str, frozen: bool):
        """The grouped matmul of product ``site`` (an instance of a grouped kernel may keep what its forward took for
        its backward, so every product has its own): no weight gradient when ``frozen``, its weight gradient scaled
        per row when the experts are ``row_scaled``."""
        if self.row_scaled and not frozen:
            gmm = kernels.grouped_matmul_row_scaled()
        else:
            frozen_weight = getattr(self, site) if frozen else None  # read in place by a host kernel
            gmm = kernels.grouped_matmul(weight_grad=not frozen, frozen_weight=frozen_weight)
        setattr(self, f"{site}_gmm", gmm)

    def expert_matmul(self, x, w_EOF, scale, group_sizes, site: str):
        """``x @ w_e^T`` per expert: on an ``[E, C, F]`` buffer (``group_sizes`` None) or on grouped rows (the
        kernel of product ``site``, :meth:`add_grouped_site`); ``scale`` (or None) as ``row_scale``."""
        gmm = getattr(self, site + "_gmm")
        # The CPU grouped kernel casts each expert's half weight itself: no fp32 copy of the experts.
        if self.half_weights and not (group_sizes is not None and gmm.takes_half_weights):
            w_EOF = w_EOF.astype(x.dtype)
        if group_sizes is None:
            return self.bmm(x, w_EOF, scale)
        if self.num_held < self.num_experts and not gmm.takes_outside_groups:
            # Zero weights for the groups of the experts other processes hold (see held_groups); the CPU
            # kernel takes those groups as they are and masks their outputs (no padded weight copy, which
            # the backward would keep per projection and layer).
            # The Pad primitive: in MindSpore 2.9 the gradient of ``ops.pad`` (PadV3) is zero from the second
            # call of a compiled graph on; a concat with zero tensors failed kernel selection in the fused
            # train step on CPU (an input of type None).
            w_EOF = self.pad_other_experts(w_EOF)
        return gmm(x, w_EOF, group_sizes, scale)

    def held_groups(self, group_sizes_E):
        """Group sizes over this process's experts: with a share, the rows of the experts before and after
        it become one group each (run with zero weights, so their outputs are zero here)."""
        if self.num_held == self.num_experts:
            return group_sizes_E
        expert_E = ops.arange(self.num_experts, dtype=ms.int32)
        last = self.first_expert + self.num_held
        before = (group_sizes_E * (expert_E < self.first_expert).astype(ms.int32)).sum(keepdims=True)
        after = (group_sizes_E * (expert_E >= last).astype(ms.int32)).sum(keepdims=True)
        return ops.concat((before, group_sizes_E[self.first_expert : last], after), 0)

    def held_weight(self, proj: str):
        """The held experts' weights ``[E_held, O, F]`` of projection ``proj`` as the forward reads them
        (model/weights.py)."""
        return getattr(self, proj + "_full")(getattr(self, proj))

    def _forward(self, x, scale, group_sizes):
        gate = self.expert_matmul(x, self.held_weight("gate_proj"), scale, group_sizes, "gate_proj")
        up = self.expert_matmul(x, self.held_weight("up_proj"), scale, group_sizes, "up_proj")
        down = self.held_weight("down_proj")
        return self.expert_matmul(self.activation(gate, up), down, scale, group_sizes, "down_proj")

    def construct(self, x, group_sizes=None, row_scale=None):
        if group_sizes is None:
            return self._forward(x, row_scale, None)
        return self._forward(x, row_scale, self.held_groups(group_sizes))


def routed_expert_cells(model) -> list:
    """Every :class:`RoutedExperts` of ``model`` (its MoE layers' and its multi-token-prediction depths'), in the
    model's order. Their parameters are the expert tensors: the stacked weights and their LoRA factors, each with the
    held experts on its first axis. The gradient norm, the expert-parallel views and checkpoint loading all take the
    expert tensors from here."""
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, RoutedExperts)]
