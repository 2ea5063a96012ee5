"""Absorbed-weights MLA decoding (``model/export/mla_serving.py``) against the plain computation in NumPy:
per-head keys and values expanded from the latent cache with ``kv_b_proj``, then softmax attention."""

import numpy as np
from mindspore import Tensor

from mindmoe.model.attention import MASK_VALUE
from mindmoe.model.export.mla_serving import absorbed_attention

BATCH, HEADS, CAPACITY, RANK, NOPE, ROPE, VALUE = 2, 3, 7, 5, 4, 2, 6
SCALE = 0.37


def expanded_attention(q_BND, c_kv_BPR, k_rope_BPY, kv_b_weight, visible_BP):
    """The training formula: k = [kv_b(c)_nope, k_rope] and v = kv_b(c)_value per head, softmax(q k^T) v."""
    kv_BPNE = (c_kv_BPR @ kv_b_weight.T).reshape(BATCH, CAPACITY, HEADS, NOPE + VALUE)
    k_BPND = np.concatenate(
        [kv_BPNE[..., :NOPE], np.broadcast_to(k_rope_BPY[:, :, None], (BATCH, CAPACITY, HEADS, ROPE))], -1
    )
    scores_BNP = np.einsum("bnd,bpnd->bnp", q_BND, k_BPND) * SCALE + visible_BP[:, None]
    probs_BNP = np.exp(scores_BNP - scores_BNP.max(-1, keepdims=True))
    probs_BNP /= probs_BNP.sum(-1, keepdims=True)
    return np.einsum("bnp,bpnv->bnv", probs_BNP, kv_BPNE[..., NOPE:])


def absorbed(q_BND, c_kv_BPR, k_rope_BPY, kv_b_weight, visible_BP):
    args = (q_BND, c_kv_BPR, k_rope_BPY, kv_b_weight, visible_BP[:, None])
    return absorbed_attention(*[Tensor(arg) for arg in args], NOPE, SCALE).asnumpy()


def test_absorbed_attention_equals_expanded_keys_and_values():
    rng = np.random.default_rng(0)
    q_BND = rng.normal(size=(BATCH, HEADS, NOPE + ROPE)).astype(np.float32)
    c_kv_BPR = rng.normal(size=(BATCH, CAPACITY, RANK)).astype(np.float32)
    k_rope_BPY = rng.normal(size=(BATCH, CAPACITY, ROPE)).astype(np.float32)
    kv_b_weight = rng.normal(size=(HEADS * (NOPE + VALUE), RANK)).astype(np.float32)
    positions = np.array([3, 6])  # the second sequence sees the whole cache, the first only slots 0..3
    visible_BP = np.where(np.arange(CAPACITY)[None] <= positions[:, None], 0.0, MASK_VALUE).astype(np.float32)
    out = absorbed(q_BND, c_kv_BPR, k_rope_BPY, kv_b_weight, visible_BP)
    expected = expanded_attention(
        q_BND.astype(np.float64), c_kv_BPR, k_rope_BPY, kv_b_weight.astype(np.float64), visible_BP
    )
    assert out.shape == (BATCH, HEADS, VALUE)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)
    # Masked slots do not count: changing them leaves the first sequence's output as it was.
    c_kv_BPR[0, 4:] += 10.0
    changed = absorbed(q_BND, c_kv_BPR, k_rope_BPY, kv_b_weight, visible_BP)
    np.testing.assert_allclose(changed[0], out[0], rtol=0, atol=1e-6)
