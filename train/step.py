"""The compiled train step: forward, loss, backward, accumulation, clipping, AdamW.

Shape legend: B micro-batch, S sequence, V vocabulary, L MoE layers, E experts.

The objective of a step is ``lm_loss + aux_loss + z_loss (+ mtp_loss) (+ coeff * indexer_loss)``. ``lm_loss``
is normalised by tokens: the sum of next-token cross-entropies over every scored label (same document as the input; SFT:
assistant tokens) of every micro-batch on every data-parallel rank, divided by the number of
scored labels in the global batch, so a token weighs the same whichever micro-batch holds it.
``aux_loss`` and ``z_loss`` are per-micro-batch values averaged over the step's micro-batches.
Both come out of one mechanism: the gradient is the mean over micro-batches and (under data
parallelism, ``train.parallel.distributed``) over ranks, and each micro-batch's ``lm_loss`` is its
cross-entropy sum times ``token_weight = micro-batches of the global batch / scored labels of
the global batch``, counted on the host before the step. One process with ``n`` micro-batches
therefore matches ``n`` data-parallel ranks that each see one of them.

With ``model.mtp_layers`` = U > 0, ``mtp_loss = train.mtp_loss_coeff / U * sum_k CE_k`` (DeepSeek-V3 §2.2),
where ``CE_k`` is depth k's cross-entropy of predicting ``t_{i+k+1}`` normalised the same way as ``lm_loss``:
over the global batch's labels that depth scores (:func:`model.mtp.mtp_loss_mask`: same document, SFT
assistant tokens, inside the window), through a per-depth token weight. With DeepSeek Sparse Attention
(``model.dsa``, model/dsa.py) the indexer's KL loss, a mean over its layers and queries, enters times
``dsa.indexer_loss_coeff`` and is logged unweighted as ``indexer_loss``.

Everything numeric runs inside ``ms.jit`` functions (GRAPH_MODE). Functions are jitted,
not the cells: ``ms.jit(cell)`` would freeze the parameter values it captured.
"""

import dataclasses
import math
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.ops import functional as F

from mindmoe.data.packing import PackedWindows, label_mask
from mindmoe.model.mtp import mtp_loss_mask, shifted_tokens
from mindmoe.train.grad_norm import expert_parameter_names, layout_free_norm
from mindmoe.train.head_loss import head_loss, head_nll, masked_sum
from mindmoe.train.loss_scaling import loss_scaling
from mindmoe.train.objective import TERM_LOSS, TERM_ROUTING_STATS, Objective, StepTerms, step_objective


def split_window(batch: dict):
    """Packed ``seq_len + 1`` windows -> model inputs, labels and the loss mask (numpy, int32).

    Which labels count is :func:`data.packing.label_mask` (same document; SFT: assistant tokens)."""
    tokens = batch["input_ids"]
    doc_ids = batch["doc_ids"]
    loss_mask = label_mask(PackedWindows(tokens, doc_ids, batch.get("loss_mask"))).astype(np.int32)
    return (
        Tensor(tokens[:, :-1].astype(np.int32)),
        Tensor(doc_ids[:, :-1].astype(np.int32)),
        Tensor(tokens[:, 1:].astype(np.int32)),
        Tensor(loss_mask),
    )


def mtp_window(batch: dict, depths: int):
    """``(future_ids [U + 1, B, S], mtp_mask [U, B, S])`` int32 numpy of a packed window for U MTP depths
    (:func:`model.mtp.shifted_tokens`, :func:`model.mtp.mtp_loss_mask`); one dummy row each without MTP."""
    tokens = batch["input_ids"]
    if depths == 0:
        return np.zeros((1,) + tokens[:, 1:].shape, np.int32), np.zeros((1,) + tokens[:, 1:].shape, np.int32)
    labels_mask = label_mask(PackedWindows(tokens, batch["doc_ids"], batch.get("loss_mask"))).astype(np.int32)
    return shifted_tokens(tokens, depths), mtp_loss_mask(labels_mask, batch["doc_ids"], depths)


def token_weight(scored_tokens: int, micro_batches: int) -> float:
    """The factor of a micro-batch's cross-entropy sum that makes the mean over the global batch's
    ``micro_batches`` (all ranks) the sum over its ``scored_tokens`` labels divided by their number."""
    return micro_batches / max(scored_tokens, 1)


@dataclass
class StepStats:
    """Host-side results of one optimizer step over the global batch.

    ``lm_loss`` is per scored token; ``aux_loss``, ``z_loss`` and ``layer_stats`` are means over micro-batches.
    """

    skipped: bool  # loss or gradient norm not finite: no parameter changed
    loss: float
    lm_loss: float
    aux_loss: float
    z_loss: float
    grad_norm: float
    lr: float
    routing_stats: np.ndarray  # [L, 3, E] chosen / kept / locked_kept, summed over micro-batches
    layer_stats: np.ndarray  # [L, 5] per-layer scalars (model.moe.layer.LAYER_STATS), mean over micro-batches
    # Skipped because the loss-scaled (fp16) gradients overflowed while the loss was finite and the
    # scale could still be halved: the step retries at a lower scale, it is not a diverging model.
    overflow: bool = False
    loss_scale: float | None = None  # the dynamic loss scale after the step; None without loss scaling
    mtp_loss: float | None = None  # train.mtp_loss_coeff * mean over MTP depths of their CE; None without MTP
    indexer_loss: float | None = None  # DSA: mean over layers of the indexer's KL (unweighted); None without it


def _grad_buffers(params, shapes, accum_steps: int):
    """fp32 gradient sums of a step's micro-batches, one per parameter, of the gradients' ``shapes`` (ZeRO-2/3: a
    range); None without accumulation."""
    if accum_steps == 1:
        return None
    return ParameterTuple(
        Parameter(ops.zeros(shape, ms.float32), name="grad_accum." + p.name, requires_grad=False)
        for p, shape in zip(params, shapes)
    )


def _reductions(dist, optimizer, expert_names):
    """``(synchronise, squared_norm)``: the mean of gradients (ZeRO-1: this rank's ranges of it, train/parallel/zero.py)
    and loss over data-parallel ranks, and the squared gradient norm (:func:`train.grad_norm.layout_free_norm` of the
    routed expert tensors ``expert_names``); one process reduces nothing."""
    if hasattr(optimizer, "load_ranges"):
        from mindmoe.train.parallel.zero import zero_reductions

        return zero_reductions(optimizer, dist)
    if dist is None:

        def synchronise(grads, loss):
            return grads, loss

        return synchronise, layout_free_norm(optimizer.parameters, expert_names)
    return dist.grad_reducer(optimizer.parameters), dist.squared_grad_norm(optimizer.parameters, expert_names)


def _clip_and_apply(optimizer, clip: float, synchronise, squared_norm, adjust_scale, update_scales):
    """The update of a step from its (loss-unscaled) gradients, traced into each compiled step function."""
    # ZeRO-1: the update of this rank's ranges and their all-gather, which every rank runs every step.
    ranges = hasattr(optimizer, "load_ranges")

    def clip_and_apply(grads, loss, routing_L3E):
        """Clip to the global norm and update, unless loss or gradients are not finite.

        A non-finite step is skipped whole (no moment update either), as loss-scaled training
        does on overflow; the caller counts it. Gradients and loss are first averaged over
        data-parallel ranks, so every rank takes the same decision and the same update.
        """
        grads, loss = synchronise(grads, loss)
        norm = ops.sqrt(squared_norm(grads))
        factor = ops.minimum(clip / (norm + 1e-6), 1.0) if clip > 0 else None
        if clip > 0 and not ranges:
            grads = tuple(g * factor for g in grads)
        lr = optimizer.get_lr()
        finite = ops.logical_and(ops.isfinite(norm), ops.isfinite(loss))
        # ZeRO: the factor is applied range by range inside the update (no scaled copy of every gradient).
        if ranges and update_scales is None:
            finite = optimizer.apply(grads, finite, None, factor)
        elif ranges:
            finite = optimizer.apply(grads, finite, update_scales(routing_L3E), factor)
        elif finite:
            optimizer(grads) if update_scales is None else optimizer(grads, update_scales(routing_L3E))
        adjust_scale(finite)
        return norm, lr, finite

    return clip_and_apply


def _compile_fused_step(grad_fn, unscale, clip_and_apply):
    """One micro-batch per step: forward, backward and update in one graph."""

    @ms.jit
    def fused_step(input_ids, doc_ids, labels, loss_mask, token_weight, future_ids, mtp_weights):
        (_, terms), grads = grad_fn(input_ids, doc_ids, labels, loss_mask, token_weight, future_ids, mtp_weights)
        norm, lr, finite = clip_and_apply(unscale(grads), terms[TERM_LOSS], terms[TERM_ROUTING_STATS])
        return terms, norm, lr, finite

    return fused_step


def _compile_accumulation(grad_fn, unscale, clip_and_apply, buffers, accum_steps: int, in_place: bool = False):
    """``(accumulate, apply_accumulated)``: add one micro-batch's gradient / ``accum_steps`` to the
    buffers; then update from the buffers (``in_place``: read as they are) and clear them."""
    inv_accum = 1.0 / accum_steps

    @ms.jit
    def accumulate(input_ids, doc_ids, labels, loss_mask, token_weight, future_ids, mtp_weights):
        (_, terms), grads = grad_fn(input_ids, doc_ids, labels, loss_mask, token_weight, future_ids, mtp_weights)
        for buffer, grad in zip(buffers, unscale(grads)):
            ops.assign_add(buffer, grad * inv_accum)
        return terms

    @ms.jit
    def apply_accumulated(mean_loss, routing_L3E):
        # ZeRO reads the sums in place and clears them once every update is done (its ``finite`` comes after them);
        # otherwise the update reads a copy.
        grads = tuple(buffers) if in_place else tuple(buffer * 1.0 for buffer in buffers)
        norm, lr, finite = clip_and_apply(grads, mean_loss, routing_L3E)
        for buffer in buffers:
            ops.assign(buffer, F.depend(ops.zeros_like(buffer), finite))
        return norm, lr, finite

    return accumulate, apply_accumulated


def _compile_evaluate(model, token_nll):
    """``(nll sum, scored tokens)`` of one micro-batch, no gradient."""

    @ms.jit
    def evaluate(input_ids, doc_ids, labels, loss_mask):
        _, nll_T, _ = head_nll(model, token_nll, input_ids, doc_ids, labels, loss_mask)
        return masked_sum(nll_T, loss_mask)

    return evaluate


class CompiledStep:
    """The compiled functions of one run's train step; call :meth:`step` with the micro-batches of a step."""

    def __init__(
        self,
        model: nn.Cell,
        optimizer: nn.Optimizer,
        grad_clip: float,
        accum_steps: int,
        router_updates=None,
        dist=None,
        loss_scale=None,
        mtp_loss_coeff: float = 0.0,
    ):
        self.model = model
        self.objective = Objective.of(model, mtp_loss_coeff)
        self.dist = dist
        self.optimizer = optimizer
        self.accum_steps = accum_steps
        params = optimizer.parameters
        scale_loss, unscale, adjust_scale, self.loss_scale_state = loss_scaling(loss_scale)
        self.token_nll = head_loss(model, params)

        def scaled_loss(input_ids, doc_ids, labels, loss_mask, token_weight, future_ids, mtp_weights):
            loss, terms = self._loss(input_ids, doc_ids, labels, loss_mask, token_weight, future_ids, mtp_weights)
            return scale_loss(loss), terms

        # ZeRO-2/3 differentiate ranges (train/parallel/fsdp.py): the optimizer says what, and of which shapes.
        targets = optimizer.targets if hasattr(optimizer, "targets") else params
        shapes = optimizer.target_shapes() if hasattr(optimizer, "targets") else [p.shape for p in params]
        grad_fn = ms.value_and_grad(scaled_loss, None, targets, has_aux=True)
        self.grad_buffers = _grad_buffers(params, shapes, accum_steps)
        reductions = _reductions(dist, optimizer, expert_parameter_names(model))
        self._step_parts = (grad_fn, unscale, float(grad_clip), reductions, adjust_scale)
        self.router_updates = router_updates
        self._evaluate = _compile_evaluate(model, head_loss(model))

    @property
    def router_updates(self):
        return self._router_updates

    @router_updates.setter
    def router_updates(self, updates):
        """Per-step router updates (train/routing.py) or None; their update scales are traced into the step."""
        grad_fn, unscale, clip, reductions, adjust_scale = self._step_parts
        scales = None if updates is None else updates.update_scales(self.optimizer.parameters, self.dist)
        clip_and_apply = _clip_and_apply(self.optimizer, clip, *reductions, adjust_scale, scales)
        self._router_updates = updates
        self._fused_step = _compile_fused_step(grad_fn, unscale, clip_and_apply)
        self._accumulate, self._apply_accumulated = _compile_accumulation(
            grad_fn, unscale, clip_and_apply, self.grad_buffers, self.accum_steps, hasattr(self.optimizer, "ranges")
        )

    def _loss(self, input_ids, doc_ids, labels, loss_mask, token_weight, future_ids, mtp_weights):
        """The micro-batch's share of the step objective, and its terms unscaled
        (:func:`train.objective.step_objective`, :class:`train.objective.StepTerms`)."""
        return step_objective(
            self.model,
            self.token_nll,
            self.objective,
            (input_ids, doc_ids, labels, loss_mask, token_weight),
            (future_ids, mtp_weights),
        )

    def step(self, micro_batches) -> StepStats:
        """One optimizer step over ``accum_steps`` micro-batches (dicts of packed windows)."""
        if len(micro_batches) != self.accum_steps:
            raise ValueError(f"expected {self.accum_steps} micro-batches, got {len(micro_batches)}")
        # Each compiled function keeps the training flag it was first traced with: the train
        # step traces with dropout (LoRA) active, evaluation without.
        self.model.set_train(True)
        windows = [split_window(batch) for batch in micro_batches]
        weight = Tensor(np.float32(self._token_weight(windows)))
        mtp_inputs = self._mtp_inputs(micro_batches)
        scale_before = self._loss_scale()
        if self.accum_steps == 1:
            terms, norm, lr, finite = self._fused_step(*windows[0], weight, *mtp_inputs[0])
            host = StepTerms.over_micro_batches([terms])
        else:
            micro = [self._accumulate(*window, weight, *mtp) for window, mtp in zip(windows, mtp_inputs)]
            host = StepTerms.over_micro_batches(micro)
            norm, lr, finite = self._apply_accumulated(Tensor(np.float32(host.loss)), Tensor(host.routing_stats))
        stats = self._global_stats(
            StepStats(
                skipped=not bool(finite.asnumpy()),
                loss=float(host.loss),
                lm_loss=float(host.lm_loss),
                aux_loss=float(host.aux_loss),
                z_loss=float(host.z_loss),
                grad_norm=float(norm.asnumpy()),
                lr=float(np.asarray(lr.asnumpy()).reshape(-1)[0]),
                routing_stats=host.routing_stats,
                layer_stats=host.layer_stats,
                mtp_loss=float(host.mtp_loss) if self.objective.mtp_depths else None,
                indexer_loss=float(host.indexer_loss) if self.objective.dsa else None,
            )
        )
        stats = self._with_loss_scale(stats, scale_before)
        if self.router_updates is not None and not stats.skipped:
            self.router_updates.after_optimizer(stats.routing_stats)
        return stats

    def _token_weight(self, windows) -> float:
        """:func:`token_weight` of this step: the scored labels (the loss masks are on the host) and
        micro-batches of the global batch, one tiny host all-reduce under data parallelism."""
        scored_tokens = sum(int(window[3].asnumpy().sum()) for window in windows)
        micro_batches = self.accum_steps
        if self.dist is not None and self.dist.active:
            scored_tokens = self.dist.sum_count_over_replicas(scored_tokens)
            micro_batches *= self.dist.dp
        return token_weight(scored_tokens, micro_batches)

    def _mtp_inputs(self, micro_batches) -> list:
        """``(future_ids, mtp_weights)`` tensors per micro-batch: :func:`mtp_window` with each depth's mask times
        its token weight (micro-batches / that depth's scored labels in the global batch, as :meth:`_token_weight`)."""
        parts = [mtp_window(batch, self.objective.mtp_depths) for batch in micro_batches]
        if not self.objective.mtp_depths:
            return [(Tensor(future), Tensor(mask.astype(np.float32))) for future, mask in parts]
        micro_batches_total = self.accum_steps
        if self.dist is not None and self.dist.active:
            micro_batches_total *= self.dist.dp
        weights = []
        for depth in range(self.objective.mtp_depths):
            scored = sum(int(mask[depth].sum()) for _, mask in parts)
            if self.dist is not None and self.dist.active:
                scored = self.dist.sum_count_over_replicas(scored)
            weights.append(token_weight(scored, micro_batches_total))
        depth_weight = np.asarray(weights, np.float32).reshape(-1, 1, 1)
        return [(Tensor(future), Tensor(mask.astype(np.float32) * depth_weight)) for future, mask in parts]

    def _loss_scale(self):
        """The dynamic loss scale now (fp16), else None."""
        return float(self.loss_scale_state[0].asnumpy()) if self.loss_scale_state else None

    def _with_loss_scale(self, stats: StepStats, scale_before) -> StepStats:
        """``stats`` with the new loss scale and whether a skip was a loss-scale overflow.

        The reported loss is computed before scaling: when it is finite, only the scaled gradients
        overflowed. At the scale's floor of 1 halving changes nothing, so the skip is a bad step.
        """
        if scale_before is None:
            return stats
        scale = self._loss_scale()
        overflow = stats.skipped and math.isfinite(stats.loss) and scale < scale_before
        return dataclasses.replace(stats, overflow=overflow, loss_scale=scale)

    def _global_stats(self, local: StepStats) -> StepStats:
        """Means (losses, layer statistics) and sums (routing counts) over data-parallel ranks.

        Every rank runs the same number of micro-batches, so the mean of the rank means is the
        global-batch mean; each rank's ``lm_loss`` is its cross-entropy sum times ``dp`` over the
        global batch's scored labels, so their mean is per token. The ranks of an expert group share
        their micro-batches, so their counts are counted once. The gradient norm and the skip
        decision are already global.
        """
        if self.dist is None or not self.dist.active:
            return local
        scalars = [local.loss, local.lm_loss, local.aux_loss, local.z_loss, local.mtp_loss or 0.0]
        scalars.append(local.indexer_loss or 0.0)
        routing, layer = local.routing_stats, local.layer_stats
        packed = np.concatenate([np.asarray(scalars, np.float32), routing.reshape(-1), layer.reshape(-1)])
        total = self.dist.sum_over_ranks(packed)
        world = self.dist.world_size
        loss, lm_loss, aux_loss, z_loss, mtp_loss, indexer_loss = (float(v) / world for v in total[:6])
        routing_end = 6 + routing.size
        return dataclasses.replace(
            local,
            loss=loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            z_loss=z_loss,
            mtp_loss=None if local.mtp_loss is None else mtp_loss,
            indexer_loss=None if local.indexer_loss is None else indexer_loss,
            routing_stats=total[6:routing_end].reshape(routing.shape) / self.dist.replica_copies,
            layer_stats=total[routing_end:].reshape(layer.shape) / world,
        )

    def evaluate(self, batches) -> tuple:
        """``(mean nll per scored token, scored tokens)`` over an iterable of window dicts."""
        self.model.set_train(False)
        nll_total = 0.0
        tokens = 0.0
        for batch in batches:
            nll_sum, count = self._evaluate(*split_window(batch))
            nll_total += float(nll_sum.asnumpy())
            tokens += float(count.asnumpy())
        if self.dist is not None and self.dist.active:
            summed = self.dist.sum_over_ranks(np.array([nll_total, tokens])) / self.dist.replica_copies
            nll_total, tokens = float(summed[0]), float(summed[1])
        return nll_total / max(tokens, 1.0), tokens
