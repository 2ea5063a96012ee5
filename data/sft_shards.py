"""The shards of ``data.format=sft``, streamed: conversations are read, encoded and packed one by one
(:class:`data.sft.ConversationPacker`), files in order, each file's windows its own; windows go to
the shards as they close. Memory: a shard of windows and one conversation.
"""

import logging
from pathlib import Path
from typing import Dict, List, Tuple

from mindmoe.data.reader import DataInputError
from mindmoe.data.sft import ConversationPacker, encode_conversation, iter_conversations, rows_to_windows
from mindmoe.data.stream_pack import LabelCounts, ShardWriter

logger = logging.getLogger(__name__)

#: Windows collected before they are handed to the shard writer.
ROWS_PER_CHUNK = 256


def _pack_file(key: str, path: Path, tokenizer, cfg, pad_id: int, out) -> dict:
    packer = ConversationPacker(cfg.seq_len, pad_id, cfg.sft_overlong, f"{key}: {path}")
    rows, scored = [], 0

    def emit(row, final=False):
        nonlocal rows, scored
        if row is not None:
            rows.append(row)
        if rows and (final or len(rows) >= ROWS_PER_CHUNK):
            windows = rows_to_windows(rows)
            scored += out(windows)
            rows = []

    for number, messages in enumerate(iter_conversations(path, key)):
        try:
            ids, mask = encode_conversation(messages, tokenizer)
        except DataInputError as err:
            raise DataInputError(f"{key}: {path} conversation {number + 1}: {err}") from None
        emit(packer.add(number, ids, mask))
    emit(packer.finish(), final=True)
    if packer.windows == 0:
        raise DataInputError(f"{key}: {path}: no conversation left to train on")
    logger.info(
        "%s: %d conversations in %d windows, %d assistant tokens scored", path, packer.used, packer.windows, scored
    )
    return {
        "file": str(path),
        "conversations": packer.used,
        "truncated": packer.truncated,
        "dropped": packer.dropped,
        "windows": packer.windows,
        "scored_tokens": scored,
    }


def _write_split(staging: Path, prefix: str, files: Dict[str, Path], tokenizer, cfg) -> Tuple:
    pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else max(tokenizer.eos_id, 0)
    out, labels = ShardWriter(staging, prefix, cfg.shard_windows), LabelCounts(tokenizer.vocab_size)

    def sink(windows) -> int:
        out.add(windows)
        before = labels.counts.sum()
        labels.add(windows)
        return int(labels.counts.sum() - before)

    stats: List[dict] = [_pack_file(key, path, tokenizer, cfg, pad_id, sink) for key, path in files.items()]
    return out, labels, stats


def write_sft_shards(staging: Path, cfg, train: Dict[str, Path], valid: Dict[str, Path], tokenizer) -> Dict:
    """Train and valid shards of conversations in ``staging``; the meta.json fields they determine."""
    train_out, train_labels, train_stats = _write_split(staging, "train", train, tokenizer, cfg)
    if valid:
        valid_out, valid_labels, valid_stats = _write_split(staging, "valid", valid, tokenizer, cfg)
    return {
        "train_shards": train_out.close(),
        "valid_shards": valid_out.close() if valid else [],
        "num_train_windows": train_out.windows,
        "num_valid_windows": valid_out.windows if valid else 0,
        "unigram_val_loss": train_labels.unigram_loss(valid_labels) if valid else None,
        "sources": train_stats,
        "valid_sources": valid_stats if valid else [],
    }
