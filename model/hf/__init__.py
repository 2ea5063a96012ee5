"""Hugging Face interop: import ``glm4_moe`` / ``qwen3_moe`` / ``mixtral`` / ``deepseek_v3`` / ``glm4_moe_lite`` /
``glm_moe_dsa`` checkpoint directories, export mindmoe models as HF checkpoints.

    cfg, model, notes = load_hf_pretrained("/path/to/hf_dir")           # config + streamed weights
    notes = export_hf(model, out_dir="/path/to/out")                       # or a checkpoint directory

Only local directories, only safetensors (never unpickled), ``config.json`` read as data (no
``trust_remote_code``). Every problem is a :class:`HFCheckpointError` that names the file, the
tensor or the config key.
"""

from mindmoe.model.hf.config_map import (
    OVERRIDABLE_FIELDS,
    SUPPORTED_MODEL_TYPES,
    HFCheckpointError,
    ImportedConfig,
    apply_overrides,
    read_hf_config,
)
from mindmoe.model.hf.export import export_hf, hf_config_from_model, hf_named_tensors
from mindmoe.model.hf.load import (
    load_hf_pretrained,
    load_hf_weights,
    plan_hf_weights,
    read_pretrained_config,
    weight_files,
)
from mindmoe.model.hf.weights import NameMap

__all__ = [
    "HFCheckpointError",
    "ImportedConfig",
    "NameMap",
    "OVERRIDABLE_FIELDS",
    "SUPPORTED_MODEL_TYPES",
    "apply_overrides",
    "export_hf",
    "hf_config_from_model",
    "hf_named_tensors",
    "load_hf_pretrained",
    "load_hf_weights",
    "plan_hf_weights",
    "read_hf_config",
    "read_pretrained_config",
    "weight_files",
]
