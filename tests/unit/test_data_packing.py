"""Specification of the data pipeline's packing (windows, document masks, mixtures, the unigram loss) and its
MindRecord shards and loaders (round trip, rank split, resume, evaluation).

Expected values come from independent computations (brute-force loops over
document lengths, hand-computed losses, the single-process batch order), never
from the code under test.
"""

import math
from collections import Counter

import numpy as np
import pytest

from mindmoe.data.mindrecord import EvalLoader, WindowLoader, write_shards
from mindmoe.data.packing import (
    PackedWindows,
    attention_allowed,
    loss_mask_from_doc_ids,
    mix_sources,
    mixture_counts,
    pack_documents,
    unigram_loss,
)


# ---------------------------------------------------------------- packing
def _random_documents(seed, count=40, max_len=30):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, size=count)
    return rng.integers(4, 1000, size=int(lengths.sum())).astype(np.int32), lengths


def test_windows_are_consecutive_slices_of_seq_len_plus_one_tokens():
    tokens, lengths = _random_documents(0)
    windows = pack_documents(tokens, lengths, seq_len=16)
    assert windows.input_ids.shape == windows.doc_ids.shape == (len(tokens) // 17, 17)
    assert windows.input_ids.dtype == windows.doc_ids.dtype == np.int32
    np.testing.assert_array_equal(windows.input_ids.reshape(-1), tokens[: windows.input_ids.size])


def test_attention_mask_never_crosses_a_document_boundary():
    tokens, lengths = _random_documents(1)
    seq_len = 12
    windows = pack_documents(tokens, lengths, seq_len)
    document_of_position = [doc for doc, length in enumerate(lengths) for _ in range(length)]
    for w in range(len(windows)):
        start = w * (seq_len + 1)
        expected = np.zeros((seq_len, seq_len), dtype=bool)
        for i in range(seq_len):
            for j in range(seq_len):
                expected[i, j] = j <= i and document_of_position[start + i] == document_of_position[start + j]
        np.testing.assert_array_equal(attention_allowed(windows.doc_ids[w, :-1]), expected)
        assert windows.doc_ids[w, 0] == 0


def test_loss_mask_never_predicts_across_a_document_boundary():
    doc_ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2]], dtype=np.int32)
    np.testing.assert_array_equal(loss_mask_from_doc_ids(doc_ids), [[True, True, False, True, False, True, True]])


def test_mixture_counts_are_proportional_to_weights_and_keep_the_total():
    assert mixture_counts([100, 10, 50], None) == [100, 10, 50]
    assert mixture_counts([100, 10, 50], [1, 2, 1]) == [40, 80, 40]
    assert mixture_counts([7, 0, 3], [1, 0, 1]) == [5, 0, 5]
    counts = mixture_counts([333, 333, 334], [0.5, 0.3, 0.2])
    assert sum(counts) == 1000 and counts == [500, 300, 200]


def test_small_source_is_repeated_evenly_and_mixing_is_deterministic():
    def source(tag, count):
        ids = np.repeat(tag * 1000 + np.arange(count, dtype=np.int32)[:, None], 5, axis=1)
        return PackedWindows(ids, np.zeros((count, 5), np.int32))

    sources = [source(1, 100), source(2, 10)]
    counts = mixture_counts([100, 10], [1, 3])
    assert counts == [28, 82]
    mixed = mix_sources(sources, counts, seed=3)
    uses = Counter(mixed.input_ids[:, 0].tolist())
    assert sum(n for w, n in uses.items() if w < 2000) == 28 and max(n for w, n in uses.items() if w < 2000) == 1
    assert sorted(n for w, n in uses.items() if w >= 2000) == [8] * 8 + [9] * 2
    np.testing.assert_array_equal(mix_sources(sources, counts, seed=3).input_ids, mixed.input_ids)


def test_unigram_loss_matches_a_hand_computation():
    train = PackedWindows(np.array([[2, 1, 1, 3]]), np.array([[0, 0, 0, 0]]))
    valid = PackedWindows(np.array([[2, 1, 0, 3, 2, 1]]), np.array([[0, 0, 0, 0, 1, 1]]))
    # Train labels 1, 1, 3 -> add-one probabilities over 4 tokens: (1, 3, 1, 2) / 7.
    # Scored valid labels: 1, 0, 3 (3 -> 2 crosses a document), 1.
    expected = -(math.log(3 / 7) + math.log(1 / 7) + math.log(2 / 7) + math.log(3 / 7)) / 4
    assert unigram_loss(train, valid, vocab_size=4) == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- MindRecord
def _numbered_windows(count, window=9):
    """Window i holds the value i everywhere, so a batch says which windows it holds."""
    ids = np.repeat(np.arange(count, dtype=np.int32)[:, None], window, axis=1)
    doc_ids = (np.arange(window)[None, :] // 4 + np.arange(count)[:, None] % 2).astype(np.int32)
    return PackedWindows(ids, doc_ids - doc_ids[:, :1])


@pytest.fixture
def numbered_shards(tmp_path):
    windows = _numbered_windows(70)
    names = write_shards(windows, tmp_path, "train", shard_windows=16)
    return windows, [str(tmp_path / name) for name in names]


def test_mindrecord_round_trip_is_exact(numbered_shards):
    windows, files = numbered_shards
    assert len(files) == 5
    batches = list(EvalLoader(files, batch_size=7))
    np.testing.assert_array_equal(np.concatenate([b["input_ids"] for b in batches]), windows.input_ids)
    np.testing.assert_array_equal(np.concatenate([b["doc_ids"] for b in batches]), windows.doc_ids)
    assert batches[0]["input_ids"].dtype == np.int32


def _window_numbers(loader, steps):
    """The window numbers of each global step this loader's rank is fed."""
    per_step = []
    for _ in range(steps):
        micro = [next(loader)["input_ids"][:, 0] for _ in range(loader.accumulation_steps)]
        assert all(len(m) == loader.micro_batch_size for m in micro)
        per_step.append(np.concatenate(micro).tolist())
    return per_step


def test_ranks_split_every_global_batch_disjointly(numbered_shards):
    _, files = numbered_shards
    steps = 12  # more than one epoch: 70 windows // 16 = 4 steps per epoch
    single = _window_numbers(WindowLoader(files, 2, 16, seed=5), steps)
    ranks = [_window_numbers(WindowLoader(files, 4, 16, seed=5, rank=r, world_size=2), steps) for r in range(2)]
    for step in range(steps):
        assert not set(ranks[0][step]) & set(ranks[1][step])
        assert ranks[0][step] + ranks[1][step] == single[step]
    for epoch in range(3):
        seen = [w for step in single[epoch * 4 : (epoch + 1) * 4] for w in step]
        assert len(set(seen)) == 64
    assert single[:4] != single[4:8]


def test_resume_from_a_step_continues_the_same_batches(numbered_shards):
    _, files = numbered_shards
    full = WindowLoader(files, 4, 16, seed=9, rank=1, world_size=2)
    uninterrupted = _window_numbers(full, 10)
    assert full.state() == {"step": 10, "epoch": 2, "seed": 9}
    resumed = WindowLoader(files, 4, 16, seed=9, rank=1, world_size=2, start_step=3)
    assert _window_numbers(resumed, 7) == uninterrupted[3:]


def test_eval_loader_covers_every_window_once_with_unscored_padding(numbered_shards):
    windows, files = numbered_shards  # 70 windows; 16 per evaluation batch over 2 ranks
    loaders = [EvalLoader(files, batch_size=8, rank=r, world_size=2) for r in range(2)]
    assert loaders[0].num_batches == 5 and loaders[0].evaluated_windows == 70
    parts = [list(loader) for loader in loaders]
    assert all(b["input_ids"].shape == (8, 9) for part in parts for b in part)
    scored = []
    for batch in [b for pair in zip(*parts, strict=True) for b in pair]:
        has_label = loss_mask_from_doc_ids(batch["doc_ids"]).any(axis=1)
        scored += batch["input_ids"][has_label, 0].tolist()
    assert scored == list(range(70))  # the 10 padding windows have no scored label
    np.testing.assert_array_equal(parts[1][-1]["doc_ids"], np.tile(np.arange(9), (8, 1)))
    assert [b["input_ids"][:, 0].tolist() for b in loaders[0]] == [b["input_ids"][:, 0].tolist() for b in parts[0]]
    limited = EvalLoader(files, batch_size=8, world_size=2, max_batches=2)
    assert limited.evaluated_windows == 32 and len(list(limited)) == 2


def test_batch_sizes_that_do_not_divide_are_rejected(numbered_shards):
    _, files = numbered_shards
    with pytest.raises(ValueError, match=r"data\.global_batch_size=12 must be a multiple of data\.micro_batch_size=4"):
        WindowLoader(files, 4, 12, seed=0, world_size=2)
