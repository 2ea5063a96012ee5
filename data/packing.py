"""Packing tokenised documents into fixed windows, and the masks the trainer derives from them.

A window holds ``seq_len + 1`` tokens: the model reads ``window[:-1]`` and
predicts ``window[1:]``. Windows are cut from the concatenated documents of
one source with stride ``seq_len + 1`` (no overlap, the tail is dropped), so
no token is trained on twice per pass and no padding is ever needed.

Each window carries ``doc_ids``: which document of the window each token
belongs to, numbered from 0 at the window's first token (a document continued
from the previous window is document 0 here). Tokens attend only to earlier
tokens of their own document, and a label counts only when it belongs to the
same document as its input token, so packing is invisible to the model.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np


@dataclass
class PackedWindows:
    input_ids: np.ndarray  # int32 [windows, seq_len + 1]
    doc_ids: np.ndarray  # int32 [windows, seq_len + 1]
    #: int32 [windows, seq_len + 1], 1 = this token may be scored as a label (SFT: assistant tokens);
    #: None = every token may (pretraining).
    loss_mask: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def take(self, indices: np.ndarray) -> "PackedWindows":
        return PackedWindows(
            self.input_ids[indices], self.doc_ids[indices], None if self.loss_mask is None else self.loss_mask[indices]
        )


def pack_documents(tokens: np.ndarray, doc_lengths: np.ndarray, seq_len: int) -> PackedWindows:
    """Cut the document stream ``tokens`` (documents of ``doc_lengths``) into windows."""
    window = seq_len + 1
    num_windows = len(tokens) // window
    used = num_windows * window
    stream_doc = np.repeat(np.arange(len(doc_lengths), dtype=np.int64), doc_lengths)[:used]
    doc_in_stream = stream_doc.reshape(num_windows, window)
    return PackedWindows(
        input_ids=tokens[:used].reshape(num_windows, window).astype(np.int32),
        doc_ids=(doc_in_stream - doc_in_stream[:, :1]).astype(np.int32),
    )


def mixture_counts(available: Sequence[int], weights: Optional[Sequence[float]]) -> List[int]:
    """Windows to take from each source.

    Without weights every source contributes all its windows (a mixture
    proportional to size). With weights the total stays the same (one pass over
    the mixture costs as much as one pass over the data) and is split in
    proportion to the weights, rounding by largest remainder so the counts sum
    exactly to the total.
    """
    if weights is None:
        return list(available)
    total = sum(available)
    shares = np.asarray(weights, dtype=np.float64) / np.sum(weights) * total
    counts = np.floor(shares).astype(np.int64)
    by_remainder = np.argsort(-(shares - counts), kind="stable")
    counts[by_remainder[: total - counts.sum()]] += 1
    return counts.tolist()


def select_windows(available: int, wanted: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``wanted`` windows out of ``available``.

    A source asked for more windows than it has is repeated whole as often as
    it fits; the remainder (or a smaller request) is a sample without
    replacement. That repeats every window as evenly as possible, unlike
    sampling with replacement. Sorted, so shards keep the source order.
    """
    repeats, remainder = divmod(wanted, available)
    sample = np.sort(rng.choice(available, size=remainder, replace=False))
    return np.concatenate([np.tile(np.arange(available), repeats), sample]).astype(np.int64)


def mix_sources(sources: Sequence[PackedWindows], counts: Sequence[int], seed: int) -> PackedWindows:
    """The training windows: ``counts[i]`` windows of ``sources[i]``, sources in order."""
    rng = np.random.default_rng(seed)
    parts = [
        source.take(select_windows(len(source), count, rng))
        for source, count in zip(sources, counts, strict=True)
        if count > 0
    ]
    return PackedWindows(
        input_ids=np.concatenate([p.input_ids for p in parts]), doc_ids=np.concatenate([p.doc_ids for p in parts])
    )


def loss_mask_from_doc_ids(doc_ids: np.ndarray) -> np.ndarray:
    """bool ``[..., seq_len]``: label ``window[t+1]`` is scored only if it is in the
    same document as input ``window[t]`` (never predict the next document's start)."""
    return doc_ids[..., 1:] == doc_ids[..., :-1]


def label_mask(windows: PackedWindows) -> np.ndarray:
    """bool ``[..., seq_len]``: the labels the trainer scores. Label ``t+1`` counts when it is in the
    document of input ``t`` and, for SFT windows (with ``loss_mask``), is an assistant token."""
    scored = loss_mask_from_doc_ids(windows.doc_ids)
    if windows.loss_mask is not None:
        scored = scored & (windows.loss_mask[..., 1:] > 0)
    return scored


def attention_allowed(doc_ids: np.ndarray) -> np.ndarray:
    """bool ``[..., S, S]`` from the inputs' doc ids ``[..., S]`` (``window_doc_ids[..., :-1]``):
    query i may attend key j iff j <= i and both are in the same document.
    The NumPy reference for the model's attention mask."""
    length = doc_ids.shape[-1]
    causal = np.tril(np.ones((length, length), dtype=bool))
    return causal & (doc_ids[..., :, None] == doc_ids[..., None, :])


def unigram_loss(train: PackedWindows, valid: PackedWindows, vocab_size: int) -> float:
    """Cross-entropy (nats per scored token) of a unigram model on the validation labels.

    The model is estimated from the scored labels of the training windows with
    add-one smoothing over the vocabulary, and evaluated on exactly the label
    positions the trainer scores. A language model that does not beat this
    number has learnt nothing beyond token frequencies.
    """
    train_labels = train.input_ids[:, 1:][label_mask(train)]
    counts = np.bincount(train_labels, minlength=vocab_size).astype(np.float64)
    log_probs = np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)
    valid_labels = valid.input_ids[:, 1:][label_mask(valid)]
    return float(-log_probs[valid_labels].mean())
