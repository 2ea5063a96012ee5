"""Grouped-query attention vs HF ``Glm4MoeAttention`` (4.57.1, eager, fp32) and the
document-causal mask vs a NumPy transcription of its definition.

Setup: 4 query heads, 2 key/value heads, head_dim 8, q/k/v bias, QK RMSNorm, partial
rotary 0.5 (the first 4 channels rotate, rotate_half layout).
"""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeAttention, Glm4MoeRotaryEmbedding

from mindmoe.model.attention import Attention, causal_chunks, document_causal_mask
from mindmoe.model.config import ModelConfig
from mindmoe.model.rope import default_inv_freq, rope_tables

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 32, 4, 2, 8, 32


def reference_allowed(doc_ids_BS):
    """``allowed[b, i, j]``: key j is not in the future of query i and both are in one document."""
    seq_len = doc_ids_BS.shape[1]
    not_future = np.tril(np.ones((seq_len, seq_len), bool))
    same_doc = doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :]
    return same_doc & not_future


def randomize(cell, seed):
    """Replace the tiny init with O(1) weights so attention is far from uniform."""
    rng = np.random.default_rng(seed)
    for name, param in cell.parameters_and_names():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.2 * rng.normal(size=param.shape)
        elif name.endswith("bias"):
            value = 0.1 * rng.normal(size=param.shape)
        else:
            value = 0.3 * rng.normal(size=param.shape)
        param.set_data(Tensor(value.astype(np.float32)))


@pytest.fixture(scope="module")
def attention():
    cfg = ModelConfig(
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        qkv_bias=True,
        qk_norm=True,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
    )
    cell = Attention(cfg, np.random.default_rng(0))
    randomize(cell, seed=1)
    cos, sin = rope_tables(default_inv_freq(cfg.rotary_dim, cfg.rope_theta), MAX_POS, interleaved=False)
    return cell, cos, sin


@pytest.fixture(scope="module")
def hf_attention(attention):
    cell = attention[0]
    config = Glm4MoeConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
        attention_bias=True,
        use_qk_norm=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=MAX_POS,
        attn_implementation="eager",
    )
    module = Glm4MoeAttention(config, layer_idx=0).eval()
    ours = {name: torch.from_numpy(param.asnumpy()) for name, param in cell.parameters_and_names()}
    assert set(ours) == set(module.state_dict()), "parameter names must match HF one to one"
    module.load_state_dict(ours, strict=True)
    return module, Glm4MoeRotaryEmbedding(config)


def run_ours(attention, x_BSH, doc_ids_BS):
    cell, cos, sin = attention
    seq_len = x_BSH.shape[1]
    mask = document_causal_mask(Tensor(doc_ids_BS.astype(np.int32)))
    return cell(Tensor(x_BSH), cos[:seq_len], sin[:seq_len], mask).asnumpy()


def run_hf(hf_attention, x_BSH, doc_ids_BS):
    module, rotary = hf_attention
    batch, seq_len, _ = x_BSH.shape
    x = torch.from_numpy(x_BSH)
    position_ids = torch.arange(seq_len)[None].expand(batch, -1)
    cos, sin = rotary(x, position_ids)
    additive = np.where(reference_allowed(doc_ids_BS), 0.0, torch.finfo(torch.float32).min)
    mask = torch.from_numpy(additive.astype(np.float32))[:, None]
    with torch.no_grad():
        out, _ = module(x, position_embeddings=(cos, sin), attention_mask=mask)
    return out.numpy()


def test_attention_matches_hf_glm4_moe_attention_with_causal_mask(attention, hf_attention):
    x = np.random.default_rng(3).normal(size=(2, 9, HIDDEN)).astype(np.float32)
    doc_ids = np.zeros((2, 9), np.int64)
    np.testing.assert_allclose(run_ours(attention, x, doc_ids), run_hf(hf_attention, x, doc_ids), atol=1e-5, rtol=1e-5)


def test_attention_matches_hf_glm4_moe_attention_with_document_mask(attention, hf_attention):
    x = np.random.default_rng(4).normal(size=(2, 12, HIDDEN)).astype(np.float32)
    doc_ids = np.array([[0] * 5 + [1] * 7, [0] * 2 + [1] * 6 + [2] * 4])
    np.testing.assert_allclose(run_ours(attention, x, doc_ids), run_hf(hf_attention, x, doc_ids), atol=1e-5, rtol=1e-5)


def test_packed_documents_equal_each_document_run_alone_from_position_zero(attention):
    # RoPE is relative, so document 1 at packed positions 5..11 must equal the same tokens at 0..6.
    x = np.random.default_rng(5).normal(size=(1, 12, HIDDEN)).astype(np.float32)
    packed = run_ours(attention, x, np.array([[0] * 5 + [1] * 7]))
    first_alone = run_ours(attention, x[:, :5], np.zeros((1, 5), np.int64))
    second_alone = run_ours(attention, x[:, 5:], np.zeros((1, 7), np.int64))
    np.testing.assert_allclose(packed[:, :5], first_alone, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(packed[:, 5:], second_alone, atol=1e-5, rtol=1e-5)
    # And packing does change the output when the mask is ignored, so the check above has teeth.
    unmasked = run_ours(attention, x, np.zeros((1, 12), np.int64))
    assert np.abs(unmasked[:, 5:] - second_alone).max() > 1e-2


def check_mask_against_reference(mask_B1SS, doc_ids_BS):
    allowed = reference_allowed(doc_ids_BS)
    assert mask_B1SS.shape == (doc_ids_BS.shape[0], 1) + allowed.shape[1:]
    assert mask_B1SS.dtype == np.float32
    mask = mask_B1SS[:, 0]
    assert np.all(mask[allowed] == 0.0)
    # Blocked entries must vanish in softmax next to any O(1e3) score.
    assert np.all(mask[~allowed] <= -1e9)


DOC_IDS = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 7, 7, 9, 9]])


def test_document_causal_mask_blocks_other_documents_and_the_future():
    check_mask_against_reference(document_causal_mask(Tensor(DOC_IDS.astype(np.int32))).asnumpy(), DOC_IDS)


def test_document_causal_mask_under_jit_blocks_other_documents_and_the_future():
    mask = ms.jit(document_causal_mask)(Tensor(DOC_IDS.astype(np.int32))).asnumpy()
    check_mask_against_reference(mask, DOC_IDS)


def test_document_causal_mask_chunks_are_the_visible_blocks_of_the_full_mask():
    doc_ids = np.array([[0] * 3 + [1] * 9, [4] * 12])
    chunks = ms.jit(document_causal_mask, static_argnums=(1, 2))(Tensor(doc_ids.astype(np.int32)), 3, 4)
    assert len(chunks) == 4
    allowed = reference_allowed(doc_ids)
    for c, chunk in enumerate(chunks):
        chunk = chunk.asnumpy()
        assert chunk.shape == (2, 3, 3, 3 * (c + 1))  # 3 heads, 3 queries, the keys up to the chunk's end
        expected = np.where(allowed[:, 3 * c : 3 * (c + 1), : 3 * (c + 1)], 0.0, chunk.min())
        np.testing.assert_array_equal(chunk, np.broadcast_to(expected[:, None], chunk.shape))
        # Everything the chunk leaves out is in the future of all its queries.
        assert not allowed[:, 3 * c : 3 * (c + 1), 3 * (c + 1) :].any()
    assert causal_chunks(512) == 4 and causal_chunks(256) == 2 and causal_chunks(200) == 1
    assert causal_chunks(384) == 2  # 96-query chunks would be too small


def test_chunked_attention_equals_hf_and_the_unchunked_gradients(attention, hf_attention):
    cell, cos, sin = attention
    x = np.random.default_rng(6).normal(size=(2, 12, HIDDEN)).astype(np.float32)
    doc_ids = np.array([[0] * 5 + [1] * 7, [0] * 2 + [1] * 6 + [2] * 4])
    doc_ids_t = Tensor(doc_ids.astype(np.int32))
    upstream = Tensor(np.random.default_rng(7).normal(size=x.shape).astype(np.float32))

    def loss(x_BSH, mask):
        return (cell(x_BSH, cos[:12], sin[:12], mask) * upstream).sum()

    grad = ms.jit(ms.value_and_grad(loss, 0, cell.trainable_params()))
    full_value, (full_dx, full_dw) = grad(Tensor(x), document_causal_mask(doc_ids_t, HEADS))
    chunked = document_causal_mask(doc_ids_t, HEADS, 3)
    value, (dx, dw) = grad(Tensor(x), chunked)
    out = cell(Tensor(x), cos[:12], sin[:12], chunked).asnumpy()
    np.testing.assert_allclose(out, run_hf(hf_attention, x, doc_ids), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(value.asnumpy(), full_value.asnumpy(), rtol=1e-5)
    np.testing.assert_allclose(dx.asnumpy(), full_dx.asnumpy(), atol=1e-5, rtol=1e-4)
    for chunked_grad, full_grad in zip(dw, full_dw):
        np.testing.assert_allclose(chunked_grad.asnumpy(), full_grad.asnumpy(), atol=1e-5, rtol=1e-4)
