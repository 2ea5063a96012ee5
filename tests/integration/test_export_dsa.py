"""Serving graphs of DeepSeek Sparse Attention (GLM-5; model/dsa.py) against the training model.

A tiny DSA model (MLA with query compression and interleaved RoPE, a dense first layer, 8 indexer heads keeping
``index_topk=5`` keys, fewer than the prompts so the selection matters) with O(1) random weights is exported once
with :func:`export_mindir`; the graphs, loaded back by :class:`ExportedModel`, must give the training model's
(stage sparse) last-position logits at two prompt shapes, its logits at every decode step with the latent +
indexer-key cache, and its greedy tokens by full recompute. The same weights with ``dsa.stage=off`` give
other logits, so the checks see the selection. The indexer's scores of every compared sequence have no near-tie at
the ``index_topk``-th key (a tie would let the graphs and training keep different keys; model/dsa.py).
"""

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from mindmoe.model.attention import document_causal_mask
from mindmoe.model.dsa_config import DSATrainingConfig
from mindmoe.model.export.mindir import cache_layout, export_mindir
from mindmoe.model.export.mla_serving import serving_dsa_stage
from mindmoe.model.export.runner import MANIFEST_FILE, ExportedModel
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.export.config import ExportConfig
from mindmoe.train.export.exporter import ExportSource, build_manifest, serve_dsa_sparse
from tests.helpers.dsa_models import randomize, tiny_dsa_config
from tests.helpers.greedy_decode import assert_decode_steps_match, greedy_by_recompute

VOCAB, TOPK, ATOL, NEW_TOKENS = 64, 5, 1e-4, 8
# Rank, RoPE and indexer widths of a cache row (kv_lora_rank, qk_rope_head_dim, index_head_dim).
RANK, ROPE, INDEX_DIM = 16, 4, 8
CONFIG = tiny_dsa_config(
    TOPK,
    num_layers=3,
    kv_lora_rank=RANK,
    qk_rope_head_dim=ROPE,
    max_position_embeddings=64,
    dsa=dict(index_n_heads=8, index_head_dim=INDEX_DIM, index_topk=TOPK),
)


#: Serving runs dropless; the training models it is compared with do too.
DROPLESS = MoEConfig(dispatch="dropless")


#: DSA in stage off: the indexer exists (its weights) but does not run.
OFF = DSATrainingConfig(stage="off")


def dynamic(model):
    """``model`` compiled once for any batch and length."""
    model.set_train(False)
    model.set_inputs(Tensor(shape=[None, None], dtype=ms.int32), Tensor(shape=[None, None], dtype=ms.int32))
    return model


def training_logits(model, ids):
    """The training forward's logits ``[B, S, V]`` of prompts ``ids`` (one document each)."""
    return model(Tensor(ids), Tensor(np.zeros_like(ids)))[OUT_HEAD].asnumpy()


class IndexerScores(nn.Cell):
    """The training forward of ``model`` (its layers' own ``construct``) returning each layer's indexer scores of
    its normed input ``[L, B, S, S]``, the scores the sparse stage ranks."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, input_ids, doc_ids):
        model = self.model
        cos, sin = model.rotary_emb(ops.arange(input_ids.shape[1], dtype=ms.int32))
        mask = document_causal_mask(doc_ids, model.config.num_heads)
        x = model.embed(input_ids)
        scores = []
        for layer in model.layers:
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            scores.append(attn.indexer(h, attn.query_residual(h), cos, sin).expand_dims(0))
            x, _ = layer(x, cos, sin, mask, doc_ids)
        return ops.concat(scores, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(training model (sparse, dynamic shapes), the same weights with stage off, indexer scores cell, exported)``;
    O(1) random weights (tests/helpers/dsa_models.py), so attention is far from uniform and the scores spread."""
    model = MoETransformer(CONFIG, moe=DROPLESS)
    randomize(model)
    dense = MoETransformer(CONFIG, moe=DROPLESS, dsa=OFF)
    weights = {param.name: param for param in model.get_parameters()}
    for param in dense.get_parameters():
        param.set_data(Tensor(weights[param.name].asnumpy()))
    scores = IndexerScores(model)
    scores.set_train(False)
    scores.set_inputs(Tensor(shape=[None, None], dtype=ms.int32), Tensor(shape=[None, None], dtype=ms.int32))

    out = tmp_path_factory.mktemp("dsa_export")
    graphs = export_mindir(model, out, "fp32")
    source = ExportSource("checkpoint", out, model.config, None, {})
    manifest = build_manifest(source, model.config, ExportConfig(out=str(out)), graphs, [])
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return dynamic(model), dynamic(dense), scores, ExportedModel(out)


def prompt(batch, length, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype(np.int32)


def assert_no_tie_at_top_k(scores_cell, ids):
    """Every query with more than ``index_topk`` visible keys has a clear gap between its k-th and (k+1)-th best
    indexer score in every layer (so float rounding cannot change which keys are kept)."""
    scores_LBSS = scores_cell(Tensor(ids), Tensor(np.zeros_like(ids))).asnumpy()
    gaps = []
    for t in range(TOPK, ids.shape[1]):
        ranked = -np.sort(-scores_LBSS[:, :, t, : t + 1], -1)
        gaps.append((ranked[..., TOPK - 1] - ranked[..., TOPK]) / np.maximum(1.0, np.abs(ranked[..., TOPK - 1])))
    assert np.abs(scores_LBSS).max() > 1.0, "indexer scores must spread for the selection to mean anything"
    assert np.min(gaps) > 1e-4, f"near-tie at the top-{TOPK} boundary: pick another prompt seed"


def test_prefill_gives_the_sparse_training_models_last_position_logits_at_two_shapes(models):
    model, dense, scores, exported = models
    for batch, length in ((2, 7), (1, 19)):
        ids = prompt(batch, length, seed=length)
        assert_no_tie_at_top_k(scores, ids)
        logits, cache = exported.prefill(Tensor(ids))
        expected = training_logits(model, ids)[:, -1]
        assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
        np.testing.assert_allclose(logits.asnumpy(), expected, rtol=0, atol=ATOL)
        assert cache.shape == (CONFIG.num_layers, batch, length, RANK + ROPE + INDEX_DIM)
        # The selection matters: the same weights attending densely give other logits.
        assert np.abs(training_logits(dense, ids)[:, -1] - expected).max() > 1e-2


def test_decode_with_the_indexer_key_cache_gives_training_logits_and_greedy_tokens(models):
    model, _, scores, exported = models
    ids = prompt(2, 11, seed=5)  # 11 + 8 positions: every decode step selects 5 of more cached keys
    # greedy by full recompute in the training model (no cache)
    sequence, expected_logits = greedy_by_recompute(lambda seq: training_logits(model, seq)[:, -1], ids, NEW_TOKENS)
    assert_no_tie_at_top_k(scores, sequence)
    np.testing.assert_array_equal(exported.generate(ids, max_new_tokens=NEW_TOKENS), sequence[:, ids.shape[1] :])

    # Every decode step's logits, fed the same tokens, against the training model's at that position.
    cache = assert_decode_steps_match(exported, ids, sequence, expected_logits, ATOL)
    capacity = ids.shape[1] + NEW_TOKENS
    # The decode graph wrote each token's row, indexer key included, as prefill computes it.
    _, full_cache = exported.prefill(Tensor(sequence[:, :-1]))
    np.testing.assert_allclose(cache.asnumpy()[:, :, : capacity - 1], full_cache.asnumpy(), rtol=0, atol=ATOL)


def test_manifest_states_the_latent_and_indexer_key_cache(models):
    manifest = models[3].manifest
    width = RANK + ROPE + INDEX_DIM
    cache = manifest["cache"]
    assert cache["kind"] == "mla_latent_dsa" and cache["length_axis"] == 2
    assert cache["shape"] == [CONFIG.num_layers, "batch", "cache_len", width]
    assert cache["values_per_token_per_layer"] == width and cache["values_per_token"] == CONFIG.num_layers * width
    assert [(part["name"], part["start"], part["values"]) for part in cache["row"]] == [
        ("c_kv", 0, RANK),
        ("k_rope", RANK, ROPE),
        ("index_k", RANK + ROPE, INDEX_DIM),
    ]
    assert "index_topk=5" in cache["description"]
    prefill, decode = manifest["graphs"]["prefill"], manifest["graphs"]["decode"]
    assert [(entry["name"], entry["shape"], entry["dtype"]) for entry in prefill["inputs"]] == [
        ("input_ids", ["batch", "prompt_len"], "int32")
    ]
    assert [entry["name"] for entry in prefill["outputs"]] == ["logits", "kv_cache"]
    assert prefill["outputs"][1]["shape"] == [CONFIG.num_layers, "batch", "prompt_len", width]
    assert [entry["name"] for entry in decode["inputs"]] == ["input_ids", "kv_cache", "position"]
    assert manifest["cache"]["kind"] == "mla_latent_dsa"  # stage sparse: the indexer's keys are cached


def test_stage_off_caches_the_plain_latent_and_exports_serve_dense_warmup_sparse():
    layout = cache_layout(CONFIG, "fp32", "off")
    assert layout["kind"] == "mla_latent" and layout["values_per_token_per_layer"] == RANK + ROPE
    assert [part["name"] for part in layout["row"]] == ["c_kv", "k_rope"]
    warmup = DSATrainingConfig(stage="dense_warmup", warmup_steps=3)
    notes = []
    model = serve_dsa_sparse(MoETransformer(CONFIG, moe=DROPLESS, dsa=warmup), notes)
    assert model.dsa_training.stage == "sparse" and model.dsa_training.warmup_steps == 0
    assert all(layer.self_attn.dsa_stage == "sparse" for layer in model.layers)
    assert serving_dsa_stage(model) == "sparse"
    assert "dsa.stage='dense_warmup' exported as 'sparse'" in notes[0]
    off = MoETransformer(CONFIG, moe=DROPLESS, dsa=OFF)
    assert serve_dsa_sparse(off, notes).dsa_training.stage == "off" and len(notes) == 1
    assert serving_dsa_stage(off) == "off"
    with pytest.raises(ValueError, match=r"the DSA layers run \['dense_warmup'\]"):
        serving_dsa_stage(MoETransformer(CONFIG, moe=DROPLESS, dsa=warmup))
