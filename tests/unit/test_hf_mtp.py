"""HF import/export of multi-token-prediction layers (``model.layers.{num_hidden_layers + k}.*``).

transformers builds no MTP layer, so each test saves a tiny model with ``save_pretrained`` and adds a synthetic
one (``tests/helpers/hf_mtp.py``) as DeepSeek-V3 (layer 61) and GLM-4.5 (layer 92) store it.
"""

import json

import numpy as np
import pytest
import torch
from transformers import DeepseekV3ForCausalLM, Glm4MoeForCausalLM

from mindmoe.model.hf.config_map import HFCheckpointError
from mindmoe.model.hf.export import export_hf
from mindmoe.model.hf.load import load_hf_pretrained
from tests.helpers.hf_models import deepseek_v3_config, glm4_config, randomize_hf, save_hf
from tests.helpers.hf_mtp import all_tensors, with_mtp_layer

ARCHITECTURES = {
    "deepseek_v3": (DeepseekV3ForCausalLM, deepseek_v3_config),
    "glm4_moe": (Glm4MoeForCausalLM, glm4_config),
}


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
