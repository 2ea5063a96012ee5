"""The files that make a tokenizer: open them as one tokenizer, list them for a cache key, copy them.

A tokenizer is a sentencepiece ``.model`` file (:mod:`data.tokenizer`) or the tokenizer files of a HF
checkpoint directory (:mod:`data.hf_tokenizer`). Training data, checkpoints, exports and ``mindmoe-generate``
all open and copy tokenizers through this module, so every one of them accepts the same files.
"""

import shutil
from pathlib import Path, PurePosixPath
from typing import Dict, List, Optional, Sequence, Union

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


#: Where a checkpoint keeps the files of a HF tokenizer directory (a sentencepiece tokenizer is one file,
#: ``tokenizer.model``, at its top); ``config.json`` comes along for the fallback bos/eos/pad ids.
CHECKPOINT_TOKENIZER_DIR = "tokenizer"


def read_tokenizer(tokenizer: Union[str, Path]) -> Dict[str, bytes]:
    """The contents of a tokenizer as a checkpoint stores it: relative name -> bytes (read once, so a run
    whose tokenizer lives in a checkpoint that ``train.keep_last`` prunes still writes it into the next)."""
    tokenizer = Path(tokenizer).expanduser()
    if tokenizer.is_file():
        return {SENTENCEPIECE_FILE: tokenizer.read_bytes()}
    names = [name for name in TOKENIZER_FILES + ("config.json",) if (tokenizer / name).is_file()]
    if not names:
        raise FileNotFoundError(f"tokenizer {tokenizer}: no tokenizer files ({', '.join(TOKENIZER_FILES[:5])})")
    return {f"{CHECKPOINT_TOKENIZER_DIR}/{name}": (tokenizer / name).read_bytes() for name in names}


def stored_tokenizer(directory: Path, names: Sequence[str], source: str) -> Path:
    """What :func:`open_tokenizer` opens for the tokenizer files ``names`` (relative, already checked) stored in
    ``directory``: the one sentencepiece file at its top, or the one directory holding HF tokenizer files."""
    parents = {PurePosixPath(name).parent for name in names}
    if len(names) == 1 and parents == {PurePosixPath(".")} and names[0].endswith(".model"):
        return Path(directory) / names[0]
    if len(parents) == 1 and PurePosixPath(".") not in parents:
        return Path(directory) / str(parents.pop())
    raise ValueError(
        f"{source}: {list(names)} is neither one sentencepiece .model file nor the files of one tokenizer "
        f"directory (e.g. ['{SENTENCEPIECE_FILE}'] or ['{CHECKPOINT_TOKENIZER_DIR}/{TOKENIZER_JSON}', ...])"
    )


def special_token_ids(tokenizer) -> dict:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of an open tokenizer, those it has (id >= 0)."""
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    return {key: value for key, value in ids.items() if value is not None and value >= 0}
