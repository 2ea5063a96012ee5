"""Checkpoints: a directory per step with safetensors files, written atomically.

    <run dir>/checkpoints/step_000300/
        model.safetensors       parameters by their model names (the checkpoint format)
        optimizer.safetensors   AdamW moments (``adam_m.*``, ``adam_v.*``) and ``global_step``
        tokenizer.model         the run's tokenizer: a sentencepiece file, or a HF tokenizer's
          or tokenizer/*          files (tokenizer.json, tokenizer_config.json, ..., config.json)
        config.yaml             the run's resolved config
        state.json              step, data position, seed, model_config, tokenizer (the names of
                                its files, relative to this directory), file hashes; written last

A checkpoint carries its tokenizer and config so that it can be exported, evaluated or resumed on
another machine, with the training data's cache gone.

A checkpoint is assembled in a hidden temporary directory and renamed into place only when
complete, so a crash while saving leaves the previous checkpoints untouched and never a
half-written one under a ``step_*`` name. ``state.json`` records the sha256 of the other files,
so a checkpoint truncated or altered afterwards is detected before it is loaded.
"""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, Optional

from mindspore import Tensor
from safetensors.numpy import load_file, save_file

from mindmoe.data.prepare import file_sha256
from mindmoe.data.tokenizer_files import read_tokenizer

# The file names and readers are shared with model/hf, whose HF export reads checkpoint directories.
from mindmoe.model.checkpoint_files import (  # noqa: F401
    CONFIG_FILE,
    MODEL_FILE,
    STATE_FILE,
    TOKENIZER_KEY,
    checkpoint_model_config,
    read_state,
)

STEP_DIR = re.compile(r"^step_(\d{6,})$")
OPTIMIZER_FILE = "optimizer.safetensors"


def parameters_to_numpy(params) -> dict:
    return {p.name: p.asnumpy() for p in params}


def load_parameters(params, tensors: dict, source: str) -> None:
    """Copy ``tensors`` into ``params`` by name; every name and shape must match exactly.

    MindSpore's own ``strict_load`` does not report missing or unexpected names, so the
    check is done here and lists every mismatch. Call it before the parameters are used by a
    compiled graph: MindSpore 2.9 graphs keep reading their own copy after a later ``set_data``.
    """
    params = list(params)
    by_name = {p.name: p for p in params}
    missing = sorted(set(by_name) - set(tensors))
    unexpected = sorted(set(tensors) - set(by_name))
    wrong_shape = [
        f"{name}: checkpoint {tuple(tensors[name].shape)} vs model {tuple(by_name[name].shape)}"
        for name in sorted(set(by_name) & set(tensors))
        if tuple(tensors[name].shape) != tuple(by_name[name].shape)
    ]
    if missing or unexpected or wrong_shape:
        lines = [f"{source} does not match the model:"]
        lines += [f"  missing: {name}" for name in missing]
        lines += [f"  unexpected: {name}" for name in unexpected]
        lines += [f"  shape: {line}" for line in wrong_shape]
        raise ValueError("\n".join(lines))
    for name, array in tensors.items():
        param = by_name[name]
        param.set_data(Tensor(array, dtype=param.dtype))


@dataclasses.dataclass(frozen=True)
class CarriedFiles:
    """What a checkpoint carries besides its tensors so it can be used elsewhere: the tokenizer (relative
    name -> bytes, as :func:`data.tokenizer_files.read_tokenizer` reads it) and the resolved config."""

    tokenizer: Dict[str, bytes]
    config_yaml: Optional[str] = None

    @classmethod
    def of_run(cls, tokenizer_path, config_yaml: Optional[str] = None) -> "CarriedFiles":
        return cls(read_tokenizer(tokenizer_path), config_yaml)

    def write(self, directory: Path) -> list:
        """Write the files into ``directory``; the relative names written."""
        files = dict(self.tokenizer)
        if self.config_yaml is not None:
            files[CONFIG_FILE] = self.config_yaml.encode("utf-8")
        for name, content in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(content)
        return list(files)


def save_checkpoint(
    checkpoint_root: Path,
    step: int,
    model_params,
    optimizer_params,
    state: dict,
    keep_last: int,
    write_extra=None,
    carried: Optional[CarriedFiles] = None,
) -> Path:
    """Write ``step_{step:06d}`` under ``checkpoint_root`` atomically and prune to ``keep_last``.

    ``write_extra(directory) -> [relative file names]`` adds files (hashed like the others), e.g. a
    LoRA run's PEFT adapter; ``carried`` adds the tokenizer (named in ``state.json`` ``tokenizer``) and
    ``config.yaml``."""
    checkpoint_root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_root / f"step_{step:06d}"
    tmp = checkpoint_root / f".step_{step:06d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(parameters_to_numpy(model_params), str(tmp / MODEL_FILE))
    save_file(parameters_to_numpy(optimizer_params), str(tmp / OPTIMIZER_FILE))
    names = [MODEL_FILE, OPTIMIZER_FILE] + (list(write_extra(tmp)) if write_extra else [])
    if carried is not None:
        names += carried.write(tmp)
        state = dict(state, **{TOKENIZER_KEY: sorted(carried.tokenizer)})
    for name in names:
        _fsync(tmp / name)
    files = {name: file_sha256(tmp / name) for name in names}
    with open(tmp / STATE_FILE, "w", encoding="utf-8") as handle:
        json.dump(dict(state, step=step, files=files), handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(checkpoint_root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)
    return final


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files do not match the hashes recorded when it was written."""


def verify_checkpoint(checkpoint_dir: Path) -> None:
    """Raise :class:`CorruptCheckpointError` naming every file that is missing or altered."""
    try:
        expected = read_state(checkpoint_dir)["files"]
    except (OSError, ValueError, KeyError) as error:
        raise CorruptCheckpointError(f"checkpoint {checkpoint_dir}: unreadable {STATE_FILE} ({error})") from error
    problems = []
    for name, digest in sorted(expected.items()):
        path = checkpoint_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_sha256(path) != digest:
            problems.append(f"{name} does not match its recorded sha256 (truncated or modified)")
    if problems:
        raise CorruptCheckpointError(f"checkpoint {checkpoint_dir}: " + "; ".join(problems))


def list_checkpoints(checkpoint_root: Path) -> list:
    """Complete checkpoints under ``checkpoint_root``, oldest first."""
    if not checkpoint_root.is_dir():
        return []
    found = [
        path
        for path in checkpoint_root.iterdir()
        if path.is_dir() and STEP_DIR.match(path.name) and (path / STATE_FILE).is_file()
    ]
    return sorted(found, key=lambda path: int(STEP_DIR.match(path.name).group(1)))


def resolve_checkpoint(path: str) -> Path:
    """Accept a checkpoint directory or its ``model.safetensors``; fail clearly otherwise."""
    candidate = Path(path).expanduser()
    if candidate.is_file() and candidate.name == MODEL_FILE:
        candidate = candidate.parent
    if not (candidate / MODEL_FILE).is_file():
        raise FileNotFoundError(
            f"checkpoint {path}: no {MODEL_FILE} found (expected a checkpoint directory "
            f"such as <run dir>/checkpoints/step_000300)"
        )
    return candidate


def load_model_weights(model_params, checkpoint_dir: Path) -> None:
    load_parameters(model_params, load_file(str(checkpoint_dir / MODEL_FILE)), str(checkpoint_dir / MODEL_FILE))


def load_optimizer_state(optimizer_params, checkpoint_dir: Path) -> None:
    load_parameters(
        optimizer_params, load_file(str(checkpoint_dir / OPTIMIZER_FILE)), str(checkpoint_dir / OPTIMIZER_FILE)
    )
