"""The step objective of one micro-batch: the LM loss, the router's losses, and the MTP and DSA terms when the model
has them (train/step.py's docstring gives the normalisation).

Shape legend (docs/architecture.md): U MTP depths, B batch, S sequence, T tokens (B * S).
"""

from dataclasses import dataclass
from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import ops

from mindmoe.model.outputs import OUT_AUX_LOSS, OUT_INDEXER_LOSS, OUT_LAYER_STATS, OUT_ROUTING_STATS, OUT_Z_LOSS
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


class StepTerms(NamedTuple):
    """Names of a micro-batch's terms, which :func:`step_objective` returns as a plain tuple in this order (graph code
    cannot build a NamedTuple without stopping gradients: model/outputs.py)."""

    loss: ms.Tensor
    lm_loss: ms.Tensor
    aux_loss: ms.Tensor
    z_loss: ms.Tensor
    routing_stats: ms.Tensor
    layer_stats: ms.Tensor
    mtp_loss: ms.Tensor
    indexer_loss: ms.Tensor

    @classmethod
    def over_micro_batches(cls, micro_terms) -> "StepTerms":
        """NumPy values of a step from its micro-batches' term tuples: the routing counts summed, every other term
        averaged."""
        named = [cls(*terms) for terms in micro_terms]
        values = {field: np.mean([getattr(t, field).asnumpy() for t in named], axis=0) for field in cls._fields}
        values["routing_stats"] = np.sum([t.routing_stats.asnumpy() for t in named], axis=0)
        return cls(**values)


#: Indices of the terms the compiled step itself reads.
TERM_LOSS = StepTerms._fields.index("loss")
TERM_ROUTING_STATS = StepTerms._fields.index("routing_stats")


def step_objective(model, token_nll, objective: Objective, window, mtp_inputs):
    """``(loss, terms)`` of one micro-batch, unscaled; ``terms`` in :class:`StepTerms` order.

    ``window`` is ``(input_ids, doc_ids, labels, loss_mask, token_weight)``; ``token_weight`` is a graph input,
    not a constant: it changes every step. ``mtp_inputs`` ``(future_ids, mtp_weights)`` are read only with MTP
    depths. ``indexer_loss`` is the unweighted DSA loss (0 without DSA)."""
    input_ids, doc_ids, labels, loss_mask, token_weight = window
    if objective.mtp_depths:
        future_ids, mtp_weights = mtp_inputs
        nll_sum, _, mtp_sum, outputs = head_nll_with_mtp(
            model, token_nll, input_ids, doc_ids, future_ids, loss_mask, mtp_weights
        )
        mtp_loss = mtp_sum * (objective.mtp_loss_coeff / objective.mtp_depths)
    else:
        nll_sum, _, outputs = head_nll(model, token_nll, input_ids, doc_ids, labels, loss_mask)
        mtp_loss = ops.zeros((), ms.float32)
    aux_loss, z_loss, indexer_loss = outputs[OUT_AUX_LOSS], outputs[OUT_Z_LOSS], outputs[OUT_INDEXER_LOSS]
    lm_loss = nll_sum * token_weight
    loss = lm_loss + aux_loss + z_loss + mtp_loss + indexer_loss * objective.indexer_loss_coeff
    routing_stats, layer_stats = outputs[OUT_ROUTING_STATS], outputs[OUT_LAYER_STATS]
    return loss, (loss, lm_loss, aux_loss, z_loss, routing_stats, layer_stats, mtp_loss, indexer_loss)
