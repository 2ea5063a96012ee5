"""HF interop: tiny random transformers 4.57.1 models (``glm4_moe``, ``qwen3_moe``, ``mixtral``) saved
with ``save_pretrained`` and loaded by mindmoe give HF's logits (fp32, eager attention, <= 1e-4);
mindmoe models exported with ``export_hf`` load in ``AutoModelForCausalLM`` with the same logits;
broken directories fail with errors that name the problem.

Weights are O(1) (HF's 0.02 init gives near-zero logits that would match anything); router
weights are scaled so routing is decisive and glm4_moe's correction bias is non-zero and checked
to change the routing.
"""

import copy
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from mindspore import Tensor
from safetensors.torch import load_file as load_torch_file
from safetensors.torch import save_file as save_torch_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

from mindmoe.model.config import ModelConfig
from mindmoe.model.hf import (
    HFCheckpointError,
    NameMap,
    export_hf,
    hf_config_from_model,
    load_hf_pretrained,
    load_hf_weights,
    plan_hf_weights,
    read_hf_config,
    read_pretrained_config,
)
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.param_count import parameter_shapes
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.export import export_hf_with_tokenizer
from tests.helpers.hf_models import glm4_config, hf_logits, randomize_hf, save_hf, token_ids

VOCAB, HIDDEN, LAYERS = 96, 32, 3
ATOL = 1e-4


# ------------------------------------------------------------------------------------------- helpers


def our_logits(model, ids):
    return model(Tensor(ids), Tensor(np.zeros_like(ids)))[OUT_HEAD].asnumpy()


def assert_logits_match(ours, hf, ids):
    expected = hf_logits(hf, ids)
    assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
    np.testing.assert_allclose(our_logits(ours, ids), expected, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- glm4_moe logits vs HF

GLM4_VARIANTS = {
    # group-limited routing, QK-norm, q/k/v bias, linear RoPE scaling; saved in shards with an index
    "groups_qknorm_linear": (
        dict(n_group=2, topk_group=1, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        10,
        "40KB",
    ),
    # no QK-norm, no bias, no dense layer, dynamic NTK evaluated beyond max_position_embeddings (HF
    # grows its tables). Fewer layers where they add nothing: each MoE layer costs ~5 s of compile.
    "no_qknorm_dynamic": (
        dict(
            use_qk_norm=False,
            attention_bias=False,
            max_position_embeddings=16,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        ),
        24,
        None,
    ),
    # YaRN from a shorter original context, two shared experts, tied embeddings, 4 groups pick 2
    "yarn_tied_two_shared": (
        dict(
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            tie_word_embeddings=True,
            num_hidden_layers=2,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        ),
        20,
        None,
    ),
}


@pytest.fixture(scope="module")
def glm4_variant(tmp_path_factory):
    """``name -> (hf, directory, cfg, ours, notes, seq_len)``, built once per module: every mindmoe
    model compiles one graph (~20 s on CPU), which the tests below share."""
    built = {}

    def get(name):
        if name not in built:
            overrides, seq_len, shard = GLM4_VARIANTS[name]
            torch.manual_seed(0)
            hf = randomize_hf(
                Glm4MoeForCausalLM(glm4_config(attn_implementation="eager", **copy.deepcopy(overrides))), seed=len(name)
            )
            directory = save_hf(hf, tmp_path_factory.mktemp(name), **({"max_shard_size": shard} if shard else {}))
            cfg, ours, notes = load_hf_pretrained(directory)
            built[name] = hf, directory, cfg, ours, notes, seq_len
        return built[name]

    return get


@pytest.mark.parametrize("name", list(GLM4_VARIANTS))
def test_glm4_moe_checkpoint_gives_hf_logits(glm4_variant, name):
    hf, directory, cfg, ours, notes, seq_len = glm4_variant(name)
    ids = token_ids(seq_len, seed=3)
    assert_logits_match(ours, hf, ids)
    # The import is faithful, not lucky: the correction bias changes HF's routing here.
    unbiased = copy.deepcopy(hf)
    for layer in unbiased.model.layers[hf.config.first_k_dense_replace :]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert np.abs(hf_logits(unbiased, ids) - hf_logits(hf, ids)).max() > 1e-2
    if hf.config.n_group > 1:  # ... and so does the group limit
        ungrouped = copy.deepcopy(hf)
        for layer in ungrouped.model.layers[hf.config.first_k_dense_replace :]:
            layer.mlp.gate.n_group = layer.mlp.gate.topk_group = 1
        assert np.abs(hf_logits(ungrouped, ids) - hf_logits(hf, ids)).max() > 1e-2
    assert ours.moe_config.dispatch == "dropless" and cfg.expert_bias and cfg.score_func == "sigmoid"
    assert any("moe.dispatch=dropless" in note for note in notes)
    if name == "groups_qknorm_linear":
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(list(directory.glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("name", list(GLM4_VARIANTS))
def test_glm4_moe_config_maps_every_setting(glm4_variant, name):
    hf, _, cfg, _, _, _ = glm4_variant(name)
    hc = hf.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hc.hidden_size,
        hc.num_hidden_layers,
        hc.num_attention_heads,
        hc.num_key_value_heads,
        hc.head_dim,
    )
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.partial_rotary_factor, cfg.first_k_dense) == (
        hc.use_qk_norm,
        hc.attention_bias,
        hc.partial_rotary_factor,
        hc.first_k_dense_replace,
    )
    assert (cfg.num_experts, cfg.top_k, cfg.num_shared_experts, cfg.n_group, cfg.topk_group) == (
        hc.n_routed_experts,
        hc.num_experts_per_tok,
        hc.n_shared_experts,
        hc.n_group,
        hc.topk_group,
    )
    assert (cfg.routed_scaling_factor, cfg.norm_topk_prob, cfg.tie_word_embeddings) == (
        hc.routed_scaling_factor,
        hc.norm_topk_prob,
        hc.tie_word_embeddings,
    )
    expected_type = {
        "groups_qknorm_linear": "linear",
        "no_qknorm_dynamic": "dynamic_ntk",
        "yarn_tied_two_shared": "yarn",
    }[name]
    assert cfg.rope_scaling.type == expected_type
    if expected_type == "dynamic_ntk":
        assert cfg.rope_scaling.original_max_position == hc.max_position_embeddings
    if expected_type == "yarn":
        assert cfg.rope_scaling.original_max_position == 16


@pytest.mark.parametrize("name", list(GLM4_VARIANTS))
def test_glm4_moe_round_trip_through_export_gives_the_same_logits(glm4_variant, name, tmp_path):
    hf, _, cfg, ours, _, seq_len = glm4_variant(name)
    sharded = name == "groups_qknorm_linear"
    notes = export_hf(ours, out_dir=tmp_path, **({"max_shard_bytes": 30_000} if sharded else {}))
    assert notes == []
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    plan_hf_weights(tmp_path, read_pretrained_config(tmp_path))  # and mindmoe reads its own export
    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["model_type"] == "glm4_moe" and exported["architectures"] == ["Glm4MoeForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", torch_dtype=torch.float32
    ).eval()
    original = hf.state_dict()
    for key, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, original[key], rtol=0, atol=0, msg=key)
    ids = token_ids(seq_len, seed=4)  # the compiled shape: no second graph
    np.testing.assert_allclose(hf_logits(reloaded, ids), our_logits(ours, ids), atol=ATOL, rtol=0)


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

    from mindmoe.train.checkpoint import save_checkpoint

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


# ------------------------------------------------------------------------------------- bf16 weights


def test_bf16_checkpoint_loads_as_the_exact_fp32_values(glm4_variant, tmp_path):
    # Reuses a compiled model: weights are graph parameters, so new values need no new graph.
    name = "groups_qknorm_linear"
    hf, directory, _, ours, _, seq_len = glm4_variant(name)
    save_hf(copy.deepcopy(hf).to(torch.bfloat16), tmp_path)
    assert {v.dtype for v in load_torch_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}
    try:
        notes = load_hf_weights(ours, plan_hf_weights(tmp_path, read_pretrained_config(tmp_path)))
        assert any("BF16 tensors converted to float32" in note for note in notes)
        # The reference: HF's own fp32 upcast of the same bf16 file.
        reference = AutoModelForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager", torch_dtype=torch.float32
        ).eval()
        ids = token_ids(seq_len, seed=9)
        assert_logits_match(ours, reference, ids)
        assert np.abs(hf_logits(reference, ids) - hf_logits(hf, ids)).max() > 1e-3  # bf16 did round
    finally:
        load_hf_weights(ours, plan_hf_weights(directory, read_pretrained_config(directory)))


# --------------------------------------------------------------------------------- broken directories


@pytest.fixture(scope="module")
def saved_glm4(tmp_path_factory):
    torch.manual_seed(4)
    hf = randomize_hf(Glm4MoeForCausalLM(glm4_config()), seed=31)
    return save_hf(hf, tmp_path_factory.mktemp("glm4_base"), max_shard_size="40KB")


@pytest.fixture
def glm4_dir(saved_glm4, tmp_path):
    return Path(shutil.copytree(saved_glm4, tmp_path / "hf"))


def rewrite_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def add_shard(directory, tensors, name="model-extra.safetensors"):
    """Add ``tensors`` as a new shard and list them in the index."""
    save_torch_file(tensors, str(directory / name), metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({key: name for key in tensors})
    index_path.write_text(json.dumps(index))


def test_missing_directory_and_missing_config_are_named(tmp_path):
    with pytest.raises(HFCheckpointError, match="not a directory"):
        load_hf_pretrained(tmp_path / "nowhere")
    with pytest.raises(HFCheckpointError, match="no config.json"):
        load_hf_pretrained(tmp_path)


def test_unsupported_model_type_lists_the_supported_ones(glm4_dir):
    rewrite_config(glm4_dir, model_type="deepseek_v2")
    with pytest.raises(
        HFCheckpointError,
        match=r"model_type='deepseek_v2' is not supported.*glm4_moe, qwen3_moe, mixtral, deepseek_v3",
    ):
        load_hf_pretrained(glm4_dir)


def test_missing_shard_is_named(glm4_dir):
    shard = sorted(glm4_dir.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(HFCheckpointError, match=f"lists shards that are not in .*{shard.name}"):
        load_hf_pretrained(glm4_dir)


def test_pickle_only_directory_is_refused(tmp_path):
    shutil.copyfile(Path(__file__), tmp_path / "pytorch_model.bin")  # never opened: refused by name
    (tmp_path / "config.json").write_text(json.dumps(glm4_config().to_dict()))
    with pytest.raises(HFCheckpointError, match="never unpickles"):
        load_hf_pretrained(tmp_path)


def test_unmapped_tensor_is_an_error_naming_it(glm4_dir):
    add_shard(glm4_dir, {"model.layers.1.mlp.mystery_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(HFCheckpointError) as err:
        load_hf_pretrained(glm4_dir)
    assert "model.layers.1.mlp.mystery_proj.weight (model-extra.safetensors): F32[4, 4]" in str(err.value)


def test_shape_mismatch_names_the_tensor_and_both_shapes(glm4_dir):
    name = "model.layers.1.self_attn.q_proj.weight"
    shard = replace_in_shard(glm4_dir, name, torch.zeros(65, HIDDEN))
    with pytest.raises(HFCheckpointError) as err:
        load_hf_pretrained(glm4_dir)
    assert f"{name} ({shard}): checkpoint [65, 32] vs [64, 32] expected from config.json" in str(err.value)


def test_missing_expert_is_named_with_its_hf_name(glm4_dir):
    index_path = glm4_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    shard = glm4_dir / index["weight_map"].pop(name)
    tensors = load_torch_file(shard)
    del tensors[name]
    save_torch_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        HFCheckpointError,
        match=r"missing.*\n.*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight "
        r"\(for layers\.2\.mlp\.experts\.up_proj\[5\]\)",
    ):
        load_hf_pretrained(glm4_dir)


def replace_in_shard(directory, name, value):
    """Rewrite the shard holding ``name`` with ``value`` in its place; returns the shard's file name."""
    shard = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_torch_file(directory / shard)
    tensors[name] = value
    save_torch_file(tensors, str(directory / shard), metadata={"format": "pt"})
    return shard


def test_unsupported_dtype_names_tensor_and_dtype(glm4_dir):
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    shard = replace_in_shard(glm4_dir, name, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(HFCheckpointError, match=re.escape(f"{name} ({shard}): dtype F64; readable: F32, F16, BF16")):
        load_hf_pretrained(glm4_dir)


def test_mtp_layer_is_skipped_with_a_note(glm4_dir):
    rewrite_config(glm4_dir, num_nextn_predict_layers=1)
    mtp = {
        f"model.layers.{LAYERS}.{name}": torch.ones(shape)
        for name, shape in [
            ("eh_proj.weight", (HIDDEN, 2 * HIDDEN)),
            ("enorm.weight", (HIDDEN,)),
            ("hnorm.weight", (HIDDEN,)),
            ("shared_head.norm.weight", (HIDDEN,)),
            ("self_attn.q_proj.weight", (64, HIDDEN)),
            ("mlp.experts.0.up_proj.weight", (16, HIDDEN)),
        ]
    }
    add_shard(glm4_dir, mtp)
    _, _, notes = load_hf_pretrained(glm4_dir)
    assert any(f"skipped 6 multi-token-prediction tensors of layer(s) [{LAYERS}]" in note for note in notes)


def test_auto_map_config_loads_as_data_and_never_runs_shipped_code(glm4_dir, tmp_path):
    marker = tmp_path / "code_ran"
    (glm4_dir / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (glm4_dir / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    rewrite_config(
        glm4_dir,
        auto_map={
            "AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomModel",
        },
    )
    _, _, notes = load_hf_pretrained(glm4_dir)
    assert any("auto_map" in note and "no shipped code runs" in note for note in notes)
    assert not marker.exists()


def test_architecture_overrides_must_agree_and_the_moe_policy_reaches_the_model(glm4_dir):
    with pytest.raises(HFCheckpointError, match=r"model\.hidden_size=64 conflicts with .*config.json.*gives 32"):
        read_pretrained_config(glm4_dir, {"hidden_size": 64})
    # the policy is no model key: an import takes it from moe.*, never as a model override
    with pytest.raises(HFCheckpointError, match=r"model\.dispatch: unknown key"):
        read_pretrained_config(glm4_dir, {"hidden_size": HIDDEN, "dispatch": "capacity"})
    moe = MoEConfig(dispatch="capacity", bias_update_rate=1e-3, aux_loss="seq")
    cfg, model, notes = load_hf_pretrained(glm4_dir, {"hidden_size": HIDDEN, "vocab_size": 0}, moe=moe)
    assert model.moe_config == moe and cfg.hidden_size == HIDDEN
    moe_layers = [layer.mlp for layer in model.layers[cfg.first_k_dense :]]
    assert moe_layers and all(type(mlp.dispatcher).__name__ == "CapacityDispatcher" for mlp in moe_layers)
    assert all(mlp.router.aux_loss_type == "seq" for mlp in moe_layers)
    assert not any("dropless" in note for note in notes)


# ----------------------------------------------------------------------------- config.json mapping


def qwen3_dict(**changes):
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    ).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(decoder_sparse_step=2), r"makes layers \[0, 2\] dense"),
        (dict(mlp_only_layers=[1]), r"makes layers \[1\] dense"),
        (dict(attention_bias=True), "bias on o_proj"),
        (dict(hidden_act="gelu"), "only 'silu'"),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "'longrope' is not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "truncate": False}), "truncate=false"),
        (dict(use_sliding_window=True, sliding_window=1024), "sliding_window=1024: is shorter than the 32768"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantized checkpoints"),
    ],
)
def test_unsupported_settings_are_rejected_naming_the_key(changes, match):
    with pytest.raises(HFCheckpointError, match=match):
        read_hf_config(qwen3_dict(**changes))


def test_qwen3_leading_dense_layers_become_first_k_dense():
    assert read_hf_config(qwen3_dict(mlp_only_layers=[0, 1])).model_config.first_k_dense == 2


def test_sliding_window_is_accepted_when_no_sequence_exceeds_it():
    mixtral = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        sliding_window=512,
    ).to_dict()
    with pytest.raises(HFCheckpointError, match="sliding_window=512"):
        read_hf_config(mixtral)
    assert read_hf_config(mixtral, max_seq_len=512).model_config.num_experts == 4


def test_yarn_mscale_pair_gives_the_attention_factor_hf_uses():
    import math

    config = qwen3_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5})
    factor = read_hf_config(config).model_config.rope_scaling.attention_factor
    assert factor == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))


def test_name_maps_cover_every_hf_tensor_both_ways():
    for model_cls, config in [
        (Glm4MoeForCausalLM, glm4_config()),
        (
            MixtralForCausalLM,
            MixtralConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
            ),
        ),
        (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                mlp_only_layers=[0],
            ),
        ),
    ]:
        hf_names = set(model_cls(config).state_dict())
        imported = read_hf_config(config.to_dict())
        names = NameMap(imported.model_type)
        shapes = parameter_shapes(imported.model_config, include_buffers=True)
        back = {
            hf
            for ours, shape in shapes.items()
            for hf, _ in names.to_hf(ours, shape[0] if ".mlp.experts." in ours else 0)
        }
        assert back == hf_names
        assert {names.to_ours(hf)[0] for hf in hf_names} == set(shapes)


# ------------------------------------------------------------------------------------------ tokenizer

CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]
MESSAGES = [
    {"role": "system", "content": "你是客服助手。"},
    {"role": "user", "content": "发票 how to reissue?"},
    {"role": "assistant", "content": "请提供订单号 12345。"},
]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE ``tokenizer.json`` with GLM-style special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["发票 how to reissue an invoice for order 12345?", "请提供订单号，我们会在三个工作日内处理。"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            },
            ensure_ascii=False,
        )
    )
    return directory


def test_tokenizer_json_encodes_decodes_and_templates_like_transformers(hf_tokenizer_dir):
    import pickle

    from transformers import AutoTokenizer

    from mindmoe.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer

    ours = load_hf_tokenizer(hf_tokenizer_dir)
    reference = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    assert isinstance(ours, HFTokenizer)
    text = "发票 how to reissue?\n请提供订单号 12345。<|user|>"
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids) == text
    assert ours.encode_batch([text, "abc"]) == [ids, reference.encode("abc", add_special_tokens=False)]
    assert (ours.vocab_size, ours.eos_id, ours.pad_id, ours.bos_id) == (
        len(reference),
        reference.eos_token_id,
        reference.pad_token_id,
        -1,
    )
    for add_generation_prompt in (False, True):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    assert pickle.loads(pickle.dumps(ours)).encode(text) == ids  # the tokenising workers get a copy


def test_chat_template_file_and_sentencepiece_fallback(hf_tokenizer_dir, tmp_path):
    from mindmoe.data.hf_tokenizer import HFSentencePieceTokenizer, load_hf_tokenizer
    from mindmoe.data.tokenizer import load_tokenizer, train_sentencepiece

    # Newer transformers save the template beside tokenizer_config.json; that file wins.
    directory = Path(shutil.copytree(hf_tokenizer_dir, tmp_path / "with_file"))
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    assert load_hf_tokenizer(directory).apply_chat_template(MESSAGES) == "你是客服助手。!"
    # A directory with only a sentencepiece model loads it (with the template of tokenizer_config.json).
    spm_dir = tmp_path / "spm"
    spm_dir.mkdir()
    texts = [f"invoice {i} was reissued on day {i % 7} for order number {i * 37}" for i in range(200)]
    model_path = train_sentencepiece(texts, 320, tmp_path / "trained")
    shutil.copyfile(model_path, spm_dir / "tokenizer.model")
    (spm_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    tokenizer = load_hf_tokenizer(spm_dir)
    assert isinstance(tokenizer, HFSentencePieceTokenizer)
    assert tokenizer.encode(texts[0]) == load_tokenizer(model_path).encode(texts[0])
    assert tokenizer.apply_chat_template(MESSAGES[1:2]).startswith("[gMASK]<sop><|user|>\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
        load_hf_tokenizer(empty)


def test_export_copies_the_tokenizer_and_records_its_special_ids(glm4_variant, hf_tokenizer_dir, tmp_path):
    _, _, _, ours, _, _ = glm4_variant("yarn_tied_two_shared")
    export_hf_with_tokenizer(ours, out_dir=tmp_path, tokenizer_dir=hf_tokenizer_dir)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == config["pad_token_id"] == 0 and "bos_token_id" not in config
    assert (tmp_path / "tokenizer.json").read_bytes() == (hf_tokenizer_dir / "tokenizer.json").read_bytes()
    assert "lm_head.weight" not in load_torch_file(tmp_path / "model.safetensors")  # tied, as HF saves it
    with pytest.raises(HFCheckpointError, match="already holds a checkpoint"):
        export_hf(ours, out_dir=tmp_path)
