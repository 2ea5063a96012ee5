"""The LM loss of the step and of evaluation: the model's final hidden rows through the chunked head
(:class:`model.lm_loss.TokenNLL`), weighted by a loss mask (the tokens' weights go into the head, which computes the
weighted sum's gradients as it goes).

Shape legend (docs/architecture.md): B batch, S sequence, T tokens (B * S), H hidden size.
"""

import mindspore as ms
from mindspore import ops

from mindmoe.model.lm_loss import TokenNLL, chunk_rows
from mindmoe.model.outputs import OUT_HEAD, OUT_MTP_HIDDEN


def head_loss(model, trainable_params=None) -> TokenNLL:
    """The chunked head-and-cross-entropy cell for ``model`` (built outside the compiled graph).

    The head's weight gradient is computed only when the head is among ``trainable_params``; with None no
    gradient is taken (evaluation: the cell then computes only the losses). The MatMuls run in the compute dtype
    mixed precision gave the model (``train.precision``), as the model's own head does.
    """
    head_name = model.head_parameter().name
    trainable = trainable_params is not None and any(p.name == head_name for p in trainable_params)
    strategy = getattr(model, "amp_strategy", None)
    compute_dtype = ms.float32 if strategy is None else strategy.get_amp_dtype()
    return TokenNLL(chunk_rows(model.config.vocab_size), trainable, compute_dtype, grads=trainable_params is not None)


def head_nll(model, token_nll, input_ids_BS, doc_ids_BS, labels_BS, weight_BS):
    """``(nll_sum, nll [T] fp32, outputs)``: the cross-entropy of the model's head (``token_nll`` from
    :func:`head_loss`) and the model's outputs (:class:`model.outputs.ModelOutput`, ``head`` the hidden rows):
    ``nll_sum = sum_t weight_t nll_t`` (``weight_BS``: the loss mask), the per-token ``nll`` (no gradient;
    statistics only)."""
    outputs = model(input_ids_BS, doc_ids_BS, True)
    losses = token_nll(outputs[OUT_HEAD], model.head_weight(), labels_BS.reshape(-1), _weights(weight_BS))
    return losses[0], losses[1], outputs


def _weights(weight_BS):
    return weight_BS.reshape(-1).astype(ms.float32)


def head_nll_with_mtp(model, token_nll, input_ids_BS, doc_ids_BS, future_ids_VBS, weight_BS, mtp_weights_UBS):
    """``(nll_sum, nll, mtp_sum, outputs)``: :func:`head_nll`'s (labels: ``future_ids[0]``, weights ``weight_BS``) with
    the multi-token-prediction sum ``mtp_sum = sum_k sum_i nll_k,i * mtp_weights[k, i]`` (model/mtp.py).

    ``future_ids`` ``[U + 1, B, S]`` is :func:`model.mtp.shifted_tokens`: row 0 the labels, rows 0..U-1 the depths'
    input tokens, row k depth k's targets; ``mtp_weights`` the depths' loss masks times their token weights. Every
    depth goes through the same chunked shared head as the main loss.
    """
    depths = mtp_weights_UBS.shape[0]
    head_VH = model.head_weight()
    outputs = model(input_ids_BS, doc_ids_BS, True, future_ids_VBS[:depths])
    losses = token_nll(outputs[OUT_HEAD], head_VH, future_ids_VBS[0].reshape(-1), _weights(weight_BS))
    mtp_UTH = outputs[OUT_MTP_HIDDEN]
    mtp_sum = ops.zeros((), ms.float32)
    for depth in range(depths):
        depth_labels_T = future_ids_VBS[depth + 1].reshape(-1)
        mtp_sum = mtp_sum + token_nll(mtp_UTH[depth], head_VH, depth_labels_T, _weights(mtp_weights_UBS[depth]))[0]
    return losses[0], losses[1], mtp_sum, outputs


def masked_sum(nll_T, mask_BS):
    """``(sum of nll where the mask is 1, count)`` (fp32)."""
    mask_T = mask_BS.reshape(-1).astype(ms.float32)
    return (nll_T * mask_T).sum(), mask_T.sum()


def masked_cross_entropy(logits_BSV, labels_BS, loss_mask_BS):
    """Mean negative log-likelihood over positions where ``loss_mask`` is 1 (fp32), from whole logits.

    The step and evaluation use :func:`head_nll` instead (the head applied in chunks); this is the plain
    formula, for logits a caller already has."""
    log_probs_BSV = ops.log_softmax(logits_BSV.astype(ms.float32), -1)
    nll_BS = -ops.gather_elements(log_probs_BSV, 2, labels_BS.expand_dims(-1)).squeeze(-1)
    mask_BS = loss_mask_BS.astype(ms.float32)
    nll_sum = (nll_BS * mask_BS).sum()
    count = mask_BS.sum()
    return nll_sum / ops.maximum(count, 1.0), nll_sum, count
