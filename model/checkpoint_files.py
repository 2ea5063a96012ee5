"""The files of a mindmoe checkpoint directory, and the model config its ``state.json`` records.

``train/checkpoint.py`` writes and verifies checkpoints; the file names and the one reader of a
checkpoint's :class:`ModelConfig` live here, below ``train/``, because the HF export of ``model/hf``
reads checkpoint directories too. Nothing here needs MindSpore.
"""

import json
from pathlib import Path

from mindmoe.model.config import ModelConfig

#: Parameters by their model names (safetensors).
MODEL_FILE = "model.safetensors"
#: Step, data position, seed, file hashes and ``model_config``; written last.
STATE_FILE = "state.json"


def read_state(checkpoint_dir: Path) -> dict:
    with open(Path(checkpoint_dir) / STATE_FILE, encoding="utf-8") as handle:
        return json.load(handle)


def checkpoint_model_config(checkpoint_dir: Path) -> ModelConfig:
    """The architecture a checkpoint was written with; ValueError naming its ``state.json`` otherwise."""
    state_path = Path(checkpoint_dir) / STATE_FILE
    try:
        state = read_state(checkpoint_dir)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{state_path}: cannot be read ({err})") from None
    if not isinstance(state, dict) or "model_config" not in state:
        raise ValueError(f"{state_path} has no 'model_config'")
    return ModelConfig.from_dict(state["model_config"], f"{state_path} model_config")
