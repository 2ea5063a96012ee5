"""CPU routed experts from tokens to tokens: the whole SwiGLU of every held expert (with its LoRA adapters) in one
host kernel for the forward and one for the backward, so no expert row lives in a compiled graph.

Shape legend (docs/architecture.md): T tokens, H hidden, K experts per token, A = T * K assignments, E experts held
here, O / F output / input features of one projection, R adapter rank, X rows of the expert-sorted buffer.

The grouped path (dispatcher -> grouped matmuls -> combine) holds every sorted row ``[X, H]`` and ``[X, I]`` several
times in the graph, plus MindSpore's host copy of each ``pyfunc`` input, whatever share of the experts a process
holds: under ``parallel.ep`` (allgather) every rank keeps the whole sorted buffer, the rows of other ranks' experts
zero. Here the graph sees ``x [T, H]`` in and ``y [T, H]`` out; the kernel orders the assignments of its held experts
on the host by their rows of the grouped path (token order within an expert) and keeps, between its forward and its
backward, only what those rows need (the gate and up pre-activations, the expert outputs and the adapters' low-rank
products). A rank holding half of the experts keeps about half of the rows.

``y_t = sum_k w_tk * expert_{i_tk}(x_t)`` over the held experts (other experts contribute zero; a caller holding a
share sums ``y`` over the expert group), ``expert(x) = down(silu(gate(x)) * up(x))`` and each projection
``p(x) = x W^T + scaling * (drop(x) A^T) B^T`` with the adapter when it has one. ``drop`` is the LoRA dropout draw of
:mod:`model.lora.dropout`, keyed by each assignment's row in the expert-sorted buffer (``row_A``, an input: the rows
the graph computes for the grouped path, ``model.moe.dispatch.grouped_rows``): the masks the grouped path draws. The
kernel takes its order from those rows too (:func:`expert_order`), so the expert-sorted order has one definition.
The backward gives ``dx``, ``dw`` (the combine weights' gradient ``<dy_t, expert(x_t)>``), and the gradients of the
trainable base weights and of the adapters, each row's share scaled by the token's ``scale_T`` (gradient isolation's
``token_grad``; ones otherwise).
Products run in fp32 in NumPy's BLAS, each on one BLAS thread; the held experts are split over this process's cores
(:mod:`model.kernels.host_threads`), each thread's tokens summed in float64 apart and the threads' sums added.

Ascend has no such kernel (:func:`model.kernels.token_experts` is None there): GroupedMatmul runs the grouped path.
"""

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindmoe.model.kernels.cpu_grouped import _fp32
from mindmoe.model.kernels.dropout_mask import host_scaled_keep
from mindmoe.model.kernels.host_threads import map_experts


class ProjectionSpec:
    """What one projection of the experts is, fixed when the model is built: ``frozen_weight`` (the Parameter of a
    frozen fp16/fp32 base weight, read in place at every launch) or a weight taken as an input (``trainable``: it
    gets a gradient); ``lora`` (it has adapters); ``dropout`` (``(threshold, scale)`` of its adapter's dropout, or
    None)."""

    def __init__(self, frozen_weight=None, trainable: bool = False, lora: bool = False, dropout=None):
        self.frozen_weight = frozen_weight
        self.trainable = trainable
        self.lora = lora
        self.dropout = dropout


def _sigmoid(x):
    return 0.5 * (np.tanh(0.5 * x) + 1.0)


def _added(sums, shape):
    """The threads' float64 sums added (each exact, so in any order); zeros when no held expert has rows."""
    if not sums:
        return np.zeros(shape, np.float64)
    total = sums[0]
    for other in sums[1:]:
        total += other
    return total


def _rows(segment):
    """Rows of an expert segment ``(e, assignments, ...)``: the load :func:`map_experts` balances."""
    return segment[1].size


def expert_order(topk_TK, row_A, num_experts: int):
    """``(expert_A, order, counts_E)``: each flattened assignment's expert, the assignments in the order of their rows
    ``row_A`` in the expert-sorted buffer (distinct rows, by expert, token order within an expert) and each expert's
    count."""
    expert_A = np.asarray(topk_TK, np.int64).reshape(-1)
    return expert_A, np.argsort(np.asarray(row_A), kind="stable"), np.bincount(expert_A, minlength=num_experts)


def expert_groups(order, counts_E, first_expert: int, num_held: int):
    """``[(e, assignments), ...]``: for each held expert ``e`` (0-based here) with assignments, their indices into the
    flattened ``[A]`` in token order (``order``, ``counts_E``: :func:`expert_order`)."""
    ends = np.cumsum(counts_E)
    groups = []
    for e in range(num_held):
        g = first_expert + e
        if counts_E[g]:
            groups.append((e, order[ends[g] - counts_E[g] : ends[g]]))
    return groups


def source_segments(groups, top_k: int, num_tokens: int, sources: int):
    """``groups`` (:func:`expert_groups`) with each expert's assignments split by the token's source: the input's
    tokens are ``sources`` equal blocks, one per rank that sent them (1: one micro-batch). An expert's rows of each
    source are then multiplied apart, as a process running that source's micro-batch alone multiplies them, and its
    weight gradient adds the sources' products in order, as accumulating their micro-batches does: the same float32
    operations whatever the expert group."""
    if sources == 1:
        return groups
    if num_tokens % sources:
        raise ValueError(f"{num_tokens} tokens do not split into {sources} equal source blocks")
    bounds = np.arange(1, sources) * (num_tokens // sources)
    split = []
    for e, assignments in groups:
        # Token order within an expert: each source's assignments are one contiguous run.
        cuts = np.searchsorted(assignments // top_k, bounds)
        split += [(e, part) for part in np.split(assignments, cuts) if part.size]
    return split


class Projection:
    """The arrays of one projection for one launch: ``weight [E, O, F]``, adapters ``A [E, R, F]``, ``B [E, O, R]``
    (or None) and the dropout factors ``row_Z [X]``, ``col_F [F]`` (or None)."""

    def __init__(self, spec: ProjectionSpec, weight, lora_A, lora_B, row_Z, col_F, scaling: float):
        self.spec = spec
        self.weight = weight
        self.lora_A = _fp32(lora_A) if spec.lora else None
        self.lora_B = _fp32(lora_B) if spec.lora else None
        in_features = weight.shape[2]
        # A draw's factors cover the input's features; an evaluation graph passes none (no dropout there).
        self.drops = spec.lora and spec.dropout is not None and col_F.shape[0] == in_features and in_features > 1
        self.row_Z, self.col_F = row_Z, col_F
        self.scaling = np.float32(scaling)

    def mask(self, rows_n):
        threshold, scale = self.spec.dropout
        return host_scaled_keep(self.row_Z[rows_n], self.col_F, threshold, scale)

    def forward(self, e, x_nF, rows_n):
        """``(y [n, O], low [n, R] or None)``."""
        y_nO = x_nF @ _fp32(self.weight[e]).T
        if not self.spec.lora:
            return y_nO, None
        dropped_nF = x_nF * self.mask(rows_n) if self.drops else x_nF
        low_nR = dropped_nF @ self.lora_A[e].T
        y_nO += self.scaling * (low_nR @ self.lora_B[e].T)
        return y_nO, low_nR

    def backward(self, e, x_nF, rows_n, low_nR, dout_nO, scale_n1, grads):
        """The input gradient ``[n, F]``; adds this expert's weight and adapter gradients to ``grads``."""
        dx_nF = dout_nO @ _fp32(self.weight[e])
        scaled_nO = dout_nO * scale_n1
        if self.spec.trainable:
            grads["weight"][e] += scaled_nO.T @ x_nF
        if self.spec.lora:
            grads["lora_B"][e] += self.scaling * (scaled_nO.T @ low_nR)
            dlow_nR = self.scaling * (dout_nO @ self.lora_B[e])
            mask_nF = self.mask(rows_n) if self.drops else None
            dropped_nF = x_nF * mask_nF if self.drops else x_nF
            grads["lora_A"][e] += (dlow_nR * scale_n1).T @ dropped_nF
            ddropped_nF = dlow_nR @ self.lora_A[e]
            dx_nF += ddropped_nF * mask_nF if self.drops else ddropped_nF
        return dx_nF

    def zero_grads(self):
        grads = {}
        if self.spec.trainable:
            grads["weight"] = np.zeros(self.weight.shape, np.float32)
        if self.spec.lora:
            grads["lora_A"] = np.zeros(self.lora_A.shape, np.float32)
            grads["lora_B"] = np.zeros(self.lora_B.shape, np.float32)
        return grads


def token_experts_forward(
    x_TH, topk_TK, row_A, weight_TK, projections, num_experts, first_expert, num_held, sources: int = 1
):
    """``(y [T, H] float64, saved)``: the held experts' weighted outputs per token (``row_A [T * K]``: each
    assignment's row in the expert-sorted buffer) and what :func:`token_experts_backward` reads (per expert and token
    source with rows, :func:`source_segments`: its assignments, gate and up pre-activations, output and adapters'
    low-rank products).

    Each weighted output is a float32 product; a token's are added in float64, where a sum of a few float32 values is
    exact (unless their magnitudes span more than about 2**26), so it does not depend on the order of the terms nor on
    which process added which: an expert group's ranks return float64 partial sums, the group adds them in float64,
    and rounding once to float32 gives what one process holding every expert gives. The input gradient likewise."""
    gate, up, down = projections
    top_k = topk_TK.shape[1]
    weight_A = _fp32(weight_TK).reshape(-1)
    row_A = np.asarray(row_A, np.int64).reshape(-1)
    _, order, counts_E = expert_order(topk_TK, row_A, num_experts)
    groups = expert_groups(order, counts_E, first_expert, num_held)

    def run(part):
        y_TH = np.zeros((x_TH.shape[0], down.weight.shape[1]), np.float64)  # exact sums (above)
        saved = []
        for e, assignments in part:
            tokens, rows = assignments // top_k, row_A[assignments]
            x_nH = _fp32(x_TH[tokens])
            gate_nI, gate_low = gate.forward(e, x_nH, rows)
            up_nI, up_low = up.forward(e, x_nH, rows)
            out_nH, down_low = down.forward(e, gate_nI * _sigmoid(gate_nI) * up_nI, rows)
            # A token chooses distinct experts: its row appears once per expert, so this scatter has no collisions.
            y_TH[tokens] += weight_A[assignments, None] * out_nH
            saved.append((e, assignments, gate_nI, up_nI, out_nH, (gate_low, up_low, down_low)))
        return y_TH, saved

    parts = map_experts(run, source_segments(groups, top_k, x_TH.shape[0], sources), _rows)
    y_TH = _added([y for y, _ in parts], (x_TH.shape[0], down.weight.shape[1]))
    return y_TH, [entry for _, saved in parts for entry in saved]


def token_experts_backward(dy_TH, scale_T, x_TH, topk_TK, row_A, weight_TK, projections, saved):
    """``(dx [T, H] float64, dw [T, K], grads)`` (the rest fp32; ``dx`` summed over a token's experts as ``y`` is in
    :func:`token_experts_forward`), ``grads`` per projection: ``weight`` (trainable), ``lora_A``,
    ``lora_B`` (adapted), over the held experts."""
    top_k = topk_TK.shape[1]
    weight_A = _fp32(weight_TK).reshape(-1)
    scale_T1 = _fp32(scale_T).reshape(-1, 1)
    dy_TH = _fp32(dy_TH)
    dw_A = np.zeros(weight_A.shape, np.float32)
    grads = [p.zero_grads() for p in projections]
    gate, up, down = projections

    def run(part):
        dx_TH = np.zeros(x_TH.shape, np.float64)
        for e, assignments, gate_nI, up_nI, out_nH, (gate_low, up_low, down_low) in part:
            tokens, rows = assignments // top_k, row_A[assignments]
            dy_nH = dy_TH[tokens]
            scale_n1 = scale_T1[tokens]
            dw_A[assignments] = (dy_nH * out_nH).sum(1)
            dout_nH = dy_nH * weight_A[assignments, None]
            sig_nI = _sigmoid(gate_nI)
            silu_nI = gate_nI * sig_nI
            dh_nI = down.backward(e, silu_nI * up_nI, rows, down_low, dout_nH, scale_n1, grads[2])
            dgate_nI = dh_nI * up_nI * (sig_nI + silu_nI * (1.0 - sig_nI))
            dup_nI = dh_nI * silu_nI
            x_nH = _fp32(x_TH[tokens])
            dx_nH = gate.backward(e, x_nH, rows, gate_low, dgate_nI, scale_n1, grads[0])
            dx_nH += up.backward(e, x_nH, rows, up_low, dup_nI, scale_n1, grads[1])
            dx_TH[tokens] += dx_nH
        return dx_TH

    # An expert's saved segments stay on one thread, in order: its weight gradients add up as before.
    return _added(map_experts(run, saved, _rows), x_TH.shape), dw_A.reshape(weight_TK.shape), grads


_DUMMY = (1,)


class HostTokenExperts(nn.Cell):
    """``(x [T, H], topk [T, K] int32, row [T * K] int32, sources [1] int32, weight [T, K], scale [T], then per
    projection (gate, up, down): weight, lora_A, lora_B, row_Z, col_F) -> y [T, H]``; ``row``: each assignment's row in
    the grouped path's expert-sorted buffer (the kernel's order and the key of its dropout masks), ``sources``: the
    number of ranks whose tokens ``x`` concatenates (:func:`source_segments`; 1: one micro-batch); on the host
    (module docstring). A projection's slot it does not use holds a ``[1]`` placeholder: the base weight of a frozen
    one (read in place from its Parameter: no graph keeps a copy), the adapters of one without, the dropout factors
    when there is no draw. ``y`` (and the input gradient) have ``x``'s dtype: a float64 ``x`` (an expert group's
    tokens) gets the float64 sums of its held experts' outputs, which the group adds before rounding
    (:func:`token_experts_forward`).
    ``shapes``: per projection the static ``(weight, lora_A, lora_B)`` shapes of the held experts (None if absent).

    The forward keeps views of its inputs (MindSpore's ``pyfunc`` keeps a host copy of each for the graph's life)
    and what the backward needs; the backward, ordered after it, reads them and frees what it kept. So one instance
    serves one MoE layer."""

    def __init__(self, specs, shapes, scaling: float, num_experts: int, first_expert: int, num_held: int, top_k: int):
        super().__init__()
        self.specs = tuple(specs)
        # Static flags per projection for the bprop (plain tuples: the graph reads them as constants).
        self.trainable = tuple(bool(spec.trainable) for spec in self.specs)
        self.adapted = tuple(bool(spec.lora) for spec in self.specs)
        self.cast = ops.Cast()
        state = {}

        def projections(arrays):
            built = []
            for i, spec in enumerate(self.specs):
                weight, lora_A, lora_B, row_Z, col_F = arrays[5 * i : 5 * i + 5]
                if spec.frozen_weight is not None:
                    weight = spec.frozen_weight.asnumpy()  # a view of the buffer the compiled graphs hold
                built.append(Projection(spec, weight, lora_A, lora_B, row_Z, col_F, scaling))
            return built

        def forward(
            x, topk, row_A, sources, weight_TK, scale, gw, ga, gb, gz, gf, uw, ua, ub, uz, uf, dw, da, db, dz, df
        ):
            projs = projections((gw, ga, gb, gz, gf, uw, ua, ub, uz, uf, dw, da, db, dz, df))
            state.clear()
            if row_A.shape != (topk.size,) or sources.shape != (1,):
                raise ValueError(
                    f"token experts: row must be [{topk.size}] and sources [1], got {row_A.shape} and {sources.shape}"
                )
            y_TH, saved = token_experts_forward(
                x, topk, row_A, weight_TK, projs, num_experts, first_expert, num_held, int(sources[0])
            )
            state.update(x=x, topk=topk, row_A=row_A, weight=weight_TK, projections=projs, saved=saved)
            return y_TH.astype(x.dtype, copy=False)

        def backward(dy_TH, scale_T):
            dx, dw, grads = token_experts_backward(
                dy_TH,
                scale_T,
                state["x"],
                state["topk"],
                state["row_A"],
                state["weight"],
                state["projections"],
                state["saved"],
            )
            outputs = [dx.astype(state["x"].dtype, copy=False), dw]
            for grad in grads:
                dummy = np.zeros(_DUMMY, np.float32)
                outputs += [grad.get("weight", dummy), grad.get("lora_A", dummy), grad.get("lora_B", dummy)]
            state.clear()
            return tuple(outputs)

        grad_shapes = []
        for spec, (weight, lora_A, lora_B) in zip(self.specs, shapes):
            grad_shapes += [
                list(weight) if spec.trainable else list(_DUMMY),
                list(lora_A) if spec.lora else list(_DUMMY),
                list(lora_B) if spec.lora else list(_DUMMY),
            ]

        self.forward = ops.Custom(
            forward, out_shape=lambda x, *rest: x, out_dtype=lambda x, *rest: x, func_type="pyfunc"
        )
        self.backward = ops.Custom(
            backward,
            out_shape=lambda dy, scale: [dy, [dy[0], top_k]] + grad_shapes,
            out_dtype=lambda dy, scale: [dy, ms.float32] + [ms.float32] * len(grad_shapes),
            func_type="pyfunc",
        )

    def construct(
        self, x, topk, row, sources, weight_TK, scale, gw, ga, gb, gz, gf, uw, ua, ub, uz, uf, dw, da, db, dz, df
    ):
        return self.forward(
            x, topk, row, sources, weight_TK, scale, gw, ga, gb, gz, gf, uw, ua, ub, uz, uf, dw, da, db, dz, df
        )

    def bprop(
        self, x, topk, row, sources, weight_TK, scale, gw, ga, gb, gz, gf, uw, ua, ub, uz, uf, dw, da, db, dz, df,
        out, dy,
    ):  # fmt: skip
        # The output gradient need not depend on the forward's values (a linear loss): order them explicitly.
        grads = self.backward(ops.depend(dy, out), scale)
        slots = ((gw, ga, gb, gz, gf), (uw, ua, ub, uz, uf), (dw, da, db, dz, df))
        result = (
            grads[0],
            ops.zeros_like(topk),
            ops.zeros_like(row),
            ops.zeros_like(sources),
            self.cast(grads[1], weight_TK.dtype),
            ops.zeros_like(scale),
        )
        for i in range(3):
            weight, lora_A, lora_B, row_Z, col_F = slots[i]
            d_weight = self.cast(grads[2 + 3 * i], weight.dtype) if self.trainable[i] else ops.zeros_like(weight)
            d_A = self.cast(grads[3 + 3 * i], lora_A.dtype) if self.adapted[i] else ops.zeros_like(lora_A)
            d_B = self.cast(grads[4 + 3 * i], lora_B.dtype) if self.adapted[i] else ops.zeros_like(lora_B)
            result = result + (d_weight, d_A, d_B, ops.zeros_like(row_Z), ops.zeros_like(col_F))
        return result
