"""The named outputs of a decoder layer and of :class:`model.transformer.MoETransformer`: one fixed layout each.

Shape legend (docs/architecture.md): B batch, S sequence, T tokens (B * S), H hidden size, V vocabulary, U MTP
depths, E experts, M MoE layers.

A layer returns ``(x, aux)``; ``aux`` is a :class:`LayerAux` tuple::

    aux_loss       ()       the router's balance loss (0 for a dense layer)
    z_loss         ()       the router's z-loss (0 for a dense layer)
    routing_stats  [3, E]   model.moe.layer.ROUTING_STATS rows (zeros for a dense layer)
    layer_stats    [5]      model.moe.layer.LAYER_STATS (zeros for a dense layer)
    indexer_loss   ()       DSA's indexer KL loss (model/dsa.py; 0 without DSA)

The model returns a :class:`ModelOutput` tuple::

    head           [B, S, V] fp32 logits, or with ``hidden_only`` the final-normed rows [T, H]
    aux_loss       ()       summed over the MoE layers (and MTP depths)
    z_loss         ()       summed likewise
    routing_stats  [M, 3, E]  one row per MoE layer of the main stack
    layer_stats    [M, 5]
    mtp_hidden     [U, T, H]  each MTP depth's shared_head.norm output; [0] when the MTP depths did not run
    indexer_loss   ()       DSA: mean over the layers (and MTP depths); 0 without DSA

Adding a term adds a field here, at the end of its layout; every consumer reads fields by these names.

MindSpore 2.9 graph mode builds a NamedTuple through its Python fallback (a PyExecute node), where gradients stop
and ``None`` cannot be a ``has_aux`` output, so graph code returns plain tuples and reads them with the index
constants below; host code names them with :meth:`ModelOutput.of` / :meth:`LayerAux.of`.
"""

from typing import NamedTuple

import mindspore as ms
from mindspore import ops


class LayerAux(NamedTuple):
    """Host-side names of a layer's ``aux`` tuple (module docstring)."""

    aux_loss: ms.Tensor
    z_loss: ms.Tensor
    routing_stats: ms.Tensor
    layer_stats: ms.Tensor
    indexer_loss: ms.Tensor

    @classmethod
    def of(cls, aux) -> "LayerAux":
        return cls(*aux)


class ModelOutput(NamedTuple):
    """Host-side names of the model's output tuple (module docstring)."""

    head: ms.Tensor
    aux_loss: ms.Tensor
    z_loss: ms.Tensor
    routing_stats: ms.Tensor
    layer_stats: ms.Tensor
    mtp_hidden: ms.Tensor
    indexer_loss: ms.Tensor

    @classmethod
    def of(cls, outputs) -> "ModelOutput":
        return cls(*outputs)


#: Indices of a layer's ``aux`` tuple.
AUX_LOSS, Z_LOSS, ROUTING_STATS, LAYER_STATS, INDEXER_LOSS = range(len(LayerAux._fields))
#: Indices of the model's output tuple.
OUT_HEAD, OUT_AUX_LOSS, OUT_Z_LOSS, OUT_ROUTING_STATS, OUT_LAYER_STATS, OUT_MTP_HIDDEN, OUT_INDEXER_LOSS = range(
    len(ModelOutput._fields)
)


def layer_aux(aux_loss, z_loss, routing_stats, layer_stats, indexer_loss):
    """A layer's ``aux`` tuple (graph code), in :class:`LayerAux` order."""
    return aux_loss, z_loss, routing_stats, layer_stats, indexer_loss


def dense_layer_aux(num_routing_stats: int, num_layer_stats: int, num_experts: int, indexer_loss=None):
    """The ``aux`` of a layer without a router: zeros, and the indexer's loss when it has one."""
    zero = ops.zeros((), ms.float32)
    return layer_aux(
        zero,
        zero,
        ops.zeros((num_routing_stats, num_experts), ms.float32),
        ops.zeros((num_layer_stats,), ms.float32),
        zero if indexer_loss is None else indexer_loss,
    )


def model_output(head, aux_loss, z_loss, routing_stats, layer_stats, mtp_hidden, indexer_loss):
    """The model's output tuple (graph code), in :class:`ModelOutput` order."""
    return head, aux_loss, z_loss, routing_stats, layer_stats, mtp_hidden, indexer_loss
