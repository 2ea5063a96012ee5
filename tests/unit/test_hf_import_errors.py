"""HF import: broken directories fail with errors that name the problem, and ``config.json`` settings map to
mindmoe's config or are rejected naming the key (tiny random transformers 4.57.1 models saved with
``save_pretrained``).
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as load_torch_file
from safetensors.torch import save_file as save_torch_file
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

from mindmoe.model.hf import (
    HFCheckpointError,
    NameMap,
    load_hf_pretrained,
    read_hf_config,
    read_pretrained_config,
)
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.param_count import parameter_shapes
from tests.helpers.hf_models import glm4_config, randomize_hf, save_hf

VOCAB, HIDDEN, LAYERS = 96, 32, 3


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
    assert moe_layers and all(type(mlp.routed.dispatcher).__name__ == "CapacityDispatcher" for mlp in moe_layers)
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
