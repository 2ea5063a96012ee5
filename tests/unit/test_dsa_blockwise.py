"""The ``indexed_attention`` kernel (blockwise DeepSeek Sparse Attention, hand-written recomputing backward) against
torch autograd of the published formulas on whole ``[S, S]`` matrices in float64; the model on its blockwise DSA
path against its full-mask path."""

import math

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor

from mindmoe.model import attention, kernels
from mindmoe.model.kernels import cpu_dsa
from mindmoe.model.outputs import OUT_HEAD, OUT_INDEXER_LOSS


def doc_ids_of(lengths):
    return np.stack([np.repeat(np.arange(len(row)), row) for row in lengths]).astype(np.int32)


def reference(inputs, doc_ids_BS, topk, sparse, upstream_BNSE, kl_weight):
    """float64 torch: ``sum(upstream * out) + kl_weight * sum_t KL(p_t || softmax(I_t))`` over the kept keys (each
    query's ``min(topk, visible)`` best visible keys by the indexer's score when ``sparse``, else every visible
    key), its value parts and its gradients with respect to q, k, v, iq, ik, w."""
    q, k, v, iq, ik, w = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs)
    seq_len = q.shape[2]
    doc = torch.from_numpy(doc_ids_BS)
    visible = (doc[:, :, None] == doc[:, None, :]) & torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    products = torch.einsum("bjtc,bsc->bjts", iq, ik[:, 0])
    index = (torch.relu(products) * w).sum(1) / math.sqrt(iq.shape[-1])  # [B, S, S]
    kept = visible.clone()
    if sparse:
        ranked = index.detach().masked_fill(~visible, float("-inf"))
        for b in range(ranked.shape[0]):
            for t in range(seq_len):
                count = int(visible[b, t].sum())
                if count > topk:
                    kth = torch.topk(ranked[b, t], topk).values[-1]
                    kept[b, t] = visible[b, t] & (ranked[b, t] >= kth)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~kept[:, None], float("-inf")), -1)
    out = probs @ v
    p = probs.detach().sum(1)
    p = p / p.sum(-1, keepdim=True)
    log_q = torch.log_softmax(index.masked_fill(~kept, float("-inf")), -1)
    kl = torch.where(kept, p * (torch.log(p.clamp_min(1e-300)) - log_q.masked_fill(~kept, 0.0)), 0.0).sum()
    ((out * torch.tensor(upstream_BNSE, dtype=torch.float64)).sum() + kl_weight * kl).backward()
    grads = [t.grad.numpy() for t in (q, k, v, iq, ik, w)]
    return out.detach().numpy(), float(kl.detach()), grads, kept.numpy()


def random_inputs(rng, batch, seq_len, heads=3, width=6, value_width=5, index_heads=4, index_width=4):
    q = rng.normal(size=(batch, heads, seq_len, width))
    k = rng.normal(size=(batch, heads, seq_len, width))
    v = rng.normal(size=(batch, heads, seq_len, value_width))
    iq = rng.normal(size=(batch, index_heads, seq_len, index_width))
    ik = rng.normal(size=(batch, 1, seq_len, index_width))
    w = rng.normal(size=(batch, index_heads, seq_len, 1))
    return [a.astype(np.float32) for a in (q, k, v, iq, ik, w)]


# block, lengths per row, topk, sparse. Blocks of 4 over 11 or 13 positions: the last block is shorter; several
# documents per row so some queries see fewer than topk keys.
CASES = [
    (4, [[3, 5, 3], [5, 6]], 3, True),
    (4, [[13], [2, 7, 4]], 5, True),
    (5, [[11], [4, 7]], 2, True),
    (4, [[3, 5, 3], [5, 6]], 3, False),
    (16, [[9], [3, 6]], 4, True),  # one block, shorter than block_size
]


@pytest.mark.parametrize("block,lengths,topk,sparse", CASES)
def test_indexed_attention_values_and_gradients_match_torch(block, lengths, topk, sparse):
    doc_ids = doc_ids_of(lengths)
    batch, seq_len = doc_ids.shape
    rng = np.random.default_rng(seq_len * 10 + topk)
    inputs = random_inputs(rng, batch, seq_len)
    upstream = rng.normal(size=inputs[2].shape).astype(np.float32)
    kl_weight = 0.7
    width, index_width = inputs[0].shape[-1], inputs[3].shape[-1]
    kernel = kernels.indexed_attention(1 / math.sqrt(width), 1 / math.sqrt(index_width), topk, block, sparse, "CPU")

    def objective(q, k, v, doc_ids_BS, iq, ik, w):
        out, kl_sum = kernel(q, k, v, doc_ids_BS, iq, ik, w)
        return (out * Tensor(upstream)).sum() + kl_weight * kl_sum, (out, kl_sum)

    # Compiled as training runs it: a GRAPH_MODE jit of the gradient, through the hand-written bprop.
    tensors = [Tensor(a) for a in inputs]
    (_, (out, kl_sum)), grads = ms.jit(ms.value_and_grad(objective, (0, 1, 2, 4, 5, 6), has_aux=True))(
        *tensors[:3], Tensor(doc_ids), *tensors[3:]
    )
    want_out, want_kl, want_grads, kept = reference(inputs, doc_ids, topk, sparse, upstream, kl_weight)
    if sparse:
        assert (kept.sum(-1) < doc_ids_visible_counts(doc_ids)).any(), "the selection must drop keys"
    np.testing.assert_allclose(out.asnumpy(), want_out, rtol=1e-4, atol=1e-5)
    assert want_kl > 0.01
    np.testing.assert_allclose(float(kl_sum.asnumpy()), want_kl, rtol=1e-4)
    for name, grad, want in zip(("q", "k", "v", "iq", "ik", "w"), grads, want_grads):
        assert np.abs(want).max() > 0.05, f"d{name} must be far from zero for the check to mean anything"
        np.testing.assert_allclose(grad.asnumpy(), want, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def doc_ids_visible_counts(doc_ids_BS):
    seq_len = doc_ids_BS.shape[1]
    same = (doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :]) & np.tril(np.ones((seq_len, seq_len), bool))
    return same.sum(-1)


def test_the_kernel_keeps_no_block_of_queries_for_the_backward():
    """What the backward reads is the inputs, the output and the per-row log-sum-exp: every ``[Q, P]`` tensor is
    recomputed there (the bprop's signature takes nothing else, so nothing else can be kept)."""
    import inspect

    params = list(inspect.signature(cpu_dsa.BlockwiseIndexedAttention.bprop).parameters)
    assert params == ["self", "q_BNSD", "k_BNSD", "v_BNSD", "doc_ids_BS", "iq_BISC", "ik_B1SC", "w_BIS1", "out", "dout"]
    assert isinstance(kernels.indexed_attention(0.5, 0.5, 4, 8, True, "Ascend"), cpu_dsa.BlockwiseIndexedAttention)
    assert attention.BLOCK_SIZE == 512


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_model_on_the_blockwise_path_equals_its_full_mask_path(monkeypatch, stage):
    """The same weights, 20 packed positions: past a block size of 8 every layer (and the MTP depth) runs the kernel;
    logits, indexer loss and every gradient equal those of the full-mask path (itself checked against transformers
    in tests/unit/test_hf_glm_moe_dsa.py and against NumPy in tests/unit/test_dsa.py)."""
    from mindmoe.model.mla import set_dsa_stage
    from mindmoe.model.transformer import MoETransformer
    from tests.helpers.dsa_models import randomize, tiny_dsa_config

    monkeypatch.setattr(attention, "BLOCK_SIZE", 8)
    model = MoETransformer(tiny_dsa_config(4))
    randomize(model, seed=5)
    set_dsa_stage(model, stage)
    assert model.layers[1].self_attn.indexed_blockwise.block_size == 8
    doc_ids = doc_ids_of([[9, 11], [3, 13, 4]])
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, size=doc_ids.shape).astype(np.int32)
    upstream = np.random.default_rng(3).normal(size=(2, 20, model.config.vocab_size)).astype(np.float32)
    params = model.trainable_params()

    def run(block_size):
        monkeypatch.setattr(attention, "BLOCK_SIZE", block_size)

        def objective(input_ids, doc_ids_BS):
            outs = model(input_ids, doc_ids_BS)
            logits, indexer_loss = outs[OUT_HEAD], outs[OUT_INDEXER_LOSS]
            return (logits * Tensor(upstream)).sum() + 3.0 * indexer_loss, (logits, indexer_loss)

        (_, (logits, indexer_loss)), grads = ms.jit(ms.value_and_grad(objective, None, params, has_aux=True))(
            Tensor(ids), Tensor(doc_ids)
        )
        return logits.asnumpy(), float(indexer_loss.asnumpy()), [g.asnumpy() for g in grads]

    blockwise, full = run(8), run(512)
    np.testing.assert_allclose(blockwise[0], full[0], atol=1e-4, rtol=1e-4)
    assert full[1] > 0.01
    np.testing.assert_allclose(blockwise[1], full[1], rtol=1e-4)
    indexer_grads = 0
    for param, got, want in zip(params, blockwise[2], full[2]):
        # float32 sums over different block orders: an absolute tolerance scaled to the tensor's largest gradient
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max() + 1e-6, rtol=1e-3, err_msg=param.name)
        indexer_grads += ".indexer." in param.name and np.abs(want).max() > 1e-3
    assert indexer_grads >= 8
