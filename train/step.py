"""The compiled train step: forward, loss, backward, accumulation, clipping, AdamW.

Shape legend: B micro-batch, S sequence, V vocabulary, L MoE layers, E experts.

The loss of a micro-batch is ``lm_loss + aux_loss + z_loss`` where ``lm_loss`` is the mean
next-token cross-entropy over the positions whose label is in the same document as the
input. With accumulation the gradient is the mean over micro-batches, so one process with
``n`` micro-batches matches ``n`` data-parallel ranks that each see one of them.

Everything numeric runs inside ``ms.jit`` functions (GRAPH_MODE). Functions are jitted,
not the cells: ``ms.jit(cell)`` would freeze the parameter values it captured.
"""
from dataclasses import dataclass

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
import mindspore as ms


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


def split_window(batch: dict):
    """Packed ``seq_len + 1`` windows -> model inputs, labels and the loss mask (numpy, int32)."""
    tokens = batch["input_ids"]
    doc_ids = batch["doc_ids"]
    loss_mask = (doc_ids[:, 1:] == doc_ids[:, :-1]).astype(np.int32)
    return (Tensor(tokens[:, :-1].astype(np.int32)), Tensor(doc_ids[:, :-1].astype(np.int32)),
            Tensor(tokens[:, 1:].astype(np.int32)), Tensor(loss_mask))


@dataclass
class StepStats:
    """Host-side results of one optimizer step (losses are means over its micro-batches)."""
    skipped: bool               # loss or gradient norm not finite: no parameter changed
    loss: float
    lm_loss: float
    aux_loss: float
    z_loss: float
    grad_norm: float
    lr: float
    routing_stats: np.ndarray   # [L, 3, E] chosen / kept / locked_kept, summed over micro-batches
    layer_stats: np.ndarray     # [L, 5] per-layer scalars (model.moe.layer.LAYER_STATS), mean over micro-batches


class Trainer:
    """Owns the compiled functions of one run; call :meth:`step` with the micro-batches of a step."""

    def __init__(self, model: nn.Cell, optimizer: nn.Optimizer, grad_clip: float, accum_steps: int,
                 router_updates=None):
        self.model = model
        self.router_updates = router_updates
        self.optimizer = optimizer
        self.accum_steps = accum_steps
        params = optimizer.parameters
        grad_fn = ms.value_and_grad(self._loss, None, params, has_aux=True)
        clip = float(grad_clip)
        inv_accum = 1.0 / accum_steps
        if accum_steps > 1:
            self.grad_buffers = ParameterTuple(
                Parameter(ops.zeros(p.shape, ms.float32), name="grad_accum." + p.name, requires_grad=False)
                for p in params)
        else:
            self.grad_buffers = None
        buffers = self.grad_buffers

        def clip_and_apply(grads, loss):
            """Clip to the global norm and update, unless loss or gradients are not finite.

            A non-finite step is skipped whole (no moment update either), as loss-scaled training
            does on overflow; the caller counts it.
            """
            norm = ops.sqrt(ops.stack([sum_of_squares(g) for g in grads]).sum())
            if clip > 0:
                factor = ops.minimum(clip / (norm + 1e-6), 1.0)
                grads = tuple(g * factor for g in grads)
            lr = optimizer.get_lr()
            finite = ops.logical_and(ops.isfinite(norm), ops.isfinite(loss))
            if finite:
                optimizer(grads)
            return norm, lr, finite

        @ms.jit
        def fused_step(input_ids, doc_ids, labels, loss_mask):
            (loss, aux), grads = grad_fn(input_ids, doc_ids, labels, loss_mask)
            norm, lr, finite = clip_and_apply(grads, loss)
            return loss, aux, norm, lr, finite

        @ms.jit
        def accumulate(input_ids, doc_ids, labels, loss_mask):
            (loss, aux), grads = grad_fn(input_ids, doc_ids, labels, loss_mask)
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

        @ms.jit
        def evaluate(input_ids, doc_ids, labels, loss_mask):
            logits = model(input_ids, doc_ids)[0]
            _, nll_sum, count = masked_cross_entropy(logits, labels, loss_mask)
            return nll_sum, count

        self._fused_step = fused_step
        self._accumulate = accumulate
        self._apply_accumulated = apply_accumulated
        self._evaluate = evaluate

    def _loss(self, input_ids, doc_ids, labels, loss_mask):
        logits, aux_loss, z_loss, routing_stats, layer_stats = self.model(input_ids, doc_ids)
        lm_loss, _, _ = masked_cross_entropy(logits, labels, loss_mask)
        loss = lm_loss + aux_loss + z_loss
        return loss, (lm_loss, aux_loss, z_loss, routing_stats, layer_stats)

    def step(self, micro_batches) -> StepStats:
        """One optimizer step over ``accum_steps`` micro-batches (dicts of packed windows)."""
        if len(micro_batches) != self.accum_steps:
            raise ValueError(f"expected {self.accum_steps} micro-batches, got {len(micro_batches)}")
        if self.router_updates is not None:
            self.router_updates.before_optimizer()
        losses = []
        if self.accum_steps == 1:
            loss, aux, norm, lr, finite = self._fused_step(*split_window(micro_batches[0]))
            losses.append((loss, aux))
        else:
            for batch in micro_batches:
                losses.append(self._accumulate(*split_window(batch)))
            mean_loss = float(np.mean([l.asnumpy() for l, _ in losses]))
            norm, lr, finite = self._apply_accumulated(Tensor(np.float32(mean_loss)))
        stats = StepStats(
            skipped=not bool(finite.asnumpy()),
            loss=float(np.mean([l.asnumpy() for l, _ in losses])),
            lm_loss=float(np.mean([a[0].asnumpy() for _, a in losses])),
            aux_loss=float(np.mean([a[1].asnumpy() for _, a in losses])),
            z_loss=float(np.mean([a[2].asnumpy() for _, a in losses])),
            grad_norm=float(norm.asnumpy()),
            lr=float(np.asarray(lr.asnumpy()).reshape(-1)[0]),
            routing_stats=np.sum([a[3].asnumpy() for _, a in losses], axis=0),
            layer_stats=np.mean([a[4].asnumpy() for _, a in losses], axis=0),
        )
        if self.router_updates is not None and not stats.skipped:
            self.router_updates.after_optimizer(stats.routing_stats)
        return stats

    def evaluate(self, batches) -> tuple:
        """``(mean nll per scored token, scored tokens)`` over an iterable of window dicts."""
        nll_total = 0.0
        tokens = 0.0
        for batch in batches:
            nll_sum, count = self._evaluate(*split_window(batch))
            nll_total += float(nll_sum.asnumpy())
            tokens += float(count.asnumpy())
        return nll_total / max(tokens, 1.0), tokens

