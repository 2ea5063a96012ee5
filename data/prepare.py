"""``prepare_data``: from the ``data.*`` config to a tokenizer and packed MindRecord shards, cached.

Cache layout (``data.cache_dir``, else ``$MINDMOE_CACHE``, else ``~/.cache/mindmoe``)::

    tokenizer/<key>/spm.model, files.json, meta.json
                            key: training files' content and reader, text_field, vocab_size
    data/<key>/train-*.mindrecord, valid-*.mindrecord, files.json, meta.json
                            key: files' content and reader, text_field, seq_len, weights,
                                 shard_windows, the tokenizer files' content
    data/ready/<name>.json  the key of the entry of the data.* settings and files named <name>,
                            for the processes that do not hash the files (:mod:`data.handoff`)

Keys hash file *contents*, so moving a file keeps its cache and editing it in
place does not reuse a stale one. They also hold the reader each file's suffix
selects (:func:`data.reader.reader_name`): the same bytes named ``.jsonl`` and
``.txt`` are different documents. How an entry is built once across processes
and checked on reuse: :mod:`data.cache_entry`. Temporary directories of dead
processes are removed first: :mod:`data.scratch`. Shards are written as the documents are
tokenised, a shard at a time: :mod:`data.text_shards`, :mod:`data.sft_shards`.
"""

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional

from mindmoe.data.cache_entry import build_once
from mindmoe.data.config import DataConfig, validate_data_config
from mindmoe.data.documents import iter_documents
from mindmoe.data.handoff import publish, visible_name, wait_for_entry
from mindmoe.data.reader import SourceStats, checked_file, reader_name
from mindmoe.data.scratch import remove_stale_scratch, scratch_prefix
from mindmoe.data.sft_shards import write_sft_shards
from mindmoe.data.text_shards import write_text_shards
from mindmoe.data.tokenizer import train_sentencepiece
from mindmoe.data.tokenizer_files import open_tokenizer, tokenizer_files

logger = logging.getLogger(__name__)

# Bump when the content or layout of a cache entry changes, so old entries are not reused.
# 2: entries carry files.json; keys hold each file's reader.
FORMAT_VERSION = 2
# The mixture belongs to the prepared data, not to a run: it must not change with train.seed.
MIXTURE_SEED = 1234


@dataclass(frozen=True)
class PreparedData:
    """Everything training needs from the data side."""

    tokenizer_path: str
    vocab_size: int
    train_shards: List[str]
    valid_shards: List[str]
    num_train_windows: int
    num_valid_windows: int
    #: Validation loss of a unigram model (nats per scored token); None without valid_files.
    unigram_val_loss: Optional[float]
    cache_key: str


def cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("MINDMOE_CACHE") or "~/.cache/mindmoe"
    return Path(root).expanduser().resolve()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _key(fields: Dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()[:20]


def _weights(cfg: DataConfig) -> Optional[List[float]]:
    """``data.weights`` as plain floats: Hydra passes an OmegaConf ListConfig, which JSON cannot encode."""
    return None if cfg.weights is None else [float(w) for w in cfg.weights]


def with_pretrained_tokenizer(cfg: DataConfig, pretrained: Optional[str]) -> DataConfig:
    """``cfg`` as a plain :class:`DataConfig`, with ``tokenizer`` set to the ``model.pretrained``
    directory when the user gave none: a pretrained model only understands its own token ids."""
    if not isinstance(cfg, DataConfig):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_object(cfg)
    if pretrained and not cfg.tokenizer:
        cfg = replace(cfg, tokenizer=str(pretrained))
    return cfg


def prepare_data(cfg: DataConfig, writer: bool = True) -> PreparedData:
    """Tokenizer and packed shards for ``cfg``, from the cache when it has them.

    ``writer``: this process builds the entry if it is missing (and hashes the files for its key).
    The other processes of a job pass False: they read no data file, and wait for the writer's
    entry (:mod:`data.handoff`), at most ``data.wait_timeout_s``.
    """
    validate_data_config(cfg)
    train = {f"data.train_files[{i}]": checked_file(p, f"data.train_files[{i}]") for i, p in enumerate(cfg.train_files)}
    valid = {f"data.valid_files[{i}]": checked_file(p, f"data.valid_files[{i}]") for i, p in enumerate(cfg.valid_files)}
    # The reader a file's suffix selects is part of what it holds (SFT files are all read as conversations).
    readers = {key: "sft" if cfg.format == "sft" else reader_name(path) for key, path in {**train, **valid}.items()}
    root = cache_root(cfg)
    name = _visible_name(cfg, train, valid, readers)
    if not writer:
        key, meta = wait_for_entry(root, name, cfg.wait_timeout_s)
        # The same bytes under another path share an entry: a given tokenizer is used where it is now.
        tokenizer_path = str(Path(cfg.tokenizer).expanduser().resolve()) if cfg.tokenizer else meta["tokenizer"]
        return _prepared(cfg, root / "data" / key, key, meta, tokenizer_path)
    file_ids = {key: [file_sha256(path), readers[key]] for key, path in {**train, **valid}.items()}
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch([root, root / "data", root / "tokenizer"])
    with tempfile.TemporaryDirectory(prefix=scratch_prefix(".read-"), dir=root) as work_dir:
        if cfg.tokenizer:
            open_tokenizer(cfg.tokenizer)  # fails here, naming data.tokenizer, if it cannot be loaded
            tokenizer_path = str(Path(cfg.tokenizer).expanduser().resolve())
        else:
            tokenizer_path = _cached_tokenizer(root, cfg, train, file_ids)
        fields = {
            "format": FORMAT_VERSION,
            "train": [file_ids[k] for k in train],
            "valid": [file_ids[k] for k in valid],
            "seq_len": cfg.seq_len,
            "shard_windows": cfg.shard_windows,
            "tokenizer": [file_sha256(path) for path in tokenizer_files(tokenizer_path)],
        }
        if cfg.format == "sft":
            fields.update(data_format="sft", overlong=cfg.sft_overlong)
            build = partial(_build_sft_shards, cfg=cfg, train=train, valid=valid, tokenizer_path=tokenizer_path)
        else:
            fields.update(mixture_seed=MIXTURE_SEED, text_field=cfg.text_field, weights=_weights(cfg))
            build = partial(
                _build_shards, cfg=cfg, train=train, valid=valid, tokenizer_path=tokenizer_path, work_dir=Path(work_dir)
            )
        key = _key(fields)
        entry = root / "data" / key
        meta = build_once(entry, build)
    publish(root, name, key)
    return _prepared(cfg, entry, key, meta, tokenizer_path)


def _visible_name(cfg: DataConfig, train: Dict[str, Path], valid: Dict[str, Path], readers: Dict[str, str]) -> str:
    """The preparation's name for the processes that read no file (:func:`data.handoff.visible_name`)."""
    files = {**train, **valid}
    fields = {
        "format": FORMAT_VERSION,
        "readers": [readers[k] for k in files],
        "train": list(train),
        "seq_len": cfg.seq_len,
        "shard_windows": cfg.shard_windows,
        "data_format": cfg.format,
        "overlong": cfg.sft_overlong,
        "mixture_seed": MIXTURE_SEED,
        "text_field": cfg.text_field,
        "weights": _weights(cfg),
        "vocab_size": cfg.vocab_size,
        "tokenizer": None,
    }
    if cfg.tokenizer:
        tokenizer = Path(cfg.tokenizer).expanduser().resolve()
        fields["tokenizer"] = str(tokenizer)
        files.update({f"tokenizer:{path.name}": path for path in tokenizer_files(tokenizer) if path.is_file()})
    return visible_name(fields, files)


def _prepared(cfg: DataConfig, entry: Path, key: str, meta: Dict, tokenizer_path: str) -> PreparedData:
    logger.info(
        "%s ready: %d train windows, %d valid windows, vocab %d%s",
        "SFT data" if cfg.format == "sft" else "data",
        meta["num_train_windows"],
        meta["num_valid_windows"],
        meta["vocab_size"],
        "" if cfg.format == "sft" else f", unigram val loss {meta['unigram_val_loss']}",
    )
    return PreparedData(
        tokenizer_path=tokenizer_path,
        vocab_size=meta["vocab_size"],
        train_shards=[str(entry / name) for name in meta["train_shards"]],
        valid_shards=[str(entry / name) for name in meta["valid_shards"]],
        num_train_windows=meta["num_train_windows"],
        num_valid_windows=meta["num_valid_windows"],
        unigram_val_loss=meta["unigram_val_loss"],
        cache_key=key,
    )


def _cached_tokenizer(root: Path, cfg: DataConfig, train: Dict[str, Path], file_ids: Dict[str, List[str]]) -> str:
    key = _key(
        {
            "format": FORMAT_VERSION,
            "train": [file_ids[k] for k in train],
            "text_field": cfg.text_field,
            "vocab_size": cfg.vocab_size,
        }
    )
    entry = root / "tokenizer" / key

    def build(staging: Path) -> Dict:
        unreadable = []

        def texts():
            # The trainer consumes this in C++ and reports what it raises as its own failure
            # ("vocab_size=...: INTERNAL: ..."): keep the reader's error to raise it as it is.
            try:
                for key, path in train.items():
                    yield from iter_documents(path, cfg.text_field, key, SourceStats(file=str(path)))
            except Exception as err:
                unreadable.append(err)
                raise

        try:
            train_sentencepiece(texts(), cfg.vocab_size, staging / "spm")
        except ValueError as err:
            if not unreadable:
                raise ValueError(f"data.{err}") from None
        if unreadable:
            raise unreadable[0]
        return {"format": FORMAT_VERSION, "vocab_size": cfg.vocab_size, "train_files": [str(p) for p in train.values()]}

    build_once(entry, build)
    return str(entry / "spm.model")


def _build_shards(
    staging: Path, cfg: DataConfig, train: Dict[str, Path], valid: Dict[str, Path], tokenizer_path: str, work_dir: Path
) -> Dict:
    tokenizer = open_tokenizer(tokenizer_path)
    shards = write_text_shards(staging, cfg, train, valid, tokenizer, work_dir, MIXTURE_SEED)
    return {
        "format": FORMAT_VERSION,
        "vocab_size": tokenizer.vocab_size,
        **shards,
        "valid_files": [str(p) for p in valid.values()],
        "tokenizer": tokenizer_path,
        "seq_len": cfg.seq_len,
        "weights": _weights(cfg),
        "text_field": cfg.text_field,
    }


def _build_sft_shards(
    staging: Path, cfg: DataConfig, train: Dict[str, Path], valid: Dict[str, Path], tokenizer_path: str
) -> Dict:
    """Conversations (``data.format=sft``) packed with their assistant-token loss mask."""
    tokenizer = open_tokenizer(tokenizer_path)
    shards = write_sft_shards(staging, cfg, train, valid, tokenizer)
    return {
        "format": FORMAT_VERSION,
        "vocab_size": tokenizer.vocab_size,
        **shards,
        "tokenizer": tokenizer_path,
        "seq_len": cfg.seq_len,
        "data_format": "sft",
    }
