"""A synthetic multi-token-prediction layer added to a saved HF checkpoint, stored as DeepSeek-V3 (layer 61), GLM-4.5
(layer 92) and GLM-5 (layer 78) store theirs: ``model.layers.{num_hidden_layers}.*``, a full MoE decoder layer's
tensors plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the embedding (``embed_tokens``)
and LM head (``shared_head.head``). transformers builds no MTP layer, so the tests write one."""

import json

import numpy as np
from safetensors.numpy import load_file, save_file


def all_tensors(directory) -> dict:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def with_mtp_layer(directory, num_layers: int) -> dict:
    """Add layer ``num_layers`` as an MTP layer (the last main layer's tensors, perturbed, plus the MTP parts) and
    ``num_nextn_predict_layers: 1``; returns the added tensors."""
    tensors = all_tensors(directory)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    rng = np.random.default_rng(11)
    last = f"model.layers.{num_layers - 1}."
    mtp = {
        name.replace(last, f"model.layers.{num_layers}."): (array + rng.normal(0, 0.01, array.shape)).astype(np.float32)
        for name, array in tensors.items()
        if name.startswith(last)
    }
    prefix = f"model.layers.{num_layers}."
    mtp[prefix + "enorm.weight"] = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    mtp[prefix + "hnorm.weight"] = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    mtp[prefix + "shared_head.norm.weight"] = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    mtp[prefix + "eh_proj.weight"] = rng.normal(0, 0.1, (hidden, 2 * hidden)).astype(np.float32)
    mtp[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    mtp[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    save_file(mtp, str(directory / "model-mtp.safetensors"))
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
