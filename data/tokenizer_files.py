"""The files that make a tokenizer: open them as one tokenizer, list them for a cache key, copy them.

A tokenizer is a sentencepiece ``.model`` file (:mod:`data.tokenizer`) or the tokenizer files of a HF
checkpoint directory (:mod:`data.hf_tokenizer`). Training data, exports and ``mindmoe-generate`` all
open and copy tokenizers through this module, so every one of them accepts the same files.
"""

import shutil
from pathlib import Path
from typing import List, Optional, Union

from mindmoe.data.hf_tokenizer import (
    CHAT_TEMPLATE_FILE,
    SENTENCEPIECE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    HFTokenizer,
    load_hf_tokenizer,
)
from mindmoe.data.tokenizer import load_tokenizer

#: The files of a directory that decide its token ids and chat rendering (hashed into data cache keys);
#: ``config.json`` holds the fallback bos/eos/pad ids.
DEFINING_FILES = (TOKENIZER_JSON, SENTENCEPIECE_FILE, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE, "config.json")
#: The files of a HF tokenizer directory copied beside exported weights.
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    SENTENCEPIECE_FILE,
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)


def open_tokenizer(path: Union[str, Path], config_key: str = "data.tokenizer"):
    """A sentencepiece ``.model`` file, or a HF checkpoint directory's tokenizer; errors name ``config_key``."""
    if Path(path).expanduser().is_dir():
        return load_hf_tokenizer(path, config_key)
    return load_tokenizer(path, config_key)


def open_export_tokenizer(export_dir: Path):
    """The tokenizer an export copied beside its graphs (``tokenizer.json`` first, else ``tokenizer.model``)."""
    if (export_dir / TOKENIZER_JSON).is_file():
        return HFTokenizer(export_dir)
    if (export_dir / SENTENCEPIECE_FILE).is_file():
        return load_tokenizer(export_dir / SENTENCEPIECE_FILE, "export directory")
    raise FileNotFoundError(
        f"{export_dir}: no {TOKENIZER_JSON} or {SENTENCEPIECE_FILE} (export copies the tokenizer "
        "of its source beside the graphs)"
    )


def tokenizer_files(path: Union[str, Path]) -> List[Path]:
    """The files that define a tokenizer (what a cache key must hash): the ``.model`` file itself, or a
    directory's :data:`DEFINING_FILES` that exist."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return [path]
    return [path / name for name in DEFINING_FILES if (path / name).is_file()]


def copy_tokenizer(tokenizer: Optional[Path], out: Path) -> List[str]:
    """Copy a sentencepiece ``.model`` (as ``tokenizer.model``) or a HF directory's :data:`TOKENIZER_FILES`
    into ``out``; returns the names written (none for ``tokenizer`` None)."""
    if tokenizer is None:
        return []
    tokenizer = Path(tokenizer).expanduser()
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, out / SENTENCEPIECE_FILE)
        return [SENTENCEPIECE_FILE]
    copied = [name for name in TOKENIZER_FILES if (tokenizer / name).is_file()]
    if not copied:
        raise FileNotFoundError(f"tokenizer {tokenizer}: no tokenizer files ({', '.join(TOKENIZER_FILES[:5])})")
    for name in copied:
        shutil.copyfile(tokenizer / name, out / name)
    return copied


def special_token_ids(tokenizer) -> dict:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of an open tokenizer, those it has (id >= 0)."""
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    return {key: value for key, value in ids.items() if value is not None and value >= 0}
