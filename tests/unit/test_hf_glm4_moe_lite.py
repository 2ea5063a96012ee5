"""HF ``glm4_moe_lite`` (GLM-4.7-Flash) interop against transformers 5.23, which first has the architecture.

The reference runs in its own venv (``tf5_reference`` fixture): tiny random ``Glm4MoeLiteForCausalLM`` models
saved with ``save_pretrained`` load in mindmoe with transformers' logits (fp32, eager attention, <= 1e-4); the
import exported again (``model_type=glm4_moe_lite``) reloads there with identical weights and logits; a
``deepseek_v3`` saved by transformers 5 (``rope_parameters``) imports too; what mindmoe cannot reproduce is
refused naming the key.

Variants: query compression with interleaved RoPE, YaRN (``mscale``/``mscale_all_dim``) and group-limited
routing; a plain ``q_proj`` with rotate-half RoPE, two leading dense layers and a transformers-4 style
``rope_theta``.
"""

import json

import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.hf import HFCheckpointError, export_hf, load_hf_pretrained, read_hf_config
from mindmoe.model.mla import mla_softmax_scale
from mindmoe.model.outputs import OUT_HEAD
from tests.helpers.hf_models import GLM4_MOE_LITE_VARIANTS, TRANSFORMERS5_YARN, glm4_moe_lite_config, token_ids

ATOL = 1e-4
SEQ = 20
VARIANTS = GLM4_MOE_LITE_VARIANTS


@pytest.fixture(scope="module")
def variant(tf5_reference, tmp_path_factory):
    """``name -> (reference result, directory, cfg, ours)``, built once per module."""
    built = {}

    def get(name):
        if name not in built:
            directory = tmp_path_factory.mktemp(name) / "hf"
            reference = tf5_reference.build(VARIANTS[name], len(name), directory, token_ids(SEQ, seed=3))
            cfg, ours, _ = load_hf_pretrained(directory)
            built[name] = reference, directory, cfg, ours
        return built[name]

    return get


def our_logits(model, ids):
    return model(Tensor(ids), Tensor(np.zeros_like(ids)))[OUT_HEAD].asnumpy()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_glm4_moe_lite_checkpoint_gives_transformers5_logits(variant, name):
    reference, _, cfg, ours = variant(name)
    assert reference["transformers"] == "5.23.0" and reference["model_class"] == "Glm4MoeLiteForCausalLM"
    expected = reference["logits"]
    assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
    np.testing.assert_allclose(our_logits(ours, token_ids(SEQ, seed=3)), expected, atol=ATOL, rtol=0)
    assert cfg.attention_type == "mla" and cfg.num_kv_heads == cfg.num_heads


def test_glm4_moe_lite_config_maps_every_setting(variant):
    reference, directory, cfg, _ = variant("q_lora_interleaved_yarn_groups")
    saved = json.loads((directory / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved and "mlp_layer_types" in saved
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        16,
        16,
        8,
        4,
        6,
    )
    assert (cfg.rope_interleaved, cfg.first_k_dense, cfg.n_group, cfg.topk_group) == (True, 1, 4, 2)
    assert (cfg.score_func, cfg.expert_bias, cfg.routed_scaling_factor, cfg.num_shared_experts) == (
        "sigmoid",
        True,
        1.8,
        1,
    )
    scaling = cfg.rope_scaling
    assert (scaling.type, scaling.factor, scaling.original_max_position, scaling.mscale_all_dim) == (
        "yarn",
        4.0,
        16,
        0.8,
    )
    # transformers' softmax scale: qk_head_dim ** -0.5 times mscale(factor, mscale_all_dim) ** 2
    mscale = 0.1 * 0.8 * np.log(4.0) + 1.0
    assert mla_softmax_scale(cfg) == pytest.approx(12**-0.5 * mscale**2, rel=1e-12)
    plain = variant("plain_q_rotate_half_two_dense")[2]
    assert (plain.q_lora_rank, plain.rope_interleaved, plain.first_k_dense, plain.rope_theta) == (
        None,
        False,
        2,
        5000.0,
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_glm4_moe_lite_export_reloads_in_transformers5_with_the_same_weights_and_logits(
    variant, tf5_reference, name, tmp_path
):
    reference, _, _, ours = variant(name)
    out = tmp_path / "export"
    assert export_hf(ours, out_dir=out, model_type="glm4_moe_lite") == []
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == "glm4_moe_lite" and exported["architectures"] == ["Glm4MoeLiteForCausalLM"]
    assert (
        "rope_theta" not in exported
        and exported["rope_parameters"]["rope_theta"] == (reference["config"]["rope_parameters"]["rope_theta"])
    )
    ids = token_ids(SEQ, seed=3)
    reloaded = tf5_reference.reload(out, ids)
    assert reloaded["model_class"] == "Glm4MoeLiteForCausalLM"
    assert reloaded["config"]["mlp_layer_types"] == reference["config"]["mlp_layer_types"]
    # YaRN's mscale comes back as the attention_factor it implies; the logits below check the equivalence.
    for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "mscale_all_dim"):
        assert reloaded["config"]["rope_parameters"].get(key) == reference["config"]["rope_parameters"].get(key), key
    assert set(reloaded["state"]) == set(reference["state"])
    for key, value in reloaded["state"].items():
        np.testing.assert_array_equal(value, reference["state"][key], err_msg=key)
    np.testing.assert_array_equal(reloaded["logits"], reference["logits"])
    np.testing.assert_allclose(reloaded["logits"], our_logits(ours, ids), atol=ATOL, rtol=0)


def test_latent_norm_eps_follows_transformers(tf5_reference, tmp_path):
    """q_a_layernorm / kv_a_layernorm use eps 1e-6 (transformers' norm default), not rms_norm_eps: at 1e-5 and a
    tiny width the two differ by about 1.2e-4 in the logits."""
    ids = token_ids(SEQ, seed=3)
    reference = tf5_reference.build(glm4_moe_lite_config(rms_norm_eps=1e-5), 3, tmp_path / "hf", ids)
    _, ours, _ = load_hf_pretrained(tmp_path / "hf")
    np.testing.assert_allclose(our_logits(ours, ids), reference["logits"], atol=ATOL, rtol=0)


def test_deepseek_v3_saved_by_transformers5_gives_its_logits(tf5_reference, tmp_path):
    """transformers 5 writes ``rope_parameters`` (YaRN inside) and ``head_dim``; the import reads both."""
    config = glm4_moe_lite_config(
        model_type="deepseek_v3",
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        rope_parameters=dict(TRANSFORMERS5_YARN),
    )
    ids = token_ids(SEQ, seed=5)
    reference = tf5_reference.build(config, 7, tmp_path / "hf", ids)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "yarn" and "rope_scaling" not in saved
    cfg, ours, _ = load_hf_pretrained(tmp_path / "hf")
    assert (cfg.rope_scaling.type, cfg.rope_scaling.mscale_all_dim, cfg.first_k_dense) == ("yarn", 0.8, 1)
    np.testing.assert_allclose(our_logits(ours, ids), reference["logits"], atol=ATOL, rtol=0)


def test_glm4_moe_lite_defaults_are_transformers5s(tf5_reference, tmp_path):
    """A config.json with only ``model_type`` imports as the full config transformers 5.23 writes for it."""
    written = tf5_reference.config({"model_type": "glm4_moe_lite"}, tmp_path)
    assert read_hf_config(written).model_config == read_hf_config({"model_type": "glm4_moe_lite"}).model_config
    cfg = read_hf_config(written).model_config
    assert (cfg.num_layers, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        47,
        768,
        512,
        192,
        256,
    )
    assert (cfg.num_experts, cfg.top_k, cfg.first_k_dense, cfg.rope_interleaved) == (64, 4, 1, True)


YARN_40 = dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096)


@pytest.mark.parametrize(
    "legacy, transformers5",
    [
        (
            dict(model_type="deepseek_v3", rope_theta=5e4, rope_scaling=dict(type="yarn", **YARN_40)),
            dict(model_type="deepseek_v3", rope_parameters=dict(rope_type="yarn", rope_theta=5e4, **YARN_40)),
        ),
        (
            dict(model_type="glm4_moe", head_dim=128, rope_theta=1e6, partial_rotary_factor=0.5),
            dict(model_type="glm4_moe", head_dim=128, rope_parameters=dict(rope_theta=1e6, partial_rotary_factor=0.5)),
        ),
    ],
)
def test_transformers5_rope_parameters_import_as_transformers4_keys(legacy, transformers5):
    assert read_hf_config(transformers5).model_config == read_hf_config(legacy).model_config


def lite_dict(**changes):
    values = glm4_moe_lite_config()
    values.update(changes)
    return values


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads=2: must equal num_attention_heads=4"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(head_dim=8), "head_dim=8: must equal qk_rope_head_dim=4 (HF reads it as qk_rope_head_dim)"),
        (dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5)), "partial_rotary_factor=0.5"),
        (dict(mlp_layer_types=["dense", "sparse", "dense"]), "mlp_layer_types=.*dense layer after a MoE layer"),
        (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types=.*has 2 entries for num_hidden_layers=3"),
        (dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types=.*must be a list of 'dense'"),
        (dict(rope_parameters={"full_attention": dict(rope_theta=1e4)}), "rope_parameters=.*must be a flat object"),
        (dict(rope_parameters=dict(rope_type="longrope", factor=2.0)), "rope_type 'longrope' is not supported"),
        (dict(n_shared_experts=0), "n_shared_experts=0"),
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ],
)
def test_unsupported_glm4_moe_lite_settings_are_refused_naming_the_key(changes, match):
    with pytest.raises(HFCheckpointError, match=match.replace("(", r"\(").replace(")", r"\)")):
        read_hf_config(lite_dict(**changes))


def test_first_k_dense_replace_is_not_read_by_glm4_moe_lite():
    imported = read_hf_config(lite_dict(first_k_dense_replace=2))
    assert imported.model_config.first_k_dense == 1
    assert any("first_k_dense_replace=2 is not used" in note for note in imported.notes)


def test_glm47_flash_model_group_is_the_published_model_and_counts_its_parameters():
    """``model=glm47_flash`` equals the import of a ``glm4_moe_lite`` config.json holding only its model type
    (transformers 5.23's defaults are GLM-4.7-Flash's settings), and its count equals transformers 5.23's
    ``Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig())`` built on the meta device (figures taken there once)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from mindmoe.conf.schema import register_configs
    from mindmoe.model.param_count import count_parameters

    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        group = OmegaConf.to_object(compose(config_name="config", overrides=["model=glm47_flash"]).model)
    imported = read_hf_config({"model_type": "glm4_moe_lite"}).model_config
    architecture = [
        "vocab_size", "hidden_size", "num_layers", "num_heads", "attention_type", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleaved", "rope_theta",
        "max_position_embeddings", "rope_scaling", "rms_norm_eps", "intermediate_size", "first_k_dense",
        "num_experts", "top_k", "moe_intermediate_size", "num_shared_experts", "score_func", "expert_bias",
        "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "tie_word_embeddings",
    ]  # fmt: skip
    assert {key: getattr(group, key) for key in architecture} == {key: getattr(imported, key) for key in architecture}
    count = count_parameters(group)
    assert (count.total, count.active, count.active_with_lm_head) == (29_943_390_976, 3_262_374_656, 3_579_568_896)
