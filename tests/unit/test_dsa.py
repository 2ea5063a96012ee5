"""DeepSeek Sparse Attention (model/dsa.py) against NumPy transcriptions of the published formulas (DeepSeek-V3.2
report; transformers 5.23 ``GlmMoeDsaIndexer`` for the indexer's layout), the selection against brute force, and
where gradients go. The logits against transformers' ``GlmMoeDsaForCausalLM``: tests/unit/test_hf_glm_moe_dsa.py.
"""

import dataclasses
import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from mindmoe.conf.checks import validate_run_config
from mindmoe.model.attention import document_causal_mask
from mindmoe.model.config import validate_model_config
from mindmoe.model.dsa import UNSELECTED, indexer_kl, select_top_k
from mindmoe.model.dsa_config import DSATrainingConfig, validate_dsa_training
from mindmoe.model.mla import set_dsa_stage
from mindmoe.model.outputs import OUT_HEAD, OUT_INDEXER_LOSS
from mindmoe.model.transformer import MoETransformer
from tests.helpers.dsa_models import randomize, tiny_dsa_config

SEQ = 12
TOPK = 4


def dsa_config(**dsa):
    return tiny_dsa_config(TOPK, dsa=dict(dict(index_n_heads=8, index_head_dim=8, index_topk=TOPK), **dsa))


@pytest.fixture(scope="module")
def model():
    built = MoETransformer(dsa_config())
    randomize(built)
    return built


def weight(cell_param):
    return cell_param.asnumpy().astype(np.float64)


def rope_interleaved_np(x, positions, theta, rotary_dim):
    """Rotate channel pairs (2i, 2i+1) of the first ``rotary_dim`` channels by ``position * theta^(-2i/d)``."""
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = positions[:, None] * inv_freq[None, :]  # [S, d/2]
    cos, sin = np.cos(angles), np.sin(angles)
    out = x.copy()
    even, odd = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    out[..., 0:rotary_dim:2] = even * cos - odd * sin
    out[..., 1:rotary_dim:2] = odd * cos + even * sin
    return out


def indexer_scores_np(indexer, x, q_resid, cfg):
    """``I[b, t, s] = sum_j w[b, t, j] ReLU(q[b, t, j] . k[b, s]) D^-0.5``, ``w = weights_proj(x) I^-0.5``."""
    heads, dim = cfg.dsa.index_n_heads, cfg.dsa.index_head_dim
    batch, seq_len, _ = x.shape
    positions = np.arange(seq_len, dtype=np.float64)
    q = (q_resid @ weight(indexer.wq_b.weight).T).reshape(batch, seq_len, heads, dim)
    k = x @ weight(indexer.wk.weight).T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * weight(indexer.k_norm.weight) + weight(indexer.k_norm.bias)
    q = rope_interleaved_np(q.transpose(0, 2, 1, 3), positions, cfg.rope_theta, cfg.qk_rope_head_dim)  # [B,I,S,D]
    k = rope_interleaved_np(k, positions, cfg.rope_theta, cfg.qk_rope_head_dim)  # [B, S, D]
    w = (x @ weight(indexer.weights_proj.weight).T) * heads**-0.5  # [B, S, I]
    relu = np.maximum(np.einsum("bitd,bsd->bits", q, k), 0.0) * dim**-0.5
    return np.einsum("bti,bits->bts", w, relu)


def test_indexer_scores_equal_the_published_formula(model):
    cfg = model.config
    attention = model.layers[0].self_attn
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, SEQ, cfg.hidden_size))
    q_resid = rng.normal(size=(2, SEQ, cfg.q_lora_rank))
    cos, sin = model.rotary_emb(ops.arange(SEQ, dtype=ms.int32))
    ours = attention.indexer(Tensor(x.astype(np.float32)), Tensor(q_resid.astype(np.float32)), cos, sin).asnumpy()
    expected = indexer_scores_np(attention.indexer, x, q_resid, cfg)
    assert np.abs(expected).max() > 1.0 and (expected < 0).any() and (expected > 0).any()
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-5)


def kl_np(probs, scores, keep):
    """``mean_t sum_{s in keep_t} p log(p / q)``: p = head-summed probs L1-normalised, q = softmax over keep."""
    p = probs.sum(1)
    p = p / p.sum(-1, keepdims=True)
    logits = np.where(keep, scores, -np.inf)
    log_q = logits - logits.max(-1, keepdims=True)
    log_q = log_q - np.log(np.exp(log_q).sum(-1, keepdims=True))
    terms = np.where(keep & (p > 0), p * (np.log(np.where(p > 0, p, 1.0)) - np.where(keep, log_q, 0.0)), 0.0)
    return terms.sum(-1).mean()


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_indexer_kl_equals_its_formula_on_a_hand_built_case(stage):
    # 1 sequence of 3 tokens, 2 heads; the last query's distribution puts weight on all three keys.
    probs = np.zeros((1, 2, 3, 3))
    probs[0, 0] = [[1, 0, 0], [0.25, 0.75, 0], [0.5, 0.3, 0.2]]
    probs[0, 1] = [[1, 0, 0], [0.6, 0.4, 0], [0.1, 0.1, 0.8]]
    scores = np.array([[[0.3, 9.0, -2.0], [1.0, -1.0, 4.0], [0.5, 2.0, -1.0]]])
    visible = np.tril(np.ones((3, 3), bool))[None]
    keep = visible.copy()
    if stage == "sparse":  # the last query keeps keys 0 and 2 (the attention there sees only those)
        keep[0, 2, 1] = False
        probs[0, :, 2, 1] = 0.0
        probs[0, :, 2] /= probs[0, :, 2].sum(-1, keepdims=True)
    mask = np.where(keep, 0.0, -1e9).astype(np.float32)
    ours = float(indexer_kl(Tensor(probs.astype(np.float32)), Tensor(scores.astype(np.float32)), Tensor(mask)))
    expected = kl_np(probs, scores, keep)
    # by hand for the first query: p = [1, 0, 0], q = [1, 0, 0] over its one visible key -> 0
    assert expected > 0.1
    np.testing.assert_allclose(ours, expected, rtol=1e-5)


def brute_force_keep(scores, doc_ids, topk):
    """``[B, S, P]`` bool: each query's ``min(topk, visible)`` highest-scoring visible keys, by sorting."""
    batch, seq_len, _ = scores.shape
    keep = np.zeros(scores.shape, bool)
    for b in range(batch):
        for t in range(seq_len):
            visible = [s for s in range(t + 1) if doc_ids[b, s] == doc_ids[b, t]]
            ranked = sorted(visible, key=lambda s: -scores[b, t, s])
            keep[b, t, ranked[:topk]] = True
    return keep


def test_selection_keeps_each_querys_top_k_visible_keys():
    rng = np.random.default_rng(2)
    scores = rng.normal(size=(2, 10, 10)).astype(np.float32)
    doc_ids = np.array([[0] * 6 + [1] * 4, [0] * 10], np.int32)
    visible = document_causal_mask(Tensor(doc_ids)).asnumpy()[:, 0]
    selected = select_top_k(Tensor(scores), Tensor(visible), 3).asnumpy()
    kept = (selected == 0) & (visible == 0)
    np.testing.assert_array_equal(kept, brute_force_keep(scores, doc_ids, 3))
    assert set(np.unique(selected)) == {0.0, UNSELECTED}


def softmax_np(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_sparse_attention_attends_exactly_to_the_selected_keys(model):
    """The layer's output equals attention over the brute-force top-k keys of its indexer's scores."""
    cfg = model.config
    attention = model.layers[0].self_attn
    rng = np.random.default_rng(3)
    x = Tensor(rng.normal(size=(2, SEQ, cfg.hidden_size)).astype(np.float32))
    doc_ids = np.zeros((2, SEQ), np.int32)
    doc_ids[1, 7:] = 1
    cos, sin = model.rotary_emb(ops.arange(SEQ, dtype=ms.int32))
    mask = document_causal_mask(Tensor(doc_ids), cfg.num_heads)
    out, _ = attention.indexed_attention(x, cos, sin, mask)
    q, k, v = (t.asnumpy().astype(np.float64) for t in attention.project_qkv(x, cos, sin))
    q_resid = attention.q_a_layernorm(attention.q_a_proj(x))
    scores = attention.indexer(x, q_resid, cos, sin).asnumpy()
    keep = brute_force_keep(scores, doc_ids, TOPK)
    assert (keep.sum(-1) == TOPK).sum() > SEQ, "most queries must have more visible keys than they keep"
    logits = np.einsum("bnsd,bnpd->bnsp", q, k) * attention.scale
    probs = softmax_np(np.where(keep[:, None], logits, -np.inf))
    heads = np.einsum("bnsp,bnpd->bsnd", probs, v).reshape(2, SEQ, -1)
    expected = heads @ weight(attention.o_proj.weight).T
    np.testing.assert_allclose(out.asnumpy(), expected, atol=1e-4, rtol=1e-4)
    dense = softmax_np(np.where(brute_force_keep(scores, doc_ids, SEQ)[:, None], logits, -np.inf))
    dense_out = np.einsum("bnsp,bnpd->bsnd", dense, v).reshape(2, SEQ, -1) @ weight(attention.o_proj.weight).T
    assert np.abs(dense_out - expected).max() > 1e-2, "the selection must change the output"


def gradients(model, output_index, probe):
    """Gradients of ``sum(outputs[0] * probe)`` (logits) or of the indexer loss per parameter."""
    params = model.trainable_params()
    ids = Tensor(np.random.default_rng(4).integers(0, 64, (2, SEQ)).astype(np.int32))
    docs = Tensor(np.zeros((2, SEQ), np.int32))

    def objective(ids_BS, docs_BS):
        outputs = model(ids_BS, docs_BS)
        return (outputs[OUT_HEAD] * Tensor(probe)).sum() if output_index == 0 else outputs[OUT_INDEXER_LOSS]

    _, grads = ms.value_and_grad(ms.jit(objective), None, params)(ids, docs)
    return {p.name: g.asnumpy() for p, g in zip(params, grads)}


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_the_indexer_learns_only_from_its_loss_and_its_loss_trains_nothing_else(model, stage):
    set_dsa_stage(model, stage)
    try:
        probe = np.random.default_rng(5).normal(size=(2, SEQ, 64)).astype(np.float32)
        lm = gradients(model, 0, probe)
        kl = gradients(model, -1, probe)
    finally:
        set_dsa_stage(model, "sparse")
    indexer = [name for name in lm if ".indexer." in name]
    others = [name for name in lm if ".indexer." not in name]
    assert len(indexer) == 10  # 5 tensors in each of 2 layers
    for name in indexer:
        assert not np.any(lm[name]), f"{name}: the LM loss reached the indexer"
        assert np.abs(kl[name]).max() > 1e-6, f"{name}: the indexer's loss does not train it"
    for name in others:
        assert not np.any(kl[name]), f"{name}: the indexer's loss reached the main model"
    assert sum(np.abs(lm[name]).max() > 0 for name in others) >= len(others) - 2  # router bias-free paths may be 0


@pytest.mark.parametrize(
    "dsa, attention, message",
    [
        (dict(index_n_heads=4), dict(attention_type="gqa"), "model.dsa.index_n_heads=4: the DSA indexer belongs"),
        (dict(index_n_heads=4), dict(q_lora_rank=None), "set model.q_lora_rank"),
        (dict(index_n_heads=4, index_head_dim=2), {}, "model.dsa.index_head_dim=2: must be even and at least"),
    ],
)
def test_config_refuses_what_dsa_cannot_do_naming_the_key(dsa, attention, message):
    cfg = dsa_config(**dsa)
    for key, value in attention.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_model_config(cfg)


def test_unknown_dsa_key_is_refused_and_a_training_key_names_its_section():
    with pytest.raises(ValueError, match=r"model.dsa.index_topk_freq: unknown key"):
        dsa_config(index_topk_freq=2)
    with pytest.raises(ValueError, match=r"model.dsa.stage is now dsa.stage"):
        dsa_config(index_n_heads=4, stage="off")


@pytest.mark.parametrize(
    "training, message",
    [
        (dict(stage="dense_warmup"), "dsa.warmup_steps=0: must be > 0"),
        (dict(warmup_steps=5), "dsa.warmup_steps=5: is only read with"),
        (dict(stage="sparse_only"), "dsa.stage='sparse_only': must be one of"),
        (dict(indexer_loss_coeff=-1.0), "dsa.indexer_loss_coeff=-1.0: must be >= 0"),
    ],
)
def test_the_training_schedule_refuses_what_it_cannot_do_naming_the_key(training, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_dsa_training(DSATrainingConfig(**training))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        MoETransformer(dsa_config(index_n_heads=4), dsa=DSATrainingConfig(**training))


def test_an_old_state_json_with_the_stage_in_model_dsa_reads_both_halves(tmp_path):
    from mindmoe.model.checkpoints.files import STATE_FILE, checkpoint_dsa_training, checkpoint_model_config

    old = dataclasses.asdict(dsa_config(index_n_heads=4))
    old["dsa"].update(stage="dense_warmup", warmup_steps=7, indexer_loss_coeff=0.5)
    (tmp_path / STATE_FILE).write_text(json.dumps({"model_config": old}))
    assert checkpoint_model_config(tmp_path).dsa == dsa_config(index_n_heads=4).dsa
    assert checkpoint_dsa_training(tmp_path) == DSATrainingConfig("dense_warmup", 7, 0.5)
    (tmp_path / STATE_FILE).write_text(json.dumps({"model_config": old, "dsa_config": {"stage": "off"}}))
    assert checkpoint_dsa_training(tmp_path) == DSATrainingConfig(stage="off")


def test_lora_refuses_the_dense_warmup():
    from omegaconf import OmegaConf

    from mindmoe.conf.schema import Config

    cfg = OmegaConf.structured(Config)
    cfg.lora.enabled = True
    cfg.model.dsa.index_n_heads = 4
    cfg.dsa.stage = "dense_warmup"
    cfg.dsa.warmup_steps = 3
    with pytest.raises(ValueError, match="dsa.stage=dense_warmup with lora.enabled=true"):
        validate_run_config(cfg, "CPU")
