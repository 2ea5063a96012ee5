"""HF import/export of multi-token-prediction layers (``model.layers.{num_hidden_layers + k}.*``).

transformers builds no MTP layer, so each test saves a tiny model with ``save_pretrained`` and adds a synthetic
one as DeepSeek-V3 (layer 61) and GLM-4.5 (layer 92) store it: a full MoE decoder layer's tensors plus ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the embedding (``embed_tokens``) and LM head
(``shared_head.head``).
"""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file
from transformers import DeepseekV3ForCausalLM, Glm4MoeForCausalLM

from mindmoe.model.hf.config_map import HFCheckpointError
from mindmoe.model.hf.export import export_hf
from mindmoe.model.hf.load import load_hf_pretrained
from tests.helpers.hf_models import HIDDEN, deepseek_v3_config, glm4_config, randomize_hf, save_hf

ARCHITECTURES = {
    "deepseek_v3": (DeepseekV3ForCausalLM, deepseek_v3_config),
    "glm4_moe": (Glm4MoeForCausalLM, glm4_config),
}


def all_tensors(directory) -> dict:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def with_mtp_layer(directory, num_layers: int) -> dict:
    """Add layer ``num_layers`` as an MTP layer (the last main layer's tensors, perturbed, plus the MTP parts) and
    ``num_nextn_predict_layers: 1``; returns the added tensors."""
    tensors = all_tensors(directory)
    rng = np.random.default_rng(11)
    last = f"model.layers.{num_layers - 1}."
    mtp = {
        name.replace(last, f"model.layers.{num_layers}."): (array + rng.normal(0, 0.01, array.shape)).astype(np.float32)
        for name, array in tensors.items()
        if name.startswith(last)
    }
    prefix = f"model.layers.{num_layers}."
    mtp[prefix + "enorm.weight"] = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    mtp[prefix + "hnorm.weight"] = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    mtp[prefix + "shared_head.norm.weight"] = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    mtp[prefix + "eh_proj.weight"] = rng.normal(0, 0.1, (HIDDEN, 2 * HIDDEN)).astype(np.float32)
    mtp[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    mtp[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    save_file({name: torch.from_numpy(array) for name, array in mtp.items()}, str(directory / "model-mtp.safetensors"))
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"].update({name: "model-mtp.safetensors" for name in mtp})
        index_path.write_text(json.dumps(index))
    else:  # one file: make it an index of two shards
        weight_map = {name: "model.safetensors" for name in tensors}
        weight_map.update({name: "model-mtp.safetensors" for name in mtp})
        index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config))
    return mtp


@pytest.fixture(params=sorted(ARCHITECTURES))
def mtp_dir(request, tmp_path):
    model_cls, config_fn = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    config = config_fn()
    directory = save_hf(randomize_hf(model_cls(config), seed=5), tmp_path / "hf")
    return directory, config.num_hidden_layers, with_mtp_layer(directory, config.num_hidden_layers)


def test_mtp_layer_imports_with_mtp_layers_1_and_exports_byte_identical(mtp_dir, tmp_path):
    directory, num_layers, mtp = mtp_dir
    cfg, model, notes = load_hf_pretrained(directory, {"mtp_layers": 1})
    assert cfg.mtp_layers == 1 and not any("skipped" in note for note in notes)
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    np.testing.assert_array_equal(
        params["mtp_layers.0.eh_proj.weight"], mtp[f"model.layers.{num_layers}.eh_proj.weight"]
    )
    np.testing.assert_array_equal(
        params["mtp_layers.0.shared_head.norm.weight"], mtp[f"model.layers.{num_layers}.shared_head.norm.weight"]
    )
    export_hf(model, out_dir=tmp_path / "out")
    original, exported = all_tensors(directory), all_tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, array in original.items():
        assert exported[name].tobytes() == array.astype(np.float32).tobytes(), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_without_mtp_layers_the_mtp_layer_is_skipped_with_a_note(mtp_dir):
    directory, num_layers, _ = mtp_dir
    cfg, model, notes = load_hf_pretrained(directory)
    assert cfg.mtp_layers == 0 and not any(p.name.startswith("mtp_layers.") for p in model.get_parameters())
    assert any(f"multi-token-prediction tensors of layer(s) [{num_layers}]" in note for note in notes)


def test_more_mtp_layers_than_the_checkpoint_stores_are_refused_naming_the_key(mtp_dir):
    directory, _, _ = mtp_dir
    with pytest.raises(HFCheckpointError, match="model.mtp_layers=2"):
        load_hf_pretrained(directory, {"mtp_layers": 2})
