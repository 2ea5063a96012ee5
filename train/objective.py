"""The step objective of one micro-batch: the LM loss, the router's losses, and the MTP and DSA terms when the model
has them (train/step.py's docstring gives the normalisation).

Shape legend (docs/architecture.md): U MTP depths, B batch, S sequence, T tokens (B * S).
"""

from dataclasses import dataclass

import mindspore as ms
from mindspore import ops

from mindmoe.train.head_loss import head_nll, head_nll_with_mtp


@dataclass(frozen=True)
class Objective:
    """What a model's objective adds to ``lm_loss + aux_loss + z_loss`` (read when the step is compiled)."""

    #: MTP depths U (0: none) and ``train.mtp_loss_coeff``.
    mtp_depths: int = 0
    mtp_loss_coeff: float = 0.0
    #: The model returns the DSA indexer's loss (model/dsa.py), weighted by ``dsa.indexer_loss_coeff``.
    dsa: bool = False
    indexer_loss_coeff: float = 0.0

    @classmethod
    def of(cls, model, mtp_loss_coeff: float) -> "Objective":
        cfg = model.config
        dsa = bool(model.layers[0].self_attn.dsa_active)
        coeff = float(model.dsa_training.indexer_loss_coeff) if dsa else 0.0
        return cls(cfg.mtp_layers, float(mtp_loss_coeff), dsa, coeff)


def step_objective(model, token_nll, objective: Objective, window, mtp_inputs):
    """``(loss, (loss, lm, aux, z, routing, layer, mtp, indexer))`` of one micro-batch, unscaled.

    ``window`` is ``(input_ids, doc_ids, labels, loss_mask, token_weight)``; ``token_weight`` is a graph input,
    not a constant: it changes every step. ``mtp_inputs`` ``(future_ids, mtp_weights)`` are read only with MTP
    depths. ``indexer`` is the unweighted DSA loss (0 without DSA)."""
    input_ids, doc_ids, labels, loss_mask, token_weight = window
    zero = ops.zeros((), ms.float32)
    if objective.mtp_depths:
        future_ids, mtp_weights = mtp_inputs
        outputs = head_nll_with_mtp(model, token_nll, input_ids, doc_ids, future_ids, loss_mask, mtp_weights)
        mtp_loss = outputs[6] * (objective.mtp_loss_coeff / objective.mtp_depths)
        rest = outputs[7:]
    else:
        outputs = head_nll(model, token_nll, input_ids, doc_ids, labels, loss_mask)
        mtp_loss = zero
        rest = outputs[6:]
    nll_sum, _, aux_loss, z_loss, routing_stats, layer_stats = outputs[:6]
    indexer_loss = rest[0] if objective.dsa else zero
    lm_loss = nll_sum * token_weight
    loss = lm_loss + aux_loss + z_loss + mtp_loss + indexer_loss * objective.indexer_loss_coeff
    return loss, (loss, lm_loss, aux_loss, z_loss, routing_stats, layer_stats, mtp_loss, indexer_loss)
