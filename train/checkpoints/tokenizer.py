"""The tokenizer of a checkpoint, for everything that uses one: export, eval, resume and ``lora.base_checkpoint``.

A checkpoint carries its tokenizer (``state.json`` ``tokenizer`` names the files, relative to the
checkpoint directory; :mod:`train.checkpoints.checkpoint`), and only those files are read for it, so a checkpoint
copied to another machine works without the cache it was trained from, and an export never copies a
file from outside the checkpoint.

Checkpoints written before checkpoints carried their tokenizer record a path into the user's cache
instead. That path is never read. Export and eval refuse such a checkpoint with a message saying to pass
``data.tokenizer`` (the tokenizer the user names is then used); resume and ``lora.base_checkpoint``
prepare the data from the config's tokenizer, as they did before.
"""

from dataclasses import replace
from pathlib import Path
from typing import Optional

from mindmoe.data.config import DataConfig
from mindmoe.data.prepare import file_sha256, with_pretrained_tokenizer
from mindmoe.data.tokenizer_files import stored_tokenizer, tokenizer_files
from mindmoe.model.checkpoints.files import (
    STATE_FILE,
    TOKENIZER_KEY,
    RecordedTokenizerPath,
    checkpoint_tokenizer_names,
)
from mindmoe.train.checkpoints.checkpoint import resolve_checkpoint


def carried_tokenizer(checkpoint_dir: Path) -> Optional[Path]:
    """What :func:`data.tokenizer_files.open_tokenizer` opens for the tokenizer ``checkpoint_dir`` carries,
    None when ``state.json`` names none; :class:`RecordedTokenizerPath` for an older checkpoint's path."""
    names = checkpoint_tokenizer_names(checkpoint_dir)
    if names is None:
        return None
    return stored_tokenizer(checkpoint_dir, names, f"{Path(checkpoint_dir) / STATE_FILE} {TOKENIZER_KEY!r}")


def checkpoint_tokenizer(checkpoint_dir: Path, data_tokenizer: str = "") -> Optional[Path]:
    """The tokenizer to export or evaluate ``checkpoint_dir`` with: the one it carries; ``data.tokenizer``
    (``data_tokenizer``) only for a checkpoint that carries none."""
    try:
        carried = carried_tokenizer(checkpoint_dir)
    except RecordedTokenizerPath:
        if data_tokenizer:
            return Path(data_tokenizer).expanduser()
        raise
    if carried is None:
        return Path(data_tokenizer).expanduser() if data_tokenizer else None
    if data_tokenizer:
        raise ValueError(
            f"data.tokenizer={data_tokenizer}: checkpoint {checkpoint_dir} carries its own tokenizer "
            f"({carried}); drop data.tokenizer (it is for checkpoints that carry none)"
        )
    return carried


def _digests(tokenizer) -> list:
    return [file_sha256(path) for path in tokenizer_files(tokenizer)]


def run_data_config(cfg, resume_from: Optional[Path]) -> DataConfig:
    """``cfg.data`` as the run prepares it: with the tokenizer carried by the checkpoint resumed from, else by
    ``lora.base_checkpoint``, else ``data.tokenizer`` or ``model.pretrained``'s (the data's own when none)."""
    data_cfg = with_pretrained_tokenizer(cfg.data, cfg.model.pretrained)
    if resume_from is not None:
        key, directory = f"train.resume (checkpoint {resume_from})", Path(resume_from)
    elif cfg.lora.enabled and cfg.lora.base_checkpoint:
        key = f"lora.base_checkpoint={cfg.lora.base_checkpoint}"
        directory = resolve_checkpoint(cfg.lora.base_checkpoint)
    else:
        return data_cfg
    try:
        carried = carried_tokenizer(directory)
    except RecordedTokenizerPath:
        return data_cfg  # an older checkpoint: the config's tokenizer, as before
    if carried is None:
        return data_cfg
    if data_cfg.tokenizer and _digests(data_cfg.tokenizer) != _digests(carried):
        source = "data.tokenizer" if cfg.data.tokenizer else "model.pretrained"
        raise ValueError(
            f"{source}={data_cfg.tokenizer}: its tokenizer files differ from those {key} carries ({carried}); "
            "a run continues with the tokenizer its checkpoint was trained with: point data.tokenizer at it "
            "or leave data.tokenizer unset"
        )
    return replace(data_cfg, tokenizer=str(carried))
