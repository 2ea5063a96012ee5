"""``prepare_data``: from the ``data.*`` config to a tokenizer and packed MindRecord shards, cached.

Cache layout (``data.cache_dir``, else ``$MINDMOE_CACHE``, else ``~/.cache/mindmoe``)::

    tokenizer/<key>/spm.model, files.json, meta.json
                            key: training files' content and reader, text_field, vocab_size
    data/<key>/train-*.mindrecord, valid-*.mindrecord, files.json, meta.json
                            key: files' content and reader, text_field, seq_len, weights,
                                 shard_windows, the tokenizer files' content

Keys hash file *contents*, so moving a file keeps its cache and editing it in
place does not reuse a stale one. They also hold the reader each file's suffix
selects (:func:`data.reader.reader_name`): the same bytes named ``.jsonl`` and
``.txt`` are different documents. How an entry is built once across processes
and checked on reuse: :mod:`data.cache_entry`. Temporary directories of dead
processes are removed first: :mod:`data.scratch`.
"""

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from mindmoe.data.cache_entry import build_once
from mindmoe.data.config import DataConfig, validate_data_config
from mindmoe.data.mindrecord import write_shards
from mindmoe.data.packing import PackedWindows, mix_sources, mixture_counts, pack_documents, unigram_loss
from mindmoe.data.reader import (
    DataInputError,
    Source,
    checked_file,
    concatenate,
    read_source,
    reader_name,
    tokenize_documents,
)
from mindmoe.data.scratch import remove_stale_scratch, scratch_prefix
from mindmoe.data.sft import build_sft_windows
from mindmoe.data.tokenizer import Tokenizer, train_sentencepiece
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


class _Corpus:
    """Reads each configured file at most once per ``prepare_data`` call, on first use."""

    def __init__(self, cfg: DataConfig, work_dir: Path):
        self.cfg = cfg
        self.work_dir = work_dir
        self._sources: Dict[str, Source] = {}

    def source(self, key: str, path: str) -> Source:
        if key not in self._sources:
            self._sources[key] = read_source(path, self.cfg.text_field, key, self.work_dir)
        return self._sources[key]


def with_pretrained_tokenizer(cfg: DataConfig, pretrained: Optional[str]) -> DataConfig:
    """``cfg`` as a plain :class:`DataConfig`, with ``tokenizer`` set to the ``model.pretrained``
    directory when the user gave none: a pretrained model only understands its own token ids."""
    if not isinstance(cfg, DataConfig):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_object(cfg)
    if pretrained and not cfg.tokenizer:
        cfg = replace(cfg, tokenizer=str(pretrained))
    return cfg


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Tokenizer and packed shards for ``cfg``, from the cache when it has them."""
    validate_data_config(cfg)
    train = {f"data.train_files[{i}]": checked_file(p, f"data.train_files[{i}]") for i, p in enumerate(cfg.train_files)}
    valid = {f"data.valid_files[{i}]": checked_file(p, f"data.valid_files[{i}]") for i, p in enumerate(cfg.valid_files)}
    # What a file holds is its bytes and the reader its suffix selects (SFT files are all read as conversations).
    file_ids = {
        key: [file_sha256(path), "sft" if cfg.format == "sft" else reader_name(path)]
        for key, path in {**train, **valid}.items()
    }
    root = cache_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch([root, root / "data", root / "tokenizer"])
    with tempfile.TemporaryDirectory(prefix=scratch_prefix(".read-"), dir=root) as work_dir:
        corpus = _Corpus(cfg, Path(work_dir))
        if cfg.tokenizer:
            open_tokenizer(cfg.tokenizer)  # fails here, naming data.tokenizer, if it cannot be loaded
            tokenizer_path = str(Path(cfg.tokenizer).expanduser().resolve())
        else:
            tokenizer_path = _cached_tokenizer(root, cfg, train, file_ids, corpus)
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
                _build_shards, cfg=cfg, train=train, valid=valid, tokenizer_path=tokenizer_path, corpus=corpus
            )
        key = _key(fields)
        entry = root / "data" / key
        meta = build_once(entry, build)
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


def _cached_tokenizer(
    root: Path, cfg: DataConfig, train: Dict[str, Path], file_ids: Dict[str, List[str]], corpus: _Corpus
) -> str:
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
        sources = [corpus.source(k, str(p)) for k, p in train.items()]
        texts = (text for source in sources for text in source.dataset["text"])
        try:
            train_sentencepiece(texts, cfg.vocab_size, staging / "spm")
        except ValueError as err:
            raise ValueError(f"data.{err}") from None
        return {"format": FORMAT_VERSION, "vocab_size": cfg.vocab_size, "train_files": [str(p) for p in train.values()]}

    build_once(entry, build)
    return str(entry / "spm.model")


def _build_shards(
    staging: Path, cfg: DataConfig, train: Dict[str, Path], valid: Dict[str, Path], tokenizer_path: str, corpus: _Corpus
) -> Dict:
    tokenizer = open_tokenizer(tokenizer_path)
    sources, source_meta = [], []
    for key, path in train.items():
        dataset, stats = corpus.source(key, str(path))
        tokens = tokenize_documents(dataset, tokenizer, cfg.num_proc)
        windows = pack_documents(tokens.tokens, tokens.doc_lengths, cfg.seq_len)
        if len(windows) == 0:
            raise DataInputError(
                f"{key}: {path} has {len(tokens.tokens)} tokens, fewer than one window of "
                f"data.seq_len + 1 = {cfg.seq_len + 1}; merge it into another file"
            )
        sources.append(windows)
        source_meta.append({**asdict(stats), "tokens": int(len(tokens.tokens)), "windows": len(windows)})
    counts = mixture_counts([len(s) for s in sources], _weights(cfg))
    for meta, count in zip(source_meta, counts, strict=True):
        meta["windows_used"] = count
        logger.info(
            "%s: %d documents, %d tokens, %d windows, %d used in the mixture",
            meta["file"],
            meta["documents"],
            meta["tokens"],
            meta["windows"],
            count,
        )
    train_windows = mix_sources(sources, counts, MIXTURE_SEED)
    valid_windows = _valid_windows(cfg, valid, tokenizer, corpus)
    val_loss = unigram_loss(train_windows, valid_windows, tokenizer.vocab_size) if valid else None
    return {
        "format": FORMAT_VERSION,
        "vocab_size": tokenizer.vocab_size,
        "train_shards": write_shards(train_windows, staging, "train", cfg.shard_windows),
        "valid_shards": write_shards(valid_windows, staging, "valid", cfg.shard_windows),
        "num_train_windows": len(train_windows),
        "num_valid_windows": len(valid_windows),
        "unigram_val_loss": val_loss,
        "sources": source_meta,
        "valid_files": [str(p) for p in valid.values()],
        "tokenizer": tokenizer_path,
        "seq_len": cfg.seq_len,
        "weights": _weights(cfg),
        "text_field": cfg.text_field,
    }


def _valid_windows(cfg: DataConfig, valid: Dict[str, Path], tokenizer: Tokenizer, corpus: _Corpus) -> PackedWindows:
    """All validation files as one stream: small files need no window of their own."""
    window = cfg.seq_len + 1
    if not valid:
        return PackedWindows(np.zeros((0, window), np.int32), np.zeros((0, window), np.int32))
    streams = [
        tokenize_documents(corpus.source(key, str(path)).dataset, tokenizer, cfg.num_proc)
        for key, path in valid.items()
    ]
    stream = concatenate(streams)
    windows = pack_documents(stream.tokens, stream.doc_lengths, cfg.seq_len)
    if len(windows) == 0:
        raise DataInputError(
            f"data.valid_files: {len(stream.tokens)} tokens in all, fewer than one window of "
            f"data.seq_len + 1 = {window}"
        )
    return windows


def _build_sft_shards(
    staging: Path, cfg: DataConfig, train: Dict[str, Path], valid: Dict[str, Path], tokenizer_path: str
) -> Dict:
    """Conversations (``data.format=sft``) packed with their assistant-token loss mask."""
    tokenizer = open_tokenizer(tokenizer_path)
    train_windows, train_stats = build_sft_windows(train, tokenizer, cfg.seq_len, cfg.sft_overlong)
    valid_windows, valid_stats = (
        build_sft_windows(valid, tokenizer, cfg.seq_len, cfg.sft_overlong) if valid else (None, [])
    )
    return {
        "format": FORMAT_VERSION,
        "vocab_size": tokenizer.vocab_size,
        "train_shards": write_shards(train_windows, staging, "train", cfg.shard_windows),
        "valid_shards": write_shards(valid_windows, staging, "valid", cfg.shard_windows) if valid else [],
        "num_train_windows": len(train_windows),
        "num_valid_windows": len(valid_windows) if valid else 0,
        "unigram_val_loss": unigram_loss(train_windows, valid_windows, tokenizer.vocab_size) if valid else None,
        "sources": train_stats,
        "valid_sources": valid_stats,
        "tokenizer": tokenizer_path,
        "seq_len": cfg.seq_len,
        "data_format": "sft",
    }
