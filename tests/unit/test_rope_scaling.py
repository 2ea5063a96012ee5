"""RoPE scaling: linear, static NTK, dynamic NTK, YaRN frequencies against published vectors and HF, their
invariants, and config validation. Rotated queries and keys, dynamic NTK in compiled graphs and the whole model
against HF are in ``test_rope_scaling_hf.py``.

References: float64 test vectors of the published formulas, HF transformers
4.57.1 (``ROPE_INIT_FUNCTIONS``). Static NTK is not an HF type: it is checked against
the published base-change formula only.
"""

import numpy as np
import pytest
from mindspore import Tensor
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

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
from tests.helpers.rope_scaling import BASE, FACTOR, HEAD_DIM, L_ORIG, ROTARY_DIM, RopeTables, hf_rope_config
from tests.unit.test_transformer_hf import (
    ours_config,
)

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


def hf_inv_freq(rope_scaling, max_positions, seq_len=None, **kwargs):
    config = hf_rope_config(rope_scaling, max_positions, **kwargs)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, None, seq_len)
    return inv_freq.double().numpy(), attention_factor


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
