"""The files of a mindmoe checkpoint directory, and the model config its ``state.json`` records.

``train/checkpoints/checkpoint.py`` writes and verifies checkpoints; the file names and the one reader of a
checkpoint's :class:`ModelConfig` live here, below ``train/``, because the HF export of ``model/hf``
reads checkpoint directories too. Nothing here needs MindSpore.
"""

import json
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import List, Optional

from mindmoe.model.config import ModelConfig
from mindmoe.model.dsa_config import DSA_TRAINING_KEYS, DSATrainingConfig
from mindmoe.model.moe_config import MOE_KEYS, MoEConfig

#: Parameters by their model names (safetensors).
MODEL_FILE = "model.safetensors"
#: Step, data position, seed, file hashes, ``model_config`` and ``tokenizer``; written last.
STATE_FILE = "state.json"
#: The run's resolved config (every key, as the run used it).
CONFIG_FILE = "config.yaml"
#: The ``state.json`` key naming the checkpoint's tokenizer file(s), relative to its directory.
TOKENIZER_KEY = "tokenizer"


class RecordedTokenizerPath(ValueError):
    """A ``state.json`` written before checkpoints carried their tokenizer: ``tokenizer`` is a path outside."""


def read_state(checkpoint_dir: Path) -> dict:
    with open(Path(checkpoint_dir) / STATE_FILE, encoding="utf-8") as handle:
        return json.load(handle)


def _readable_state(checkpoint_dir: Path) -> tuple:
    """``(path of state.json, its content)``; ValueError naming the file when it cannot be read."""
    state_path = Path(checkpoint_dir) / STATE_FILE
    try:
        return state_path, read_state(checkpoint_dir)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{state_path}: cannot be read ({err})") from None


def checkpoint_model_config(checkpoint_dir: Path) -> ModelConfig:
    """The architecture a checkpoint was written with; ValueError naming its ``state.json`` otherwise."""
    state_path, state = _readable_state(checkpoint_dir)
    if not isinstance(state, dict) or "model_config" not in state:
        raise ValueError(f"{state_path} has no 'model_config'")
    return ModelConfig.from_dict(state["model_config"], f"{state_path} model_config")


def checkpoint_moe_config(checkpoint_dir: Path) -> MoEConfig:
    """The MoE policy a checkpoint was trained with (``state.json`` ``moe_config``; a checkpoint written before
    the ``moe.*`` section kept those keys in ``model_config``); the defaults when it records neither."""
    state_path, state = _readable_state(checkpoint_dir)
    if isinstance(state, dict) and isinstance(state.get("moe_config"), dict):
        return MoEConfig.from_dict(state["moe_config"], f"{state_path} moe_config")
    recorded = state.get("model_config") if isinstance(state, dict) else None
    legacy = {key: recorded[key] for key in MOE_KEYS if isinstance(recorded, dict) and key in recorded}
    return MoEConfig(**legacy)


def checkpoint_dsa_training(checkpoint_dir: Path) -> DSATrainingConfig:
    """How a checkpoint's DSA indexers were trained (``state.json`` ``dsa_config``; a checkpoint written before the
    ``dsa.*`` section kept those keys in ``model_config.dsa``); the defaults when it records neither."""
    state_path, state = _readable_state(checkpoint_dir)
    if isinstance(state, dict) and isinstance(state.get("dsa_config"), dict):
        return DSATrainingConfig.from_dict(state["dsa_config"], f"{state_path} dsa_config")
    recorded = state.get("model_config") if isinstance(state, dict) else None
    dsa = recorded.get("dsa") if isinstance(recorded, dict) else None
    return DSATrainingConfig(**{key: dsa[key] for key in DSA_TRAINING_KEYS if isinstance(dsa, dict) and key in dsa})


def checkpoint_tokenizer_names(checkpoint_dir: Path) -> Optional[List[str]]:
    """The tokenizer files a checkpoint carries (``state.json`` ``tokenizer``), None when it records none.

    Names are relative to the checkpoint directory and stay inside it: an absolute name or ``..`` is a
    ValueError naming the file and key, so nothing outside the checkpoint is ever read (or exported) for
    it. A string (an older checkpoint's path into the user's cache) is :class:`RecordedTokenizerPath`.
    """
    state_path = Path(checkpoint_dir) / STATE_FILE
    value = read_state(checkpoint_dir).get(TOKENIZER_KEY)
    if value is None:
        return None
    where = f"{state_path} {TOKENIZER_KEY!r}"
    if isinstance(value, str):
        raise RecordedTokenizerPath(
            f"{where} is the path {value!r}: the checkpoint was written before checkpoints carried their "
            f"tokenizer, and a path outside the checkpoint is not read. Pass data.tokenizer=<the tokenizer it "
            f"was trained with>, or copy its file(s) into the checkpoint directory and list them there by "
            f'relative name (e.g. "{TOKENIZER_KEY}": ["tokenizer.model"])'
        )
    if not isinstance(value, list) or not value or not all(isinstance(name, str) and name for name in value):
        raise ValueError(f"{where} must be a non-empty list of file names relative to the checkpoint, not {value!r}")
    for name in value:
        if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
            raise ValueError(f"{where}: {name!r} is an absolute path; name files relative to the checkpoint directory")
        if ".." in PureWindowsPath(name).parts:
            raise ValueError(f"{where}: {name!r} leaves the checkpoint directory ('..'); name files inside it")
        path, root = (Path(checkpoint_dir) / name).resolve(), Path(checkpoint_dir).resolve()
        if root not in path.parents:  # a symbolic link out of the checkpoint
            raise ValueError(f"{where}: {name!r} resolves to {path}, outside the checkpoint directory")
        if not path.is_file():
            raise ValueError(f"{where}: {name!r} is not a file of the checkpoint {checkpoint_dir}")
    return value
