"""Documents of one file as a stream, tokenised in batches: what the tokenizer trainer and the shard writers read.

The documents of a file (read and checked by :mod:`data.reader`) in file order, one batch at a
time, so preparing a corpus never holds more than a batch of its text or tokens. No Arrow file is
memory-mapped either (its pages would count in the process's resident memory and grow with the
corpus). ``num_proc > 1`` tokenises batches in worker processes, a bounded number of batches in
flight, results in order.
"""

import logging
import multiprocessing
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

import numpy as np
import pyarrow.parquet as pq

from mindmoe.data.reader import SourceStats, no_text_error, parquet_text_column, text_documents

logger = logging.getLogger(__name__)

#: Documents tokenised together: one call of the tokenizer, and the unit handed to a worker process.
BATCH_DOCUMENTS = 1000
#: Batches queued per tokenising process: keeps the workers busy without reading ahead of them.
IN_FLIGHT_PER_PROCESS = 2


@dataclass
class TokenBatch:
    """Consecutive documents, each ``[bos] + ids + [eos]``, concatenated."""

    tokens: np.ndarray  # int32 [batch tokens]
    doc_lengths: np.ndarray  # int64 [batch documents]


def iter_documents(path: Path, text_field: str, config_key: str, stats: SourceStats) -> Iterator[str]:
    """The non-empty documents of the checked file ``path`` in file order; ``stats`` counts them
    (and the skipped empty ones) as they pass. A file with no text is an error once it is read."""
    if path.suffix.lower() == ".parquet":
        texts = _parquet_texts(path, text_field, config_key, stats)
    else:
        texts = text_documents(path, text_field, config_key, stats)
    for text in texts:
        stats.documents += 1
        yield text
    if stats.documents == 0:
        raise no_text_error(config_key, path, stats)
    if stats.skipped_empty:
        logger.warning("%s: skipped %d empty documents in %s", config_key, stats.skipped_empty, path)
    logger.info("%s: %d documents from %s", config_key, stats.documents, path)


def _parquet_texts(path: Path, text_field: str, config_key: str, stats: SourceStats) -> Iterator[str]:
    parquet_text_column(path, text_field, config_key)
    for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_DOCUMENTS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text and text.strip():
                yield text
            else:
                stats.skipped_empty += 1


def encode_texts(texts: List[str], tokenizer) -> TokenBatch:
    """One batch: every text encoded, wrapped in the tokenizer's BOS/EOS (GLM-4.5's has neither: -1)."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id >= 0 else []
    docs = [bos + ids + eos for ids in tokenizer.encode_batch(texts)]
    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    tokens = np.fromiter((t for d in docs for t in d), np.int32, int(lengths.sum()))
    return TokenBatch(tokens, lengths)


def _batches(texts: Iterable[str]) -> Iterator[List[str]]:
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == BATCH_DOCUMENTS:
            yield batch
            batch = []
    if batch:
        yield batch


_worker_tokenizer = None


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_in_worker(texts: List[str]) -> TokenBatch:
    return encode_texts(texts, _worker_tokenizer)


class Tokenising:
    """Tokenises text streams, in this process or in ``num_proc`` worker processes (one pool for
    every file of a preparation). Use as a context manager."""

    def __init__(self, tokenizer, num_proc: int):
        self.tokenizer = tokenizer
        self.num_proc = num_proc
        self._pool: Optional[multiprocessing.pool.Pool] = None

    def __enter__(self) -> "Tokenising":
        if self.num_proc > 1:
            # fork: workers need no import of the caller's main module, and get the
            # tokenizer without pickling. Workers only run the tokenizer, no framework code.
            context = multiprocessing.get_context("fork")
            self._pool = context.Pool(self.num_proc, initializer=_init_worker, initargs=(self.tokenizer,))
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()

    def batches(self, texts: Iterable[str]) -> Iterator[TokenBatch]:
        """``texts`` tokenised, batch by batch, in order."""
        if self._pool is None:
            for batch in _batches(texts):
                yield encode_texts(batch, self.tokenizer)
            return
        pending = deque()
        for batch in _batches(texts):
            pending.append(self._pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= IN_FLIGHT_PER_PROCESS * self.num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
