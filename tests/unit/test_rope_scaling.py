"""RoPE scaling: linear, static NTK, dynamic NTK, YaRN; config validation; dynamic NTK in compiled graphs.

References: float64 test vectors of the published formulas, HF transformers
4.57.1 (``ROPE_INIT_FUNCTIONS``, ``Glm4MoeRotaryEmbedding`` with its ``dynamic_rope_update``,
``glm4_moe.apply_rotary_pos_emb`` for rotate_half, ``glm.apply_rotary_pos_emb`` for interleaved,
``Glm4MoeForCausalLM`` for the whole model). Static NTK is not an HF type: it is checked against
the published base-change formula only.
"""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor, nn, ops
from transformers import Glm4MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as hf_apply_interleaved
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeForCausalLM,
    Glm4MoeRotaryEmbedding,
)
from transformers.models.glm4_moe.modeling_glm4_moe import (
    apply_rotary_pos_emb as hf_apply_rotate_half,
)

from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.rope import RotaryEmbedding, apply_rope, rope_tables
from mindmoe.model.rope_scaling import (
    RopeScalingConfig,
    default_inv_freq,
    dynamic_ntk_inv_freq,
    linear_inv_freq,
    ntk_base,
    ntk_inv_freq,
    scaled_inv_freq,
    validate_rope_scaling,
    yarn_attention_factor,
    yarn_correction_range,
    yarn_extrapolation_weight,
    yarn_inv_freq,
)
from mindmoe.model.transformer import MoETransformer
from tests.unit.test_transformer_hf import (
    DROPLESS,
    VOCAB,
    hf_config,
    hf_logits,
    ours_config,
    randomize,
    to_hf_state_dict,
)

# Published-formula vectors, setup: base 10000, factor (alpha) 4, original context 2048.
BASE, FACTOR, L_ORIG = 10000.0, 4.0, 2048
V2_NTK = {  # rotary dim: (base', inv_freq)
    8: (63496.04207872797, [1, 0.062996052495, 0.0039685026299, 0.00025]),
    16: (
        48760.54616817902,
        [
            1,
            0.25941281701,
            0.067295009632,
            0.01745718802,
            0.0045286183213,
            0.0011747816359,
            0.00030475341355,
            7.9056941504e-05,
        ],
    ),
}
V3_DYNAMIC_AT_4096 = {
    8: (85498.79733383484, [1, 0.058480354764, 0.0034199518934, 0.0002]),
    16: (
        62924.947532091326,
        [
            1,
            0.25127376217,
            0.063138503556,
            0.015865049326,
            0.0039864706313,
            0.0010016954733,
            0.00025169979013,
            6.3245553203e-05,
        ],
    ),
}
V4_YARN = {  # rotary dim: ((low, high), extrapolation weight, inv_freq)
    8: ((1, 3), [1, 1, 0.5, 0], [1, 0.1, 0.00625, 0.00025]),
    16: (
        (2, 6),
        [1, 1, 1, 0.75, 0.5, 0.25, 0, 0],
        [1, 0.31622776602, 0.1, 0.025693505989, 0.00625, 0.0013834964763, 0.00025, 7.9056941504e-05],
    ),
}
V4_YARN_ATTENTION_FACTOR = 1.138629436111989
V4_YARN_COS_AT_100_D8 = [0.9818616513, -0.955391542, 0.9233864795, 1.1382736329]

# Rotation checks: head_dim 32 with partial rotary 0.5 -> 16 rotated channels, 8 frequencies.
HEAD_DIM, PARTIAL, ROTARY_DIM = 32, 0.5, 16
TABLE_POSITIONS = 1024
DYNAMIC_ORIG = 16
SPACED = np.arange(0, 300, 7)  # crosses yarn's original context of 256
# name: (ours, HF rope_scaling, HF max_position_embeddings, positions)
ROTATION_CASES = {
    "linear": (RopeScalingConfig("linear", 4.0), {"rope_type": "linear", "factor": 4.0}, TABLE_POSITIONS, SPACED),
    # HF 4.57.1 "dynamic" takes L_orig from max_position_embeddings; ours from original_max_position.
    "dynamic_below_original": (
        RopeScalingConfig("dynamic_ntk", 4.0, original_max_position=DYNAMIC_ORIG),
        {"rope_type": "dynamic", "factor": 4.0},
        DYNAMIC_ORIG,
        np.arange(12),
    ),
    "dynamic_above_original": (
        RopeScalingConfig("dynamic_ntk", 4.0, original_max_position=DYNAMIC_ORIG),
        {"rope_type": "dynamic", "factor": 4.0},
        DYNAMIC_ORIG,
        np.arange(40),
    ),
    "yarn": (
        RopeScalingConfig("yarn", 4.0, original_max_position=256),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        TABLE_POSITIONS,
        SPACED,
    ),
    # No original_max_position: both fall back to max_position_embeddings.
    "yarn_custom_betas_and_attention_factor": (
        RopeScalingConfig("yarn", 8.0, beta_fast=16.0, beta_slow=2.0, attention_factor=1.5),
        {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.5},
        TABLE_POSITIONS,
        SPACED,
    ),
}


def hf_rope_config(rope_scaling, max_positions, head_dim=HEAD_DIM, partial=PARTIAL, base=BASE):
    return Glm4MoeConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        partial_rotary_factor=partial,
        rope_theta=base,
        max_position_embeddings=max_positions,
        rope_scaling=rope_scaling,
    )


def hf_inv_freq(rope_scaling, max_positions, seq_len=None, **kwargs):
    config = hf_rope_config(rope_scaling, max_positions, **kwargs)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, None, seq_len)
    return inv_freq.double().numpy(), attention_factor


def hf_rotated(rope_scaling, max_positions, q, k, positions, interleaved):
    # A fresh rotary module per call: HF's dynamic frequencies are cached state.
    rotary = Glm4MoeRotaryEmbedding(hf_rope_config(rope_scaling, max_positions))
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(positions.astype(np.int64))[None])
    apply = hf_apply_interleaved if interleaved else hf_apply_rotate_half
    hf_q, hf_k = apply(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    return hf_q.numpy(), hf_k.numpy()


class RotatedQK(nn.Cell):
    """The model's path: positions -> RotaryEmbedding -> apply_rope on q and k (compiled, GRAPH_MODE)."""

    def __init__(self, rope, interleaved):
        super().__init__()
        self.rope = rope
        self.interleaved = interleaved

    def construct(self, q_BNSD, k_BGSD, positions_S):
        cos, sin = self.rope(positions_S)
        return apply_rope(q_BNSD, cos, sin, self.interleaved), apply_rope(k_BGSD, cos, sin, self.interleaved)


class RotatedQ(nn.Cell):
    """As the model does it: positions 0..S-1 taken from the input's (possibly dynamic) shape."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def construct(self, q_BNSD):
        cos, sin = self.rope(ops.arange(q_BNSD.shape[2], dtype=ms.int32))
        return apply_rope(q_BNSD, cos, sin, False)


class RopeTables(nn.Cell):
    """``RotaryEmbedding`` alone, compiled: positions -> (cos, sin)."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def construct(self, positions_S):
        return self.rope(positions_S)


def random_qk(seq_len, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(2, 4, seq_len, HEAD_DIM)).astype(np.float32),
        rng.normal(size=(2, 2, seq_len, HEAD_DIM)).astype(np.float32),
    )


def dynamic_rope(original=DYNAMIC_ORIG, interleaved=False):
    return RotaryEmbedding(
        ROTARY_DIM,
        BASE,
        TABLE_POSITIONS,
        RopeScalingConfig("dynamic_ntk", FACTOR, original_max_position=original),
        interleaved,
    )


def hf_dynamic_rotated_q(q):
    positions = np.arange(q.shape[2])
    return hf_rotated({"rope_type": "dynamic", "factor": FACTOR}, DYNAMIC_ORIG, q, q[:, :2], positions, False)[0]


# ---------------------------------------------------------------- published test vectors


@pytest.mark.parametrize("dim", sorted(V2_NTK))
def test_static_ntk_matches_published_base_change(dim):
    base, inv_freq = V2_NTK[dim]
    assert ntk_base(dim, BASE, FACTOR) == pytest.approx(base, rel=1e-12)
    np.testing.assert_allclose(ntk_inv_freq(dim, BASE, FACTOR), inv_freq, rtol=1e-9)
    np.testing.assert_allclose(
        scaled_inv_freq(RopeScalingConfig("ntk", FACTOR), dim, BASE, L_ORIG)[0], inv_freq, rtol=1e-9
    )


@pytest.mark.parametrize("dim", sorted(V3_DYNAMIC_AT_4096))
def test_dynamic_ntk_matches_published_vectors_above_and_is_default_rope_up_to_original_length(dim):
    _, inv_freq = V3_DYNAMIC_AT_4096[dim]
    np.testing.assert_allclose(dynamic_ntk_inv_freq(dim, BASE, FACTOR, 4096, L_ORIG), inv_freq, rtol=1e-9)
    for seq_len in (1, 1000, L_ORIG):
        np.testing.assert_array_equal(
            dynamic_ntk_inv_freq(dim, BASE, FACTOR, seq_len, L_ORIG), default_inv_freq(dim, BASE)
        )


@pytest.mark.parametrize("dim", sorted(V4_YARN))
def test_yarn_matches_published_vectors(dim):
    correction_range, weight, inv_freq = V4_YARN[dim]
    assert yarn_correction_range(dim, BASE, L_ORIG, 32.0, 1.0) == correction_range
    np.testing.assert_allclose(yarn_extrapolation_weight(dim, BASE, L_ORIG, 32.0, 1.0), weight, rtol=1e-12)
    np.testing.assert_allclose(yarn_inv_freq(dim, BASE, FACTOR, L_ORIG, 32.0, 1.0), inv_freq, rtol=1e-9)
    assert yarn_attention_factor(FACTOR) == pytest.approx(V4_YARN_ATTENTION_FACTOR, rel=1e-15)


def test_yarn_cos_table_carries_the_attention_factor_at_position_100():
    rope = RotaryEmbedding(8, BASE, L_ORIG, RopeScalingConfig("yarn", FACTOR), interleaved=False)
    cos, sin = RopeTables(rope)(Tensor(np.array([100], np.int32)))
    np.testing.assert_allclose(cos.asnumpy()[0, :4], V4_YARN_COS_AT_100_D8, rtol=1e-6)
    np.testing.assert_allclose(cos.asnumpy()[0, 4:], V4_YARN_COS_AT_100_D8, rtol=1e-6)  # cat(cos, cos)


# ---------------------------------------------------------------- inverse frequencies vs HF ROPE_INIT_FUNCTIONS


@pytest.mark.parametrize("head_dim,partial", [(32, 0.5), (16, 1.0), (128, 0.5)])
def test_linear_inv_freq_matches_hf(head_dim, partial):
    hf, attention_factor = hf_inv_freq(
        {"rope_type": "linear", "factor": 4.0}, L_ORIG, head_dim=head_dim, partial=partial
    )
    ours, ours_factor = scaled_inv_freq(RopeScalingConfig("linear", 4.0), int(head_dim * partial), BASE, L_ORIG)
    np.testing.assert_allclose(ours, hf, rtol=2e-6)
    assert ours_factor == attention_factor == 1.0


@pytest.mark.parametrize("seq_len", [1, 100, L_ORIG, L_ORIG + 1, 4096, 10000])
@pytest.mark.parametrize("head_dim,partial", [(32, 0.5), (16, 1.0)])
def test_dynamic_ntk_inv_freq_matches_hf_dynamic_below_and_above_original_length(seq_len, head_dim, partial):
    hf, attention_factor = hf_inv_freq(
        {"rope_type": "dynamic", "factor": 4.0}, L_ORIG, seq_len, head_dim=head_dim, partial=partial
    )
    ours, ours_factor = scaled_inv_freq(
        RopeScalingConfig("dynamic_ntk", 4.0), int(head_dim * partial), BASE, L_ORIG, seq_len
    )
    np.testing.assert_allclose(ours, hf, rtol=2e-6)
    assert ours_factor == attention_factor == 1.0


YARN_HF_CASES = [
    # (ours, HF rope_scaling, max_position_embeddings, base)
    (RopeScalingConfig("yarn", 4.0), {"rope_type": "yarn", "factor": 4.0}, L_ORIG, BASE),
    (
        RopeScalingConfig("yarn", 4.0, original_max_position=L_ORIG),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L_ORIG},
        4 * L_ORIG,
        BASE,
    ),
    (
        RopeScalingConfig("yarn", 16.0, beta_fast=8.0, beta_slow=2.0, attention_factor=1.3),
        {"rope_type": "yarn", "factor": 16.0, "beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.3},
        4096,
        BASE,
    ),
    # GLM-4.5 geometry: theta 1e6, 131072 context extended from 32768.
    (
        RopeScalingConfig("yarn", 4.0, original_max_position=32768),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        131072,
        1e6,
    ),
    (RopeScalingConfig("yarn", 1.0), {"rope_type": "yarn", "factor": 1.0}, L_ORIG, BASE),
]


@pytest.mark.parametrize("ours_cfg,hf_scaling,max_positions,base", YARN_HF_CASES)
@pytest.mark.parametrize("head_dim,partial", [(32, 0.5), (128, 0.5), (16, 1.0)])
def test_yarn_inv_freq_and_attention_factor_match_hf(ours_cfg, hf_scaling, max_positions, base, head_dim, partial):
    hf, attention_factor = hf_inv_freq(hf_scaling, max_positions, head_dim=head_dim, partial=partial, base=base)
    ours, ours_factor = scaled_inv_freq(ours_cfg, int(head_dim * partial), base, max_positions)
    np.testing.assert_allclose(ours, hf, rtol=2e-6)
    assert ours_factor == pytest.approx(attention_factor, rel=1e-12)


# ---------------------------------------------------------------- rotated q/k vs HF rotary helpers


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("case", sorted(ROTATION_CASES))
def test_rotated_query_and_key_match_hf_rotary_helpers(case, interleaved):
    ours_cfg, hf_scaling, hf_max_positions, positions = ROTATION_CASES[case]
    q, k = random_qk(len(positions))
    hf_q, hf_k = hf_rotated(hf_scaling, hf_max_positions, q, k, positions, interleaved)
    rope = RotaryEmbedding(ROTARY_DIM, BASE, TABLE_POSITIONS, ours_cfg, interleaved)
    ours_q, ours_k = RotatedQK(rope, interleaved)(Tensor(q), Tensor(k), Tensor(positions.astype(np.int32)))
    np.testing.assert_allclose(ours_q.asnumpy(), hf_q, atol=2e-5, rtol=0)
    np.testing.assert_allclose(ours_k.asnumpy(), hf_k, atol=2e-5, rtol=0)
    # Channels past the rotary dim pass through.
    np.testing.assert_array_equal(ours_q.asnumpy()[..., ROTARY_DIM:], q[..., ROTARY_DIM:])


# ---------------------------------------------------------------- dynamic NTK inside compiled graphs


def test_dynamic_ntk_in_ms_jit_follows_the_runtime_length_below_and_above_the_original():
    rope = dynamic_rope()

    @ms.jit
    def rotate_query(q_BNSD):
        cos, sin = rope(ops.arange(q_BNSD.shape[2], dtype=ms.int32))
        return apply_rope(q_BNSD, cos, sin, False)

    for seq_len in (12, 40):  # below and above DYNAMIC_ORIG; the same jitted function
        q, _ = random_qk(seq_len)
        np.testing.assert_allclose(rotate_query(Tensor(q)).asnumpy(), hf_dynamic_rotated_q(q), atol=2e-5, rtol=0)


def test_dynamic_ntk_one_graph_with_dynamic_shapes_serves_every_length():
    net = RotatedQ(dynamic_rope())
    net.set_inputs(Tensor(shape=[None, None, None, HEAD_DIM], dtype=ms.float32))
    for seq_len in (40, 12, 25):
        q, _ = random_qk(seq_len)
        np.testing.assert_allclose(net(Tensor(q)).asnumpy(), hf_dynamic_rotated_q(q), atol=2e-5, rtol=0)
    assert len(net.compile_cache) == 1, "one compiled graph must serve all three lengths"


def test_dynamic_ntk_with_enable_dynamic_jit_follows_the_runtime_length():
    rope = dynamic_rope()

    @ms.enable_dynamic(q_BNSD=Tensor(shape=[None, None, None, HEAD_DIM], dtype=ms.float32))
    @ms.jit
    def rotate_query(q_BNSD):
        cos, sin = rope(ops.arange(q_BNSD.shape[2], dtype=ms.int32))
        return apply_rope(q_BNSD, cos, sin, False)

    for seq_len in (12, 40):
        q, _ = random_qk(seq_len)
        np.testing.assert_allclose(rotate_query(Tensor(q)).asnumpy(), hf_dynamic_rotated_q(q), atol=2e-5, rtol=0)


def test_dynamic_ntk_exported_mindir_with_dynamic_shapes_follows_the_runtime_length(tmp_path):
    ms.export(
        RotatedQ(dynamic_rope()),
        Tensor(shape=[None, None, None, HEAD_DIM], dtype=ms.float32),
        file_name=str(tmp_path / "rope"),
        file_format="MINDIR",
    )
    graph = nn.GraphCell(ms.load(str(tmp_path / "rope.mindir")))
    for seq_len in (12, 40):
        q, _ = random_qk(seq_len)
        np.testing.assert_allclose(graph(Tensor(q)).asnumpy(), hf_dynamic_rotated_q(q), atol=2e-5, rtol=0)


def test_dynamic_ntk_equals_plain_rope_up_to_the_original_length():
    cos, sin = RopeTables(dynamic_rope(original=64))(Tensor(np.arange(64, dtype=np.int32)))
    plain_cos, plain_sin = rope_tables(default_inv_freq(ROTARY_DIM, BASE), 64, interleaved=False)
    np.testing.assert_allclose(cos.asnumpy(), plain_cos.asnumpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(sin.asnumpy(), plain_sin.asnumpy(), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- invariants

INVARIANT_TYPES = {
    "none": RopeScalingConfig(),
    "linear": RopeScalingConfig("linear", 4.0),
    "ntk": RopeScalingConfig("ntk", 4.0),
    "dynamic_ntk": RopeScalingConfig("dynamic_ntk", 4.0, original_max_position=16),
    "yarn": RopeScalingConfig("yarn", 4.0, original_max_position=32),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("name", sorted(INVARIANT_TYPES))
def test_rotation_preserves_norm_and_query_key_product_depends_only_on_position_difference(name, interleaved):
    inv_freq, attention_factor = scaled_inv_freq(INVARIANT_TYPES[name], ROTARY_DIM, BASE, 64, seq_len=64)
    cos, sin = rope_tables(inv_freq, 64, interleaved, attention_factor)  # dynamic: L = 64 > 16
    rng = np.random.default_rng(3)
    q = np.repeat(rng.normal(size=(1, HEAD_DIM)), 64, 0).astype(np.float32)  # one vector at every position
    k = np.repeat(rng.normal(size=(1, HEAD_DIM)), 64, 0).astype(np.float32)
    rotated_q = apply_rope(Tensor(q), cos, sin, interleaved).asnumpy()
    rotated_k = apply_rope(Tensor(k), cos, sin, interleaved).asnumpy()
    # Rotation keeps the norm; yarn additionally scales cos and sin by its attention factor.
    scale = yarn_attention_factor(4.0) if name == "yarn" else 1.0
    np.testing.assert_allclose(
        np.linalg.norm(rotated_q[:, :ROTARY_DIM], axis=-1),
        scale * np.linalg.norm(q[:, :ROTARY_DIM], axis=-1),
        rtol=1e-5,
    )
    for offset in (5, -3):
        pairs = [(p, p - offset) for p in (10, 30, 50)]
        dots = [float(rotated_q[p] @ rotated_k[s]) for p, s in pairs]
        np.testing.assert_allclose(dots, [dots[0]] * len(dots), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dim", [8, 16, 64, 128])
def test_ntk_keeps_the_highest_frequency_and_lowers_the_lowest_exactly_as_linear_does(dim):
    ntk = ntk_inv_freq(dim, BASE, FACTOR)
    np.testing.assert_allclose(ntk[-1], linear_inv_freq(dim, BASE, FACTOR)[-1], rtol=1e-12)
    assert ntk[0] == 1.0
    # Dynamic NTK is the same base change with alpha = factor*L/L_orig - (factor-1).
    np.testing.assert_allclose(
        dynamic_ntk_inv_freq(dim, BASE, FACTOR, 2 * L_ORIG, L_ORIG)[-1],
        default_inv_freq(dim, BASE)[-1] / (FACTOR * 2 - (FACTOR - 1)),
        rtol=1e-12,
    )


def test_yarn_keeps_fast_frequencies_and_interpolates_slow_ones():
    low, high = yarn_correction_range(64, 1e6, 4096, 32.0, 1.0)
    assert 0 < low < high < 31
    yarn = yarn_inv_freq(64, 1e6, 8.0, 4096, 32.0, 1.0)
    default = default_inv_freq(64, 1e6)
    np.testing.assert_array_equal(yarn[: low + 1], default[: low + 1])
    np.testing.assert_allclose(yarn[high:], default[high:] / 8.0, rtol=1e-12)
    assert np.all(
        (yarn[low + 1 : high] < default[low + 1 : high]) & (yarn[low + 1 : high] > default[low + 1 : high] / 8)
    )


# ---------------------------------------------------------------- config validation

BETA_ORDER = "must be greater than model.rope_scaling.beta_slow"


@pytest.mark.parametrize(
    "scaling,key,fragment",
    [
        (RopeScalingConfig("linear", 0.5), "factor", "must be >= 1"),
        (RopeScalingConfig("yarn", 4.0, beta_fast=1.0, beta_slow=1.0), "beta_fast", BETA_ORDER),
        (RopeScalingConfig("yarn", 4.0, beta_fast=2.0, beta_slow=8.0), "beta_fast", BETA_ORDER),
        (RopeScalingConfig("yarn", 4.0, beta_slow=0.0), "beta_slow", "must be > 0"),
        (RopeScalingConfig("rope3d", 2.0), "type", "must be one of ('none', 'linear', 'ntk', 'dynamic_ntk', 'yarn')"),
        (RopeScalingConfig("dynamic", 2.0), "type", "HF 'dynamic' is 'dynamic_ntk' here"),
        (
            RopeScalingConfig("yarn", 4.0, original_max_position=8192),
            "original_max_position",
            "exceeds model.max_position_embeddings=4096",
        ),
        (
            RopeScalingConfig("linear", 4.0, original_max_position=2048),
            "original_max_position",
            "only used by dynamic_ntk and yarn",
        ),
        (RopeScalingConfig("none", 2.0), "factor", "has no effect with model.rope_scaling.type='none'"),
        (RopeScalingConfig("linear", 2.0, beta_fast=16.0), "beta_fast", "only used by type 'yarn'"),
        (RopeScalingConfig("ntk", 2.0, attention_factor=1.2), "attention_factor", "only used by type 'yarn'"),
        (RopeScalingConfig("yarn", 2.0, attention_factor=-1.0), "attention_factor", "must be > 0"),
    ],
)
def test_invalid_rope_scaling_is_rejected_naming_the_key(scaling, key, fragment):
    with pytest.raises(ValueError) as error:
        validate_model_config(ModelConfig(max_position_embeddings=4096, rope_scaling=scaling))
    message = str(error.value)
    assert message.startswith(f"model.rope_scaling.{key}={getattr(scaling, key)!r}: "), message
    assert fragment in message


def test_ntk_types_reject_a_rotary_dim_of_two():
    cfg = ModelConfig(hidden_size=16, num_heads=4, rope_scaling=RopeScalingConfig("ntk", 2.0))  # 4 * 0.5 = 2
    with pytest.raises(ValueError, match=r"^model\.rope_scaling\.type='ntk': needs a rotary dim > 2"):
        validate_model_config(cfg)


def test_dynamic_ntk_may_declare_an_original_context_longer_than_the_tables():
    # dynamic_ntk has no tables; only yarn's tables bound the original context.
    validate_rope_scaling(RopeScalingConfig("dynamic_ntk", 2.0, original_max_position=8192), 4096)


def test_rope_scaling_read_back_as_a_dict_is_accepted_and_unknown_keys_are_named():
    # A checkpoint stores dataclasses.asdict(model_config); ModelConfig(**that) holds a plain dict.
    validate_model_config(ModelConfig(rope_scaling={"type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match=r"^model\.rope_scaling\.mscale: unknown key"):
        validate_model_config(ModelConfig(rope_scaling={"type": "yarn", "mscale": 1.0}))


def test_transformer_refuses_an_invalid_rope_scaling():
    with pytest.raises(ValueError, match=r"^model\.rope_scaling\.factor=0\.5"):
        MoETransformer(ours_config(rope_scaling=RopeScalingConfig("yarn", 0.5)))


# ---------------------------------------------------------------- whole model vs HF Glm4MoeForCausalLM

MODEL_LAYERS, MODEL_HEAD_DIM, MODEL_TABLES = 2, 16, 64  # one dense and one MoE layer
MODEL_CASES = {
    # name: (ours, HF rope_scaling, HF max_position_embeddings, sequence lengths)
    "linear": (RopeScalingConfig("linear", 4.0), {"rope_type": "linear", "factor": 4.0}, MODEL_TABLES, (24,)),
    "dynamic": (
        RopeScalingConfig("dynamic_ntk", 4.0, original_max_position=8),
        {"rope_type": "dynamic", "factor": 4.0},
        8,
        (24, 6),
    ),
    "yarn": (
        RopeScalingConfig("yarn", 4.0, original_max_position=16),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        MODEL_TABLES,
        (24,),
    ),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_logits_match_hf_glm4_moe_with_the_same_rope_scaling(case):
    scaling, hf_scaling, hf_max_positions, seq_lens = MODEL_CASES[case]
    cfg = ours_config(
        num_layers=MODEL_LAYERS, head_dim=MODEL_HEAD_DIM, max_position_embeddings=MODEL_TABLES, rope_scaling=scaling
    )
    ours = MoETransformer(cfg, seed=0, moe=DROPLESS)  # HF's MoE layers drop no token
    randomize(ours, seed=4)
    if case == "dynamic":
        # One graph for every length, as in an exported MindIR: the frequencies follow the input.
        ours.set_inputs(Tensor(shape=[None, None], dtype=ms.int32), Tensor(shape=[None, None], dtype=ms.int32))
    config = hf_config(cfg)
    config.head_dim = MODEL_HEAD_DIM
    config.max_position_embeddings = hf_max_positions
    config.rope_scaling = hf_scaling
    hf = Glm4MoeForCausalLM(config).eval()
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    plain_config = hf_config(
        ours_config(num_layers=MODEL_LAYERS, head_dim=MODEL_HEAD_DIM, max_position_embeddings=MODEL_TABLES)
    )
    plain_config.head_dim = MODEL_HEAD_DIM
    plain_hf = Glm4MoeForCausalLM(plain_config).eval()
    plain_hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    # dynamic: 24 tokens stretch the frequencies past the original 8, then 6 tokens use plain RoPE again.
    for seq_len in seq_lens:
        ids = np.random.default_rng(seq_len).integers(0, VOCAB, size=(2, seq_len)).astype(np.int32)
        logits = ours(Tensor(ids), Tensor(np.zeros_like(ids)))[0].asnumpy()
        expected = hf_logits(hf, ids)
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
        scaled = seq_len > 8 or case != "dynamic"
        assert scaled != np.allclose(expected, hf_logits(plain_hf, ids), atol=1e-3), (
            "the scaling must change the logits exactly where it applies"
        )
    if case == "dynamic":
        assert len(ours.compile_cache) == 1
