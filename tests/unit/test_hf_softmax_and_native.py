"""HF interop of the softmax-routed architectures and of mindmoe-native models: tiny random transformers
4.57.1 ``qwen3_moe`` and ``mixtral`` models give HF's logits (fp32, eager attention, <= 1e-4) and export as their
own architecture; mindmoe models exported with ``export_hf`` load in ``AutoModelForCausalLM`` with the same
logits and configuration.

Weights are O(1) (HF's 0.02 init gives near-zero logits that would match anything); router
weights are scaled so routing is decisive.
"""

import json

import numpy as np
import pytest
import torch
from mindspore import Tensor
from safetensors.torch import load_file as load_torch_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

from mindmoe.model.config import ModelConfig
from mindmoe.model.hf import (
    HFCheckpointError,
    export_hf,
    hf_config_from_model,
    load_hf_pretrained,
    read_hf_config,
)
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.param_count import parameter_shapes
from mindmoe.model.transformer import MoETransformer
from tests.helpers.hf_models import hf_logits, randomize_hf, save_hf, token_ids

VOCAB, HIDDEN, LAYERS = 96, 32, 3
ATOL = 1e-4


# ------------------------------------------------------------------------------------------- helpers


def our_logits(model, ids):
    return model(Tensor(ids), Tensor(np.zeros_like(ids)))[OUT_HEAD].asnumpy()


def assert_logits_match(ours, hf, ids):
    expected = hf_logits(hf, ids)
    assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
    np.testing.assert_allclose(our_logits(ours, ids), expected, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------- qwen3_moe and mixtral vs HF


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    torch.manual_seed(1)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=False,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = randomize_hf(Qwen3MoeForCausalLM(config), seed=11)
    directory = save_hf(hf, tmp_path_factory.mktemp("qwen3"))
    return hf, load_hf_pretrained(directory)


@pytest.fixture(scope="module")
def mixtral_pair(tmp_path_factory):
    torch.manual_seed(2)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=1e6,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = randomize_hf(MixtralForCausalLM(config), seed=12)
    directory = save_hf(hf, tmp_path_factory.mktemp("mixtral"))
    return hf, load_hf_pretrained(directory)


def test_qwen3_moe_checkpoint_gives_hf_logits(qwen3_pair):
    hf, (cfg, ours, _) = qwen3_pair
    assert (cfg.score_func, cfg.num_shared_experts, cfg.first_k_dense, cfg.qk_norm, cfg.qkv_bias) == (
        "softmax",
        0,
        1,
        True,
        False,
    )
    assert cfg.partial_rotary_factor == 1.0 and not cfg.norm_topk_prob  # Mixtral's test has it on
    assert_logits_match(ours, hf, token_ids(12, seed=5))


def test_mixtral_checkpoint_gives_hf_logits(mixtral_pair):
    hf, (cfg, ours, _) = mixtral_pair
    assert (cfg.score_func, cfg.num_shared_experts, cfg.first_k_dense, cfg.qk_norm, cfg.moe_intermediate_size) == (
        "softmax",
        0,
        0,
        False,
        24,
    )
    assert_logits_match(ours, hf, token_ids(12, seed=6))


@pytest.mark.parametrize("pair_name, model_type", [("qwen3_pair", "qwen3_moe"), ("mixtral_pair", "mixtral")])
def test_softmax_models_export_as_their_own_architecture(pair_name, model_type, request, tmp_path):
    hf, (_, ours, _) = request.getfixturevalue(pair_name)
    export_hf(ours, out_dir=tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = token_ids(12, seed=7)
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(hf, ids), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- mindmoe-native model -> HF -> mindmoe


def native_config(**overrides):
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        qkv_bias=True,
        qk_norm=True,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
        intermediate_size=48,
        first_k_dense=1,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=16,
        num_shared_experts=1,
        score_func="sigmoid",
        routed_scaling_factor=2.5,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


#: The native models train like HF runs them: no token dropped.
NATIVE_MOE = MoEConfig(dispatch="dropless")


def test_native_model_exports_its_weights_under_hf_names_with_a_zero_bias(tmp_path):
    """No mindmoe forward here (a graph compile each): with the weights equal name by name, the
    logits are those of tests/test_transformer_hf.py, which runs both models on this mapping."""
    import dataclasses

    from mindmoe.train.checkpoints.checkpoint import save_checkpoint

    cfg = native_config()
    model = MoETransformer(cfg, seed=0, moe=NATIVE_MOE)
    assert export_hf(model, out_dir=tmp_path / "from_model") == []  # dropless, no locking: HF matches
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "from_model", attn_implementation="eager").eval()
    state = hf.state_dict()
    ours = {p.name: p.asnumpy() for p in model.get_parameters()}
    assert len(state) == sum(cfg.num_experts if ".mlp.experts." in name else 1 for name in ours) + (
        LAYERS - cfg.first_k_dense
    )  # + one zero correction bias per MoE layer
    for layer in range(cfg.first_k_dense, LAYERS):
        assert torch.count_nonzero(state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]) == 0
        np.testing.assert_array_equal(
            state[f"model.layers.{layer}.mlp.experts.3.down_proj.weight"].numpy(),
            ours[f"layers.{layer}.mlp.experts.down_proj"][3],
        )
        np.testing.assert_array_equal(
            state[f"model.layers.{layer}.mlp.gate.weight"].numpy(), ours[f"layers.{layer}.mlp.router.weight"]
        )
    np.testing.assert_array_equal(
        state["model.layers.0.self_attn.q_norm.weight"].numpy(), ours["layers.0.self_attn.q_norm.weight"]
    )
    # A training checkpoint directory exports to the same files (config from its state.json).
    state = {"model_config": dataclasses.asdict(cfg), "moe_config": dataclasses.asdict(NATIVE_MOE)}
    checkpoint = save_checkpoint(tmp_path / "ckpt", 7, model.get_parameters(), [], state, keep_last=1)
    assert export_hf(checkpoint, out_dir=tmp_path / "from_checkpoint") == []  # the policy of its state.json
    from_model = load_torch_file(tmp_path / "from_model" / "model.safetensors")
    from_checkpoint = load_torch_file(tmp_path / "from_checkpoint" / "model.safetensors")
    assert from_model.keys() == from_checkpoint.keys()
    for key in from_model:
        torch.testing.assert_close(from_model[key], from_checkpoint[key], rtol=0, atol=0)


def test_softmax_model_with_shared_experts_cannot_be_exported_and_says_why(tmp_path):
    cfg = native_config(score_func="softmax")
    with pytest.raises(HFCheckpointError) as err:
        hf_config_from_model(cfg)
    message = str(err.value)
    assert "glm4_moe: needs score_func='sigmoid'" in message
    assert "qwen3_moe:" in message and "num_shared_experts=0" in message and "mixtral:" in message


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(
            qkv_bias=False,
            qk_norm=False,
            n_group=2,
            topk_group=1,
            expert_bias=True,
            tie_word_embeddings=True,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position": 16},
        ),
        dict(rope_scaling={"type": "dynamic_ntk", "factor": 2.0}),
    ],
)
def test_config_survives_export_and_import(overrides):
    cfg = native_config(**{"expert_bias": True, **overrides})
    model_type, hf, _ = hf_config_from_model(cfg)
    back = read_hf_config(json.loads(json.dumps(hf))).model_config
    for key in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "resolved_head_dim",
        "qkv_bias",
        "qk_norm",
        "rope_theta",
        "partial_rotary_factor",
        "max_position_embeddings",
        "rms_norm_eps",
        "intermediate_size",
        "first_k_dense",
        "num_experts",
        "top_k",
        "moe_intermediate_size",
        "num_shared_experts",
        "score_func",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
        "tie_word_embeddings",
    ):
        assert getattr(back, key) == getattr(cfg, key), key
    assert back.rope_scaling.type == cfg.rope_scaling.type
    assert back.rope_scaling.factor == cfg.rope_scaling.factor


def test_expected_parameter_shapes_are_the_models():
    for cfg in (
        native_config(),
        native_config(
            qkv_bias=False,
            qk_norm=False,
            expert_bias=True,
            tie_word_embeddings=True,
            num_shared_experts=0,
            first_k_dense=0,
        ),
    ):
        model = MoETransformer(cfg, moe=NATIVE_MOE)
        assert parameter_shapes(cfg, include_buffers=True) == {p.name: tuple(p.shape) for p in model.get_parameters()}
