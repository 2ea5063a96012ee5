"""RoPE: inverse frequencies, both channel layouts and partial rotation.

References: the float64 test vectors of the published formulas (computed from the published
formula) and HF transformers 4.57.1 (``ROPE_INIT_FUNCTIONS["default"]``,
``Glm4MoeRotaryEmbedding``, ``glm4_moe.apply_rotary_pos_emb``).
"""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers import Glm4MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

from mindmoe.model.rope import apply_rope, default_inv_freq, rope_tables

# Published-formula vector V1 (base 10000).
V1_INV_FREQ = {
    8: [1, 0.1, 0.01, 0.001],
    16: [1, 0.31622776602, 0.1, 0.031622776602, 0.01, 0.0031622776602, 0.001, 0.00031622776602],
}
# Published-formula vector: rotation of x = [1..8] at position 3, default theta, base 10000.
X_1_TO_8 = np.arange(1, 9, dtype=np.float32)
ROTATED_AT_3 = {
    # (rotary_dim, interleaved): expected
    (8, False): [
        -1.6955925369,
        0.1375517383,
        2.7886815998,
        3.975982036,
        -4.8088424749,
        6.3230593481,
        7.0868367369,
        8.011963982,
    ],
    (8, True): [
        -1.2722325127,
        -1.8388649851,
        1.6839286407,
        4.7079065765,
        4.8177771675,
        6.1472777035,
        6.975968536,
        8.0209639685,
    ],
    (4, False): [-1.4133525208, 1.8791180667, -2.8288574817, 4.0581911354, 5, 6, 7, 8],
    (4, True): [-1.2722325127, -1.8388649851, 2.8786681004, 4.0881866356, 5, 6, 7, 8],
}


def hf_config(head_dim=8, partial_rotary_factor=0.5, rope_theta=10000.0, max_positions=64):
    return Glm4MoeConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        partial_rotary_factor=partial_rotary_factor,
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
    )


def rotate(x_np, rotary_dim, positions, interleaved, base=10000.0):
    """Our apply_rope on ``x [..., S, D]`` at the given positions (eager)."""
    cos, sin = rope_tables(default_inv_freq(rotary_dim, base), max(positions) + 1, interleaved)
    index = Tensor(np.asarray(positions, np.int32))
    cos, sin = ms.ops.gather(cos, index, 0), ms.ops.gather(sin, index, 0)
    return apply_rope(Tensor(x_np), cos, sin, interleaved).asnumpy()


@pytest.mark.parametrize("dim", sorted(V1_INV_FREQ))
def test_default_inv_freq_matches_published_test_vectors(dim):
    np.testing.assert_allclose(default_inv_freq(dim, 10000.0), V1_INV_FREQ[dim], rtol=1e-9)


@pytest.mark.parametrize("head_dim,partial,theta", [(8, 1.0, 10000.0), (16, 0.5, 10000.0), (128, 0.5, 1e6)])
def test_default_inv_freq_matches_hf_rope_init_default(head_dim, partial, theta):
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["default"](hf_config(head_dim, partial, theta), None)
    ours = default_inv_freq(int(head_dim * partial), theta)
    assert attention_factor == 1.0
    np.testing.assert_allclose(ours, hf_inv_freq.double().numpy(), rtol=1e-6)


def test_glm45_inv_freq_matches_published_values():
    # Published-formula vector: head_dim 128, partial 0.5, theta 1e6 -> 32 frequencies.
    inv_freq = default_inv_freq(64, 1e6)
    assert inv_freq.shape == (32,)
    np.testing.assert_allclose(inv_freq[:3], [1, 0.6493816315762113, 0.4216965034285823], rtol=1e-12)
    np.testing.assert_allclose(inv_freq[-1], 1.539926526059492e-06, rtol=1e-12)


def test_rotate_half_tables_match_hf_glm4_moe_rotary_embedding():
    cfg = hf_config(head_dim=16, partial_rotary_factor=0.5, max_positions=32)
    positions = torch.arange(32)[None]
    hf_cos, hf_sin = Glm4MoeRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables(default_inv_freq(8, 10000.0), 32, interleaved=False)
    np.testing.assert_allclose(cos.asnumpy(), hf_cos[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(sin.asnumpy(), hf_sin[0].numpy(), atol=1e-6)


@pytest.mark.parametrize("rotary_dim,interleaved", sorted(ROTATED_AT_3))
def test_apply_rope_matches_published_rotation_vectors(rotary_dim, interleaved):
    out = rotate(X_1_TO_8[None], rotary_dim, [3], interleaved)
    np.testing.assert_allclose(out[0], ROTATED_AT_3[(rotary_dim, interleaved)], rtol=1e-6, atol=1e-6)


def test_apply_rope_under_jit_matches_published_rotation_vectors():
    cos, sin = rope_tables(default_inv_freq(4, 10000.0), 4, interleaved=False)

    @ms.jit
    def rope_partial_rotate_half(x, cos, sin):
        return apply_rope(x, cos, sin, False)

    out = rope_partial_rotate_half(Tensor(X_1_TO_8[None]), cos[3:4], sin[3:4]).asnumpy()
    np.testing.assert_allclose(out[0], ROTATED_AT_3[(4, False)], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("partial", [0.5, 1.0])
def test_apply_rope_matches_hf_glm4_moe_apply_rotary_pos_emb(partial):
    batch, heads, seq, head_dim = 2, 3, 11, 16
    rng = np.random.default_rng(0)
    q = rng.normal(size=(batch, heads, seq, head_dim)).astype(np.float32)
    k = rng.normal(size=(batch, heads, seq, head_dim)).astype(np.float32)
    cfg = hf_config(head_dim=head_dim, partial_rotary_factor=partial, max_positions=seq)
    positions = torch.arange(seq)[None].expand(batch, -1)
    hf_cos, hf_sin = Glm4MoeRotaryEmbedding(cfg)(torch.from_numpy(q), positions)
    hf_q, hf_k = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), hf_cos, hf_sin)

    rotary_dim = int(head_dim * partial)
    np.testing.assert_allclose(rotate(q, rotary_dim, list(range(seq)), False), hf_q.numpy(), atol=1e-5)
    np.testing.assert_allclose(rotate(k, rotary_dim, list(range(seq)), False), hf_k.numpy(), atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_rotation_preserves_norm(interleaved, rotary_dim):
    x = np.random.default_rng(1).normal(size=(3, 40, 16)).astype(np.float32)
    out = rotate(x, rotary_dim, list(range(40)), interleaved)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # Channels beyond the rotary dim pass through untouched.
    np.testing.assert_array_equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_query_key_dot_product_depends_only_on_position_difference(interleaved):
    rng = np.random.default_rng(2)
    q = rng.normal(size=(1, 16)).astype(np.float32)
    k = rng.normal(size=(1, 16)).astype(np.float32)
    # (query position, key position) pairs sharing the offset 5, then sharing the offset -3.
    for pairs in ([(5, 0), (12, 7), (40, 35)], [(0, 3), (20, 23), (57, 60)]):
        dots = [float(rotate(q, 8, [p], interleaved)[0] @ rotate(k, 8, [s], interleaved)[0]) for p, s in pairs]
        np.testing.assert_allclose(dots, [dots[0]] * len(dots), rtol=1e-5, atol=1e-5)
