"""One output layout for the model and for each decoder layer (model/outputs.py), whatever the model has: absent
terms are zeros (MTP's hidden rows: empty), so consumers read fields by name."""

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe.layer import LAYER_STATS, ROUTING_STATS
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import LayerAux, ModelOutput
from mindmoe.model.transformer import MoETransformer

VOCAB, HIDDEN, EXPERTS, BATCH, SEQ = 23, 16, 4, 2, 8


def tiny_model(**changes) -> MoETransformer:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=3,
        first_k_dense=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_experts=EXPERTS,
    )
    values.update(changes)
    return MoETransformer(ModelConfig(**values), seed=3, moe=MoEConfig(dispatch="dropless"))


def inputs():
    ids = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    return Tensor(ids), Tensor(np.zeros((BATCH, SEQ), np.int32))


def test_the_model_returns_every_field_and_absent_terms_are_zero():
    out = ModelOutput.of(tiny_model()(*inputs()))
    assert out.head.shape == (BATCH, SEQ, VOCAB)
    assert out.routing_stats.shape == (2, len(ROUTING_STATS), EXPERTS)  # one row per MoE layer, none for the dense
    assert out.layer_stats.shape == (2, len(LAYER_STATS))
    assert float(out.aux_loss.asnumpy()) > 0 and float(out.z_loss.asnumpy()) > 0
    assert out.mtp_hidden.shape == (0,)
    assert float(out.indexer_loss.asnumpy()) == 0.0


def test_mtp_fills_its_field_and_the_layout_stays():
    model = tiny_model(mtp_layers=2)
    ids, docs = inputs()
    future = Tensor(np.random.default_rng(1).integers(0, VOCAB, (2, BATCH, SEQ)).astype(np.int32))
    without = ModelOutput.of(model(ids, docs, True))
    out = ModelOutput.of(model(ids, docs, True, future))
    assert len(out) == len(without) == len(ModelOutput._fields)
    np.testing.assert_array_equal(out.head.asnumpy(), without.head.asnumpy())
    assert out.head.shape == (BATCH * SEQ, HIDDEN)
    assert out.mtp_hidden.shape == (2, BATCH * SEQ, HIDDEN)
    assert without.mtp_hidden.shape == (0,)
    # The MTP routers' statistics stay out of the per-layer rows; their losses join the sums.
    np.testing.assert_array_equal(out.routing_stats.asnumpy(), without.routing_stats.asnumpy())
    assert float(out.aux_loss.asnumpy()) > float(without.aux_loss.asnumpy())


def test_a_dense_layer_returns_zeros_in_the_moe_layers_aux_layout():
    model = tiny_model()
    _, docs = inputs()
    cos, sin = model.rotary_emb(ops.arange(SEQ, dtype=ms.int32))
    x = Tensor(np.random.default_rng(2).normal(size=(BATCH, SEQ, HIDDEN)).astype(np.float32))
    masks = model.attention_masks(docs)
    dense = [LayerAux.of(model.layers[0](x, cos, sin, masks, docs)[1])]
    moe = [LayerAux.of(model.layers[1](x, cos, sin, masks, docs)[1])]
    for field in LayerAux._fields:
        assert getattr(dense[0], field).shape == getattr(moe[0], field).shape, field
        assert not getattr(dense[0], field).asnumpy().any(), field
    assert moe[0].routing_stats.asnumpy().sum() > 0
