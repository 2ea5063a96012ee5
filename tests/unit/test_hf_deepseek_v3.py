"""HF ``deepseek_v3`` interop: tiny random transformers 4.57.1 ``DeepseekV3ForCausalLM`` models saved with
``save_pretrained`` load in mindmoe (MLA, ``model/mla.py``) with HF's logits (fp32, eager attention,
<= 1e-4); the import exported again loads in transformers with identical weights; settings mindmoe cannot
reproduce are refused naming the key.

Variants: query compression (``q_lora_rank``) with interleaved RoPE, YaRN with ``mscale``/``mscale_all_dim``
and group-limited routing; a plain ``q_proj`` with rotate-half RoPE, no scaling, two groups pick one.
Each check that a setting matters (logits move by > 1e-2 without it) makes the match mean something.
"""

import copy
import json

import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers import AutoModelForCausalLM

from mindmoe.model.hf import HFCheckpointError, export_hf, load_hf_pretrained, read_hf_config
from mindmoe.model.mla import mla_softmax_scale
from mindmoe.model.outputs import OUT_HEAD
from tests.helpers.hf_models import (
    DEEPSEEK_V3_VARIANTS,
    deepseek_v3_config,
    deepseek_v3_variant,
    hf_logits,
    save_hf,
    token_ids,
)

ATOL = 1e-4
SEQ = 20
VARIANTS = DEEPSEEK_V3_VARIANTS


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """``name -> (hf, directory, cfg, ours)``, built once per module (each model compiles one graph)."""
    built = {}

    def get(name):
        if name not in built:
            hf = deepseek_v3_variant(name)
            directory = save_hf(hf, tmp_path_factory.mktemp(name))
            cfg, ours, _ = load_hf_pretrained(directory)
            built[name] = hf, directory, cfg, ours
        return built[name]

    return get


def our_logits(model, ids):
    return model(Tensor(ids), Tensor(np.zeros_like(ids)))[OUT_HEAD].asnumpy()


def moved(hf, changed, ids) -> float:
    return float(np.abs(hf_logits(changed, ids) - hf_logits(hf, ids)).max())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_deepseek_v3_checkpoint_gives_hf_logits(variant, name):
    hf, _, cfg, ours = variant(name)
    ids = token_ids(SEQ, seed=3)
    expected = hf_logits(hf, ids)
    assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
    np.testing.assert_allclose(our_logits(ours, ids), expected, atol=ATOL, rtol=0)
    assert cfg.attention_type == "mla" and cfg.num_kv_heads == cfg.num_heads
    # The settings under test change HF's logits, so matching them is not luck.
    flipped = copy.deepcopy(hf)
    flipped.config.rope_interleave = not hf.config.rope_interleave
    assert moved(hf, flipped, ids) > 1e-2
    ungrouped = copy.deepcopy(hf)
    for layer in ungrouped.model.layers[hf.config.first_k_dense_replace :]:
        layer.mlp.gate.n_group = layer.mlp.gate.topk_group = 1
    assert moved(hf, ungrouped, ids) > 1e-2
    if hf.config.rope_scaling:
        unscaled = copy.deepcopy(hf)
        for layer in unscaled.model.layers:
            layer.self_attn.scaling = hf.config.qk_head_dim**-0.5
        assert moved(hf, unscaled, ids) > 1e-2


def test_deepseek_v3_config_maps_every_setting(variant):
    hf, _, cfg, ours = variant("q_lora_interleaved_yarn_groups")
    hc = hf.config
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        hc.q_lora_rank,
        hc.kv_lora_rank,
        hc.qk_nope_head_dim,
        hc.qk_rope_head_dim,
        hc.v_head_dim,
    )
    assert (cfg.rope_interleaved, cfg.first_k_dense, cfg.n_group, cfg.topk_group) == (True, 1, 4, 2)
    assert (cfg.score_func, cfg.expert_bias, cfg.routed_scaling_factor) == ("sigmoid", True, 2.5)
    scaling = cfg.rope_scaling
    assert (scaling.type, scaling.factor, scaling.original_max_position, scaling.mscale_all_dim) == (
        "yarn",
        4.0,
        16,
        0.8,
    )
    assert scaling.attention_factor == pytest.approx((0.1 * np.log(4.0) + 1) / (0.08 * np.log(4.0) + 1), rel=1e-12)
    assert mla_softmax_scale(cfg) == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert variant("plain_q_rotate_half_two_groups")[2].q_lora_rank is None


@pytest.mark.parametrize("name", list(VARIANTS))
def test_deepseek_v3_round_trip_through_export_gives_the_same_weights_and_logits(variant, name, tmp_path):
    hf, _, cfg, ours = variant(name)
    assert export_hf(ours, out_dir=tmp_path) == []
    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["model_type"] == "deepseek_v3" and exported["architectures"] == ["DeepseekV3ForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    # config.json carries what the softmax scale and the RoPE tables need (mscale_all_dim, attention_factor)
    assert reloaded.model.layers[0].self_attn.scaling == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    torch.testing.assert_close(reloaded.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert reloaded.model.rotary_emb.attention_scaling == pytest.approx(hf.model.rotary_emb.attention_scaling)
    original = hf.state_dict()
    reloaded_state = reloaded.state_dict()
    assert set(reloaded_state) == set(original)
    for key, value in reloaded_state.items():
        torch.testing.assert_close(value, original[key], rtol=0, atol=0, msg=key)
    ids = token_ids(SEQ, seed=4)
    np.testing.assert_allclose(hf_logits(reloaded, ids), our_logits(ours, ids), atol=ATOL, rtol=0)


def deepseek_dict(**changes):
    values = deepseek_v3_config().to_dict()
    values.update(changes)
    return values


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads=2: must equal num_attention_heads=4"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(head_dim=8), "head_dim=8: must equal qk_rope_head_dim=4"),
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(topk_method="greedy"), "topk_method='greedy'"),
        (dict(n_shared_experts=0), "n_shared_experts=0"),
        (
            dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "mscale_all_dim": 1.0}),
            "mscale_all_dim with rope_type 'linear'",
        ),
        (dict(qk_rope_head_dim=3, head_dim=3), "model.qk_rope_head_dim=3: must be even"),
    ],
)
def test_unsupported_deepseek_v3_settings_are_refused_naming_the_key(changes, match):
    with pytest.raises(HFCheckpointError, match=match.replace("(", r"\(").replace(")", r"\)")):
        read_hf_config(deepseek_dict(**changes))


def test_deepseek_v3_defaults_are_the_published_shape():
    cfg = read_hf_config({"model_type": "deepseek_v3"}).model_config
    assert (cfg.attention_type, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.num_layers, cfg.first_k_dense) == (
        "mla",
        1536,
        512,
        61,
        3,
    )
    assert (cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.rope_interleaved) == (256, 8, 8, 4, True)


def test_deepseek_v3_model_group_is_the_published_model_and_counts_its_parameters():
    """``model=deepseek_v3`` equals the import of a config.json with DeepSeek-V3's published settings, and its
    count equals transformers' ``DeepseekV3ForCausalLM(DeepseekV3Config())`` on the meta device."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from mindmoe.conf.schema import register_configs
    from mindmoe.model.param_count import count_parameters

    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        group = OmegaConf.to_object(compose(config_name="config", overrides=["model=deepseek_v3"]).model)
    published = {
        "model_type": "deepseek_v3",
        "max_position_embeddings": 163840,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    }
    imported = read_hf_config(published).model_config
    architecture = [
        "vocab_size", "hidden_size", "num_layers", "num_heads", "attention_type", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleaved", "rope_theta",
        "max_position_embeddings", "rope_scaling", "rms_norm_eps", "intermediate_size", "first_k_dense",
        "num_experts", "top_k", "moe_intermediate_size", "num_shared_experts", "score_func", "expert_bias",
        "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "tie_word_embeddings",
    ]  # fmt: skip
    assert {key: getattr(group, key) for key in architecture} == {key: getattr(imported, key) for key in architecture}
    count = count_parameters(group)
    assert (count.total, count.active, count.active_with_lm_head) == (671_026_404_352, 35_698_924_544, 36_625_603_584)
