"""Resume compatibility: a run continues a checkpoint only with the settings that checkpoint was trained with.

``state.json`` records what a resumed run must not change silently: the tokenizer (``tokenizer_sha256``,
the sha256 of its files), ``data.seq_len`` (``seq_len``), ``train.seed`` (``data_seed``) and the architecture
(``model_config``, every ``model.*`` key but ``pretrained``; how the MoE layers train, ``moe.*``, may change). A
difference is an error naming the key and both values, unless ``train.resume_allow_changes`` lists the key
(long-context continuation changes ``data.seq_len``, often with ``model.rope_theta``). The tokenizer is never
allowed to change: token ids of another tokenizer would feed the trained embeddings the wrong rows.

The trainer checks twice: ``data.seq_len``, ``train.seed`` and the planned architecture as soon as the checkpoint
is chosen, before anything in the run dir changes or the data is prepared; the tokenizer and the vocabulary
once the data is. The keys ``train.resume_allow_changes`` accepts are checked with the rest of the config
(:mod:`train.config`).
"""

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from mindmoe.model.config import ModelConfig
from mindmoe.train.config import ALLOWABLE_CHANGES, ARCHITECTURE_FIELDS

log = logging.getLogger("mindmoe.train")

#: ``state.json`` keys of the values below (``data_seed`` and ``model_config`` predate the checks).
SEQ_LEN_KEY, SEED_KEY, TOKENIZER_HASH_KEY, MODEL_KEY = "seq_len", "data_seed", "tokenizer_sha256", "model_config"
ALLOW_KEY = "train.resume_allow_changes"
TOKENIZER_LABEL = "tokenizer (sha256 of its files)"


def tokenizer_sha256(tokenizer_path) -> str:
    """The sha256 of a sentencepiece ``.model`` file (as ``sha256sum`` prints it), or for a HF tokenizer
    directory the sha256 of ``{file name: sha256}`` of its defining files."""
    from mindmoe.data.tokenizer_files import tokenizer_files  # opens no tokenizer; imported when a run needs it

    path = Path(tokenizer_path).expanduser()
    digests = {file.name: hashlib.sha256(file.read_bytes()).hexdigest() for file in tokenizer_files(path)}
    if not path.is_dir():
        return digests[path.name]
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode("utf-8")).hexdigest()


def run_state(seq_len: int, tokenizer_path) -> dict:
    """What :func:`check_resume` needs in ``state.json`` besides ``data_seed`` and ``model_config``."""
    return {SEQ_LEN_KEY: int(seq_len), TOKENIZER_HASH_KEY: tokenizer_sha256(tokenizer_path)}


def architecture(model_cfg: ModelConfig) -> dict:
    """``{"model.<field>": value}`` of the architecture fields, ``head_dim`` resolved (0 = hidden_size /
    num_heads), ``dsa`` as the indexer's shape and ``vocab_size`` left out while 0 (a planned model whose
    tokenizer is not read yet)."""
    values = {name: value for name, value in dataclasses.asdict(model_cfg).items() if name in ARCHITECTURE_FIELDS}
    values["head_dim"] = model_cfg.resolved_head_dim
    if "dsa" in values:  # the indexer's weights; its stage, top-k and loss weight are training settings
        values["dsa"] = {"index_n_heads": model_cfg.dsa.index_n_heads, "index_head_dim": model_cfg.dsa.index_head_dim}
    if not values["vocab_size"]:
        del values["vocab_size"]
    return {f"model.{name}": value for name, value in json.loads(json.dumps(values)).items()}


def recorded(state: dict) -> dict:
    """The checked values a checkpoint's ``state`` records, by the key they are checked as."""
    # A key the state lacks is left out; an architecture field may be recorded as None (MLA's q_lora_rank).
    values = {"data.seq_len": state.get(SEQ_LEN_KEY), "train.seed": state.get(SEED_KEY)}
    values[TOKENIZER_LABEL] = state.get(TOKENIZER_HASH_KEY)
    values = {key: value for key, value in values.items() if value is not None}
    if isinstance(state.get(MODEL_KEY), dict):
        try:
            values.update(architecture(ModelConfig.from_dict(state[MODEL_KEY], MODEL_KEY)))
        except (TypeError, ValueError):
            pass  # another version's model_config: its tensors are checked when they are loaded
    return values


def check_resume(checkpoint_dir, state: dict, current: dict, allowed=()) -> None:
    """Raise ValueError listing every key of ``current`` (``{checked key: this run's value}``) whose value
    differs from checkpoint ``state`` and is not in ``allowed`` (``train.resume_allow_changes``); warn about
    allowed changes and about values the checkpoint does not record (an older one)."""
    before = recorded(state)
    unchecked = sorted({MODEL_KEY if key.startswith("model.") else key for key in current if key not in before})
    if unchecked:
        where = Path(checkpoint_dir) / "state.json"
        log.warning("%s records no %s (an older checkpoint): not checked on resume", where, ", ".join(unchecked))
    problems, allowable = [], []
    for key, value in current.items():
        if key not in before or before[key] == value:
            continue
        line = f"{key}: the checkpoint was trained with {before[key]!r}, this run has {value!r}"
        if key in allowed:
            log.warning("resuming %s with a change %s allows: %s", checkpoint_dir, ALLOW_KEY, line)
            continue
        problems.append(line)
        allowable += [key] if key in ALLOWABLE_CHANGES else []
    if not problems:
        return
    hint = (
        f"; to continue with the new value (e.g. a long-context continuation) add {ALLOW_KEY}=[{','.join(allowable)}]"
    )
    raise ValueError(
        f"train.resume: checkpoint {checkpoint_dir} does not match this run:\n  "
        + "\n  ".join(problems)
        + "\nset the checkpoint's values again, or start a new run in another hydra.run.dir"
        + (hint if allowable else "")
    )
