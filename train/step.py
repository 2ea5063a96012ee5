"""The compiled train step: forward, loss, backward, accumulation, clipping, AdamW.

Shape legend: B micro-batch, S sequence, V vocabulary, L MoE layers, E experts.

The loss of a micro-batch is ``lm_loss + aux_loss + z_loss`` where ``lm_loss`` is the mean
next-token cross-entropy over the positions whose label is in the same document as the
input. With accumulation the gradient is the mean over micro-batches, so one process with
``n`` micro-batches matches ``n`` data-parallel ranks that each see one of them: under data
parallelism (``train.distributed``) the accumulated gradient and the step's statistics are
averaged over ranks once per step.

Everything numeric runs inside ``ms.jit`` functions (GRAPH_MODE). Functions are jitted,
not the cells: ``ms.jit(cell)`` would freeze the parameter values it captured.
"""

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from mindmoe.data.packing import PackedWindows, label_mask


def masked_cross_entropy(logits_BSV, labels_BS, loss_mask_BS):
    """Mean negative log-likelihood over positions where ``loss_mask`` is 1 (fp32)."""
    log_probs_BSV = ops.log_softmax(logits_BSV.astype(ms.float32), -1)
    nll_BS = -ops.gather_elements(log_probs_BSV, 2, labels_BS.expand_dims(-1)).squeeze(-1)
    mask_BS = loss_mask_BS.astype(ms.float32)
    nll_sum = (nll_BS * mask_BS).sum()
    count = mask_BS.sum()
    return nll_sum / ops.maximum(count, 1.0), nll_sum, count


_DOT = ops.MatMul(transpose_b=True)


def sum_of_squares(tensor):
    """``sum(tensor ** 2)`` in fp32 as a ``[1, n] x [n, 1]`` MatMul.

    On CPU, MindSpore 2.9's full ReduceSum of a squared [8192, 512] gradient ran 4-5x slower than
    this dot product, and the global norm takes one per parameter every step.
    """
    flat_1N = tensor.astype(ms.float32).reshape(1, -1)
    return _DOT(flat_1N, flat_1N).reshape(())


def global_squared_norm(grads):
    """``sum_i |g_i|^2`` over a tuple of gradients (fp32)."""
    return ops.stack([sum_of_squares(g) for g in grads]).sum()


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


@dataclass
class StepStats:
    """Host-side results of one optimizer step (losses are means over its micro-batches)."""

    skipped: bool  # loss or gradient norm not finite: no parameter changed
    loss: float
    lm_loss: float
    aux_loss: float
    z_loss: float
    grad_norm: float
    lr: float
    routing_stats: np.ndarray  # [L, 3, E] chosen / kept / locked_kept, summed over micro-batches
    layer_stats: np.ndarray  # [L, 5] per-layer scalars (model.moe.layer.LAYER_STATS), mean over micro-batches


def _loss_scaling(loss_scale):
    """``(scale_loss, unscale, adjust_scale, state parameters)`` for a ``train.precision.LossScale`` or None.

    Dynamic loss scaling (Micikevicius et al. 2018): the loss is multiplied by the scale before
    backward so small fp16 gradients do not flush to zero; gradients and loss are divided by it
    before clipping. A non-finite step halves the scale (not below 1), ``window`` finite steps in
    a row double it. Without it all three are identities and no state exists.
    """
    if loss_scale is None:

        def scale_loss(loss):
            return loss

        def unscale(grads, loss):
            return grads, loss

        def adjust_scale(finite):
            return finite

        return scale_loss, unscale, adjust_scale, []
    scale = Parameter(Tensor(np.float32(loss_scale.initial)), name="loss_scale.scale", requires_grad=False)
    good_steps = Parameter(Tensor(np.float32(0.0)), name="loss_scale.good_steps", requires_grad=False)
    window = float(loss_scale.window)

    def scale_loss(loss):
        return loss * scale

    def unscale(grads, loss):
        inv_scale = 1.0 / scale
        return tuple(g * inv_scale for g in grads), loss * inv_scale

    def adjust_scale(finite):
        counted = (good_steps + 1.0) * finite.astype(ms.float32)
        grow = counted >= window
        kept_scale = ops.select(grow, scale * 2.0, scale)
        ops.assign(scale, ops.select(finite, kept_scale, ops.maximum(scale * 0.5, 1.0)))
        ops.assign(good_steps, ops.select(grow, ops.zeros_like(counted), counted))
        return finite

    return scale_loss, unscale, adjust_scale, [scale, good_steps]


def _grad_buffers(params, accum_steps: int):
    """fp32 gradient sums of a step's micro-batches, one per parameter; None without accumulation."""
    if accum_steps == 1:
        return None
    return ParameterTuple(
        Parameter(ops.zeros(p.shape, ms.float32), name="grad_accum." + p.name, requires_grad=False) for p in params
    )


def _reductions(dist, params):
    """``(synchronise, squared_norm)``: the mean of gradients and loss over data-parallel ranks, and the
    global squared gradient norm; one process needs no reduction."""
    if dist is None:

        def synchronise(grads, loss):
            return grads, loss

        return synchronise, global_squared_norm
    return dist.grad_reducer(params), dist.squared_grad_norm(params)


def _clip_and_apply(optimizer, clip: float, synchronise, squared_norm, adjust_scale):
    """The update of a step from its (loss-unscaled) gradients, traced into each compiled step function."""

    def clip_and_apply(grads, loss):
        """Clip to the global norm and update, unless loss or gradients are not finite.

        A non-finite step is skipped whole (no moment update either), as loss-scaled training
        does on overflow; the caller counts it. Gradients and loss are first averaged over
        data-parallel ranks, so every rank takes the same decision and the same update.
        """
        grads, loss = synchronise(grads, loss)
        norm = ops.sqrt(squared_norm(grads))
        if clip > 0:
            factor = ops.minimum(clip / (norm + 1e-6), 1.0)
            grads = tuple(g * factor for g in grads)
        lr = optimizer.get_lr()
        finite = ops.logical_and(ops.isfinite(norm), ops.isfinite(loss))
        if finite:
            optimizer(grads)
        adjust_scale(finite)
        return norm, lr, finite

    return clip_and_apply


def _compile_fused_step(grad_fn, unscale, clip_and_apply):
    """One micro-batch per step: forward, backward and update in one graph."""

    @ms.jit
    def fused_step(input_ids, doc_ids, labels, loss_mask):
        (loss, aux), grads = grad_fn(input_ids, doc_ids, labels, loss_mask)
        grads, loss = unscale(grads, loss)
        norm, lr, finite = clip_and_apply(grads, loss)
        return loss, aux, norm, lr, finite

    return fused_step


def _compile_accumulation(grad_fn, unscale, clip_and_apply, buffers, accum_steps: int):
    """``(accumulate, apply_accumulated)``: add one micro-batch's gradient / ``accum_steps`` to the
    buffers; then update from the buffers and clear them."""
    inv_accum = 1.0 / accum_steps

    @ms.jit
    def accumulate(input_ids, doc_ids, labels, loss_mask):
        (loss, aux), grads = grad_fn(input_ids, doc_ids, labels, loss_mask)
        grads, loss = unscale(grads, loss)
        for buffer, grad in zip(buffers, grads):
            ops.assign_add(buffer, grad * inv_accum)
        return loss, aux

    @ms.jit
    def apply_accumulated(mean_loss):
        grads = tuple(buffer * 1.0 for buffer in buffers)
        norm, lr, finite = clip_and_apply(grads, mean_loss)
        for buffer in buffers:
            ops.assign(buffer, ops.zeros_like(buffer))
        return norm, lr, finite

    return accumulate, apply_accumulated


def _compile_evaluate(model):
    """``(nll sum, scored tokens)`` of one micro-batch, no gradient."""

    @ms.jit
    def evaluate(input_ids, doc_ids, labels, loss_mask):
        logits = model(input_ids, doc_ids)[0]
        _, nll_sum, count = masked_cross_entropy(logits, labels, loss_mask)
        return nll_sum, count

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
    ):
        self.model = model
        self.dist = dist
        self.router_updates = router_updates
        self.optimizer = optimizer
        self.accum_steps = accum_steps
        params = optimizer.parameters
        scale_loss, unscale, adjust_scale, self.loss_scale_state = _loss_scaling(loss_scale)

        def scaled_loss(input_ids, doc_ids, labels, loss_mask):
            loss, aux = self._loss(input_ids, doc_ids, labels, loss_mask)
            return scale_loss(loss), aux

        grad_fn = ms.value_and_grad(scaled_loss, None, params, has_aux=True)
        self.grad_buffers = _grad_buffers(params, accum_steps)
        clip_and_apply = _clip_and_apply(optimizer, float(grad_clip), *_reductions(dist, params), adjust_scale)
        self._fused_step = _compile_fused_step(grad_fn, unscale, clip_and_apply)
        self._accumulate, self._apply_accumulated = _compile_accumulation(
            grad_fn, unscale, clip_and_apply, self.grad_buffers, accum_steps
        )
        self._evaluate = _compile_evaluate(model)

    def _loss(self, input_ids, doc_ids, labels, loss_mask):
        logits, aux_loss, z_loss, routing_stats, layer_stats = self.model(input_ids, doc_ids)
        lm_loss, _, _ = masked_cross_entropy(logits, labels, loss_mask)
        loss = lm_loss + aux_loss + z_loss
        return loss, (lm_loss, aux_loss, z_loss, routing_stats, layer_stats)

    def step(self, micro_batches) -> StepStats:
        """One optimizer step over ``accum_steps`` micro-batches (dicts of packed windows)."""
        if len(micro_batches) != self.accum_steps:
            raise ValueError(f"expected {self.accum_steps} micro-batches, got {len(micro_batches)}")
        # Each compiled function keeps the training flag it was first traced with: the train
        # step traces with dropout (LoRA) active, evaluation without.
        self.model.set_train(True)
        if self.router_updates is not None:
            self.router_updates.before_optimizer()
        losses = []
        if self.accum_steps == 1:
            loss, aux, norm, lr, finite = self._fused_step(*split_window(micro_batches[0]))
            losses.append((loss, aux))
        else:
            for batch in micro_batches:
                losses.append(self._accumulate(*split_window(batch)))
            mean_loss = float(np.mean([loss.asnumpy() for loss, _ in losses]))
            norm, lr, finite = self._apply_accumulated(Tensor(np.float32(mean_loss)))
        stats = self._global_stats(
            StepStats(
                skipped=not bool(finite.asnumpy()),
                loss=float(np.mean([loss.asnumpy() for loss, _ in losses])),
                lm_loss=float(np.mean([a[0].asnumpy() for _, a in losses])),
                aux_loss=float(np.mean([a[1].asnumpy() for _, a in losses])),
                z_loss=float(np.mean([a[2].asnumpy() for _, a in losses])),
                grad_norm=float(norm.asnumpy()),
                lr=float(np.asarray(lr.asnumpy()).reshape(-1)[0]),
                routing_stats=np.sum([a[3].asnumpy() for _, a in losses], axis=0),
                layer_stats=np.mean([a[4].asnumpy() for _, a in losses], axis=0),
            )
        )
        if self.router_updates is not None and not stats.skipped:
            self.router_updates.after_optimizer(stats.routing_stats)
        return stats

    def _global_stats(self, local: StepStats) -> StepStats:
        """Means (losses, layer statistics) and sums (routing counts) over data-parallel ranks.

        Every rank runs the same number of micro-batches, so the mean of the rank means is the
        global-batch mean. The ranks of an expert group share their micro-batches, so their counts
        are counted once. The gradient norm and the skip decision are already global.
        """
        if self.dist is None or not self.dist.active:
            return local
        scalars = [local.loss, local.lm_loss, local.aux_loss, local.z_loss]
        routing, layer = local.routing_stats, local.layer_stats
        packed = np.concatenate([np.asarray(scalars, np.float32), routing.reshape(-1), layer.reshape(-1)])
        total = self.dist.sum_over_ranks(packed)
        world = self.dist.world_size
        loss, lm_loss, aux_loss, z_loss = (float(v) / world for v in total[:4])
        routing_end = 4 + routing.size
        return StepStats(
            skipped=local.skipped,
            loss=loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            z_loss=z_loss,
            grad_norm=local.grad_norm,
            lr=local.lr,
            routing_stats=total[4:routing_end].reshape(routing.shape) / self.dist.replica_copies,
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
