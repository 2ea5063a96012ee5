"""Packing and writing as the tokens arrive: windows cut from a running stream, shards written as
they fill, label counts kept for the unigram baseline. Memory is a shard of windows, not the corpus.

:class:`WindowPacker` cuts exactly the windows :func:`data.packing.pack_documents` cuts from the
whole stream at once; :class:`LabelCounts` gives the :func:`data.packing.unigram_loss` of the
windows it was shown.
"""

from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np

from mindmoe.data.mindrecord import shard_name, write_shard
from mindmoe.data.packing import PackedWindows, label_mask


def concat_windows(parts: List[PackedWindows]) -> PackedWindows:
    masks = [p.loss_mask for p in parts]
    return PackedWindows(
        np.concatenate([p.input_ids for p in parts]),
        np.concatenate([p.doc_ids for p in parts]),
        None if masks[0] is None else np.concatenate(masks),
    )


class WindowPacker:
    """Windows of ``seq_len + 1`` tokens cut with stride ``seq_len + 1`` from the documents fed to
    :meth:`add`, in order; the tail shorter than a window is dropped (never returned)."""

    def __init__(self, seq_len: int):
        self.window = seq_len + 1
        self.tokens = 0  # fed so far, tail included
        self.windows = 0
        self._documents = 0
        self._tail_ids = np.zeros(0, np.int32)
        self._tail_docs = np.zeros(0, np.int64)

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> Optional[PackedWindows]:
        """Whole documents ``tokens`` (of ``doc_lengths``); the windows they complete, or None."""
        docs = np.repeat(np.arange(self._documents, self._documents + len(doc_lengths), dtype=np.int64), doc_lengths)
        self._documents += len(doc_lengths)
        self.tokens += len(tokens)
        ids = np.concatenate([self._tail_ids, tokens.astype(np.int32, copy=False)])
        docs = np.concatenate([self._tail_docs, docs])
        count = len(ids) // self.window
        used = count * self.window
        self._tail_ids, self._tail_docs = ids[used:].copy(), docs[used:].copy()
        if count == 0:
            return None
        self.windows += count
        doc_in_stream = docs[:used].reshape(count, self.window)
        return PackedWindows(
            ids[:used].reshape(count, self.window), (doc_in_stream - doc_in_stream[:, :1]).astype(np.int32)
        )


class ShardWriter:
    """Windows into ``<prefix>-NNNNN.mindrecord`` files of ``shard_windows`` windows (the last may
    hold fewer), each written as soon as it is full: what :func:`data.mindrecord.write_shards` writes
    for all of them at once."""

    def __init__(self, out_dir: Path, prefix: str, shard_windows: int):
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.shard_windows = shard_windows
        self.names: List[str] = []
        self.windows = 0
        self._pending: List[PackedWindows] = []
        self._pending_count = 0

    def add(self, windows: Optional[PackedWindows]) -> None:
        if windows is None or len(windows) == 0:
            return
        self.windows += len(windows)
        self._pending.append(windows)
        self._pending_count += len(windows)
        while self._pending_count >= self.shard_windows:
            rows = concat_windows(self._pending)
            self._write(rows.take(np.arange(self.shard_windows)))
            rest = rows.take(np.arange(self.shard_windows, len(rows)))
            self._pending, self._pending_count = ([rest] if len(rest) else []), len(rest)

    def close(self) -> List[str]:
        """Writes the last, partial shard; the file names, relative to ``out_dir``."""
        if self._pending_count:
            self._write(concat_windows(self._pending))
            self._pending, self._pending_count = [], 0
        return self.names

    def _write(self, windows: PackedWindows) -> None:
        self.names.append(shard_name(self.prefix, len(self.names)))
        write_shard(windows, self.out_dir / self.names[-1])


class LabelCounts:
    """How often each token id is a scored label (:func:`data.packing.label_mask`) in the windows shown."""

    def __init__(self, vocab_size: int):
        self.counts = np.zeros(vocab_size, np.int64)

    def add(self, windows: Optional[PackedWindows]) -> None:
        if windows is not None and len(windows):
            labels = windows.input_ids[:, 1:][label_mask(windows)]
            self.counts += np.bincount(labels, minlength=len(self.counts))

    def unigram_loss(self, valid: "LabelCounts") -> float:
        """:func:`data.packing.unigram_loss`, from the counts of the training and validation labels."""
        log_probs = np.log(self.counts + 1.0) - np.log(self.counts.sum() + len(self.counts))
        return float(-(valid.counts @ log_probs) / valid.counts.sum())


def chunks(indices: Iterator[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The index arrays of ``indices`` cut into pieces of at most ``size``."""
    for part in indices:
        for start in range(0, len(part), size):
            yield part[start : start + size]
