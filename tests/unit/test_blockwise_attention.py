"""The ``blockwise_attention`` kernel (blocks, online softmax, recomputing backward) against torch autograd of
plain softmax attention with the document-causal mask; the model on its blockwise path against HF; the
Ascend branch's FlashAttentionScore call against the installed MindSpore 2.9."""

import ast
import inspect
import math

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor

from mindmoe.model import attention, kernels
from mindmoe.model.kernels import ascend_attention, cpu_attention
from mindmoe.model.kernels.attention_masks import document_discard_mask
from mindmoe.model.outputs import OUT_HEAD
from tests.unit.test_transformer_hf import build_pair, hf_logits, ours_config


def doc_ids_of(lengths):
    return np.stack([np.repeat(np.arange(len(row)), row) for row in lengths]).astype(np.int32)


def allowed_of(doc_ids_BS):
    """``[B, S, S]`` bool: key j <= query i and both in one document."""
    seq_len = doc_ids_BS.shape[1]
    causal = np.tril(np.ones((seq_len, seq_len), bool))
    return (doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :]) & causal


def reference(q_BNSD, k_BGSD, v_BGSD, doc_ids_BS, upstream_BNSD):
    """float64 ``sum(upstream * softmax(q k^T / sqrt(D), masked) v)`` with HF's repeat_kv, and its gradients."""
    q, k, v = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q_BNSD, k_BGSD, v_BGSD))
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.from_numpy(allowed_of(doc_ids_BS))[:, None], float("-inf"))
    out = torch.softmax(scores, -1) @ v.repeat_interleave(group, 1)
    (out * torch.tensor(upstream_BNSD, dtype=torch.float64)).sum().backward()
    return out.detach().numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


# Row 0 of the first case: query block [8, 11) is document 2, and key block [0, 4) holds only document
# 0, so its first block's keys are all masked (the online softmax must discard that block's running
# statistics). 11 = 2 * 4 + 3: the last block is shorter.
CASES = [
    # heads, kv_heads, block, lengths per row, score scale
    (4, 2, 4, [[3, 5, 3], [5, 6]], 1.0),
    (6, 2, 3, [[2, 4, 3], [9]], 1.0),
    (3, 3, 4, [[8], [1, 7]], 1.0),
    (4, 1, 4, [[6, 6], [2, 2, 8]], 30.0),  # scores of hundreds: exp overflows without the running max
    (2, 1, 16, [[5], [2, 3]], 1.0),  # one block, shorter than block_size
    # Several documents per row: query blocks 3 and 4 share no document with key blocks 0 and 1 in
    # either row (those four pairs are skipped); pairs (1, 0), (2, 0) and (4, 2) share one in row 1
    # only, so they are computed and row 0 masks them entirely.
    (4, 2, 4, [[4, 6, 5, 3], [3, 7, 8]], 1.0),
]


@pytest.mark.parametrize("heads,kv_heads,block,lengths,score_scale", CASES)
def test_blockwise_attention_values_and_gradients_match_torch(heads, kv_heads, block, lengths, score_scale):
    doc_ids = doc_ids_of(lengths)
    batch, seq_len = doc_ids.shape
    head_dim = 8
    rng = np.random.default_rng(heads * 10 + seq_len)
    q = (score_scale * rng.normal(size=(batch, heads, seq_len, head_dim))).astype(np.float32)
    k = rng.normal(size=(batch, kv_heads, seq_len, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, kv_heads, seq_len, head_dim)).astype(np.float32)
    upstream = rng.normal(size=q.shape).astype(np.float32)
    kernel = kernels.blockwise_attention(1.0 / math.sqrt(head_dim), block, "CPU")

    def weighted(q_BNSD, k_BGSD, v_BGSD, doc_ids_BS):
        out_BNSD = kernel(q_BNSD, k_BGSD, v_BGSD, doc_ids_BS)
        return (out_BNSD * Tensor(upstream)).sum(), out_BNSD

    # Compiled as training runs it: a GRAPH_MODE jit of the gradient, through the hand-written bprop.
    (_, out), grads = ms.jit(ms.value_and_grad(weighted, (0, 1, 2), has_aux=True))(
        Tensor(q), Tensor(k), Tensor(v), Tensor(doc_ids)
    )
    expected = reference(q, k, v, doc_ids, upstream)
    tolerance = dict(rtol=1e-4, atol=1e-5 * score_scale)
    np.testing.assert_allclose(out.asnumpy(), expected[0], **tolerance)
    for name, grad, want in zip("qkv", grads, expected[1:]):
        assert np.abs(want).max() > 0.1, f"d{name} must be far from zero for the check to mean anything"
        np.testing.assert_allclose(grad.asnumpy(), want, err_msg=f"d{name}", **tolerance)


def test_key_blocks_sharing_no_document_with_the_query_block_are_never_read():
    # Documents [0, 4), [4, 9), [9, 14) in blocks of 4: the keys and values of block 0 (document 0
    # alone) are NaN. Query blocks 1..3 share no document with it, so it is skipped and their outputs
    # are exact; had it been computed, its masked scores would still put NaN in every row.
    lengths = [[4, 5, 5]]
    doc_ids = doc_ids_of(lengths)
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=(1, heads, 14, 8)).astype(np.float32) for heads in (4, 2, 2))
    kernel = kernels.blockwise_attention(1.0 / math.sqrt(8), 4, "CPU")
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[:, :, :4], v_nan[:, :, :4] = np.nan, np.nan

    def forward(q_BNSD, k_BGSD, v_BGSD, doc_ids_BS):
        return kernel(q_BNSD, k_BGSD, v_BGSD, doc_ids_BS)

    out = ms.jit(forward)(Tensor(q), Tensor(k_nan), Tensor(v_nan), Tensor(doc_ids)).asnumpy()
    expected = reference(q, k, v, doc_ids, np.zeros_like(q))[0]
    assert np.isnan(out[:, :, :4]).all()
    np.testing.assert_allclose(out[:, :, 4:], expected[:, :, 4:], rtol=1e-4, atol=1e-5)


def test_blocks_cover_the_sequence_with_a_shorter_last_block():
    assert cpu_attention.block_bounds(11, 4) == [(0, 4), (4, 8), (8, 11)]
    assert cpu_attention.block_bounds(8, 4) == [(0, 4), (4, 8)]
    assert cpu_attention.block_bounds(3, 4) == [(0, 3)]


def test_discard_mask_for_flash_attention_is_the_complement_of_the_document_causal_mask():
    doc_ids = doc_ids_of([[3, 5, 3], [5, 6]])
    mask = ms.jit(document_discard_mask)(Tensor(doc_ids)).asnumpy()
    assert mask.dtype == np.bool_ and mask.shape == (2, 1, 11, 11)
    np.testing.assert_array_equal(mask[:, 0], ~allowed_of(doc_ids))


def test_training_forward_passes_document_ids_past_the_block_size_and_chunked_masks_below(monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_SIZE", 8)
    long_ids, short_ids = Tensor(np.zeros((2, 9), np.int32)), Tensor(np.zeros((2, 8), np.int32))
    assert attention.training_attention_masks(long_ids, 4, True) is long_ids
    for ids, blockwise in ((short_ids, True), (long_ids, False)):
        mask = attention.training_attention_masks(ids, 4, blockwise)
        assert mask.shape == (2, 4) + ids.shape[1:] * 2 and mask.dtype == ms.float32


def test_model_on_the_blockwise_path_gives_hf_logits_for_each_packed_document(monkeypatch):
    # 20 positions in blocks of 8 (the last one 4): every layer runs the blockwise kernel, built with
    # the patched block size; HF runs each document alone from position 0.
    monkeypatch.setattr(attention, "BLOCK_SIZE", 8)
    monkeypatch.setattr(attention, "BLOCKWISE_DEVICES", ("CPU",))
    ours, hf = build_pair(ours_config(), seed=3)
    assert ours.layers[0].self_attn.use_blockwise and ours.layers[0].self_attn.blockwise.core.block_size == 8
    lengths = [[9, 11], [3, 13, 4]]
    doc_ids = doc_ids_of(lengths)
    ids = np.random.default_rng(3).integers(0, ours.config.vocab_size, size=doc_ids.shape).astype(np.int32)
    logits = ours(Tensor(ids), Tensor(doc_ids))[OUT_HEAD].asnumpy()
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            alone = hf_logits(hf, ids[row : row + 1, start : start + length])[0]
            assert np.abs(alone).max() > 1.0
            np.testing.assert_allclose(logits[row, start : start + length], alone, atol=1e-4, rtol=0)
            start += length


def test_the_ascend_kernel_calls_flash_attention_score_with_arguments_mindspore_2_9_takes():
    """FlashAttentionScore has no CPU kernel: check the call's arguments against the installed op, and
    that the layout and mask it relies on are the documented ones."""
    assert ms.__version__.startswith("2.9")
    params = inspect.signature(ms.ops.flash_attention_score).parameters
    assert list(params)[:4] == ["query", "key", "value", "head_num"]
    (call,) = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(ascend_attention)))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "flash_attention_score"
    ]
    assert len(call.args) == 4
    passed = {keyword.arg: keyword.value for keyword in call.keywords}
    assert set(passed) == {"attn_mask", "scalar_value", "input_layout", "next_tokens", "sparse_mode"}
    assert set(passed) <= set(params)
    assert ast.literal_eval(passed["input_layout"]) == "BNSD" and ast.literal_eval(passed["sparse_mode"]) == 0
    assert ast.literal_eval(passed["next_tokens"]) == 0  # no key after the query: future blocks skipped
    doc = " ".join(inspect.getdoc(ms.ops.flash_attention_score).split())
    for text in (
        "attn_mask (Tensor, optional): The attention mask tensor of bool or uint8. For each element, 0/False "
        "indicates retention and 1/True indicates discard.",
        "When `sparse_mode` is 0 and 1, `attn_mask` should be :math:`(B, N1, S1, S2)`, :math:`(B, 1, S1, S2)`",
        "N2: Num heads of `key` and `value`, and N2 must be a factor of N1.",
        # next_tokens=0 bounds the computed part of the mask at the diagonal:
        "represents how many tokens are counted backward.",
        "the full `attn_mask` matrix (S1 * S2) needs to be passed in, indicating that the part between "
        "`next_tokens` and `pre_tokens` needs to be calculated.",
        # Why the documents are not passed as TND lengths (the kernel's docstring):
        "0 should not exist in list_seq_k.",
    ):
        assert text in doc, text
    assert isinstance(kernels.blockwise_attention(0.5, 64, "Ascend"), ascend_attention.AscendFlashAttention)
    assert isinstance(kernels.blockwise_attention(0.5, 64, "CPU"), cpu_attention.BlockwiseAttention)
