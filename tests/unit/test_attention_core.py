"""The ``attention_core`` kernel (grouped queries, hand-written backward) against torch autograd of the formula."""

import math

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor

from mindmoe.model import kernels
from mindmoe.model.attention import MASK_VALUE


def reference(q_BNSD, k_BGPD, v_BGPD, mask_B1SP, upstream_BNSD):
    """``sum(upstream * softmax(q k^T / sqrt(D) + mask) v)`` with HF's repeat_kv, and its gradients."""
    q, k, v = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q_BNSD, k_BGPD, v_BGPD))
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores + torch.tensor(mask_B1SP, dtype=torch.float64), -1)
    out = probs @ v.repeat_interleave(group, 1)
    (out * torch.tensor(upstream_BNSD, dtype=torch.float64)).sum().backward()
    return out.detach().numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


def document_mask(batch, seq_len, num_keys, boundary):
    """Causal over the last ``seq_len`` of ``num_keys`` keys; the second sequence starts a document at ``boundary``."""
    offset = num_keys - seq_len
    allowed = np.arange(num_keys)[None, :] <= np.arange(seq_len)[:, None] + offset
    allowed = np.repeat(allowed[None], batch, 0)
    allowed[1, boundary - offset :, :boundary] = False
    return allowed, np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)[:, None]


@pytest.mark.parametrize("heads,kv_heads,seq_len,num_keys", [(4, 2, 7, 7), (6, 2, 5, 9), (3, 3, 6, 6), (4, 1, 1, 5)])
def test_attention_core_matches_torch_with_grouped_heads(heads, kv_heads, seq_len, num_keys):
    rng = np.random.default_rng(heads * 100 + num_keys)
    batch, head_dim = 2, 8
    group = heads // kv_heads
    q = rng.normal(size=(batch, heads, seq_len, head_dim)).astype(np.float32)
    k = rng.normal(size=(batch, kv_heads, num_keys, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, kv_heads, num_keys, head_dim)).astype(np.float32)
    upstream = rng.normal(size=q.shape).astype(np.float32)
    allowed, mask = document_mask(batch, seq_len, num_keys, boundary=num_keys - max(seq_len // 2, 1))
    core = kernels.attention_core(1.0 / math.sqrt(head_dim), "CPU")
    rows = group * seq_len
    mask_BGQP = np.broadcast_to(mask, (batch, heads, seq_len, num_keys)).reshape(batch, kv_heads, rows, num_keys)

    def weighted(q_BGQD, k_BGPD, v_BGPD, mask_in):
        out_BGQD, _ = core(q_BGQD, k_BGPD, v_BGPD, mask_in)
        return (out_BGQD * Tensor(upstream.reshape(batch, kv_heads, rows, head_dim))).sum(), out_BGQD

    (_, out), grads = ms.jit(ms.value_and_grad(weighted, (0, 1, 2, 3), has_aux=True))(
        Tensor(q.reshape(batch, kv_heads, rows, head_dim)),
        Tensor(k),
        Tensor(v),
        Tensor(np.ascontiguousarray(mask_BGQP)),
    )
    out_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, mask, upstream)
    np.testing.assert_allclose(out.asnumpy().reshape(q.shape), out_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[0].asnumpy().reshape(q.shape), dq_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[1].asnumpy(), dk_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[2].asnumpy(), dv_ref, rtol=1e-4, atol=1e-5)
    assert not grads[3].asnumpy().any()  # the mask is a constant of the input ids
    # Keys a query may not see get no gradient from it: a key masked for every query has none at all.
    hidden_keys = ~allowed.any(1)
    assert np.abs(grads[1].asnumpy()[np.broadcast_to(hidden_keys[:, None, :, None], dk_ref.shape)]).max(initial=0) == 0
