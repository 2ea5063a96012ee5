"""The shards of ``data.format=text``, streamed: each training file is read, tokenised and packed
batch by batch, and its windows go straight into the shards, or, with ``data.weights``, into a
spill file in the work directory first: the mixture needs every source's window count before it
can draw its windows. The validation files are one stream, packed the same way.

The windows, their order and the draws of the mixture are those of packing every source in memory
(:func:`data.packing.pack_documents`, :func:`data.packing.mix_sources`), so the cache keys keep
their meaning. Memory: a shard of windows, a batch of documents, and the mixture's window indices
(8 bytes per window of a weighted source).
"""

import itertools
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from mindmoe.data.documents import Tokenising, iter_documents
from mindmoe.data.packing import PackedWindows, mixture_counts
from mindmoe.data.reader import DataInputError, SourceStats
from mindmoe.data.stream_pack import LabelCounts, ShardWriter, WindowPacker, chunks

logger = logging.getLogger(__name__)

#: Windows read back from a spill file at a time.
SPILL_CHUNK = 1024


class _Spill:
    """One source's windows in a raw int32 file ``[windows, 2, window]`` (ids, doc ids)."""

    def __init__(self, path: Path, window: int):
        self.path, self.window = path, window
        self._handle = open(path, "wb")

    def add(self, windows: Optional[PackedWindows]) -> None:
        if windows is not None:
            self._handle.write(np.stack([windows.input_ids, windows.doc_ids], axis=1).astype(np.int32).tobytes())

    def close(self) -> None:
        self._handle.close()

    def read(self, indices: np.ndarray, count: int) -> PackedWindows:
        # Mapped only for this read: a mapping kept open would count every page read in resident memory.
        rows = np.array(np.memmap(self.path, np.int32, "r", shape=(count, 2, self.window))[indices])
        return PackedWindows(np.ascontiguousarray(rows[:, 0]), np.ascontiguousarray(rows[:, 1]))


def _pack_file(key: str, path: Path, cfg, tokenising: Tokenising, packer: WindowPacker, sink) -> SourceStats:
    stats = SourceStats(file=str(path))
    for batch in tokenising.batches(iter_documents(path, cfg.text_field, key, stats)):
        sink(packer.add(batch.tokens, batch.doc_lengths))
    return stats


def _train_sources(cfg, train: Dict[str, Path], tokenising, sink_for) -> Tuple[List[dict], List[int]]:
    """Pack each training file into ``sink_for(index)``; per-file meta and window counts."""
    metas, available = [], []
    for index, (key, path) in enumerate(train.items()):
        packer = WindowPacker(cfg.seq_len)
        stats = _pack_file(key, path, cfg, tokenising, packer, sink_for(index))
        if packer.windows == 0:
            raise DataInputError(
                f"{key}: {path} has {packer.tokens} tokens, fewer than one window of "
                f"data.seq_len + 1 = {cfg.seq_len + 1}; merge it into another file"
            )
        metas.append({**asdict(stats), "tokens": packer.tokens, "windows": packer.windows})
        available.append(packer.windows)
    return metas, available


def _mixed(spills: List[_Spill], available: List[int], counts: List[int], seed: int, out) -> None:
    """:func:`data.packing.mix_sources` from the spill files, chunk by chunk into ``out``: the same
    draws (one ``choice`` per used source, in order) and the same window order."""
    rng = np.random.default_rng(seed)
    for spill, size, wanted in zip(spills, available, counts, strict=True):
        if wanted == 0:
            continue
        repeats, remainder = divmod(wanted, size)
        sample = np.sort(rng.choice(size, size=remainder, replace=False))
        passes = (np.arange(size) for _ in range(repeats))
        for part in chunks(itertools.chain(passes, [sample]), SPILL_CHUNK):
            if len(part):
                out(spill.read(part, size))


def write_text_shards(
    staging: Path, cfg, train: Dict[str, Path], valid: Dict[str, Path], tokenizer, work_dir: Path, seed: int
) -> Dict:
    """Train and valid shards of ``cfg`` in ``staging``; the meta.json fields they determine."""
    weights = None if cfg.weights is None else [float(w) for w in cfg.weights]
    train_out = ShardWriter(staging, "train", cfg.shard_windows)
    train_labels = LabelCounts(tokenizer.vocab_size)

    def to_train(windows):
        train_out.add(windows)
        train_labels.add(windows)

    with Tokenising(tokenizer, cfg.num_proc) as tokenising:
        if weights is None:  # every window of every source, in order: nothing to draw
            metas, available = _train_sources(cfg, train, tokenising, lambda index: to_train)
            counts = available
        else:
            spills = [_Spill(Path(work_dir) / f"source-{i}.windows", cfg.seq_len + 1) for i in range(len(train))]
            metas, available = _train_sources(cfg, train, tokenising, lambda index: spills[index].add)
            for spill in spills:
                spill.close()
            counts = mixture_counts(available, weights)
            _mixed(spills, available, counts, seed, to_train)
            for spill in spills:
                spill.path.unlink()
        valid_out, valid_labels = _valid_shards(staging, cfg, valid, tokenising, tokenizer.vocab_size)
    for meta, count in zip(metas, counts, strict=True):
        meta["windows_used"] = count
        logger.info(
            "%s: %d documents, %d tokens, %d windows, %d used in the mixture",
            meta["file"],
            meta["documents"],
            meta["tokens"],
            meta["windows"],
            count,
        )
    return {
        "train_shards": train_out.close(),
        "valid_shards": valid_out.close(),
        "num_train_windows": train_out.windows,
        "num_valid_windows": valid_out.windows,
        "unigram_val_loss": train_labels.unigram_loss(valid_labels) if valid else None,
        "sources": metas,
    }


def _valid_shards(staging: Path, cfg, valid: Dict[str, Path], tokenising, vocab_size: int):
    """All validation files as one stream: small files need no window of their own."""
    out, labels = ShardWriter(staging, "valid", cfg.shard_windows), LabelCounts(vocab_size)
    packer = WindowPacker(cfg.seq_len)

    def sink(windows):
        out.add(windows)
        labels.add(windows)

    for key, path in valid.items():
        _pack_file(key, path, cfg, tokenising, packer, sink)
    if valid and packer.windows == 0:
        raise DataInputError(
            f"data.valid_files: {packer.tokens} tokens in all, fewer than one window of "
            f"data.seq_len + 1 = {cfg.seq_len + 1}"
        )
    return out, labels
