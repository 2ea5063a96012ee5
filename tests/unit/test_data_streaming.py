"""Data at scale: the writer tokenises and packs a shard at a time, the other processes of a job wait
for its cache entry and never read a data file.

References: the windows are compared with a plain-Python packing of the same documents (and, with
``data.weights``, with the in-memory mixture of :mod:`data.packing`, whose draws define the cache
entries); the SFT windows with :func:`data.sft.pack_conversations` over whole files.
"""

import json
import threading
from pathlib import Path

import mindspore.dataset as msd
import numpy as np
import pytest

import mindmoe.data as data
from mindmoe.data import documents, prepare, sft_shards, text_shards
from mindmoe.data.config import DataConfig
from mindmoe.data.packing import PackedWindows, mix_sources, mixture_counts, unigram_loss
from mindmoe.data.prepare import prepare_data
from mindmoe.data.sft import encode_conversation, pack_conversations, read_conversations
from mindmoe.data.tokenizer import load_tokenizer

SAMPLES = Path(data.__file__).parent / "samples"
TOKENIZER = SAMPLES / "tiny_base" / "tokenizer.model"


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDMOE_CACHE", str(tmp_path / "cache"))
    lines = (SAMPLES / "corpus_train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:90]), encoding="utf-8")
    (tmp_path / "b.jsonl").write_text("".join(lines[90:120]), encoding="utf-8")
    (tmp_path / "valid.jsonl").write_text("".join(lines[120:140]), encoding="utf-8")
    return tmp_path


def _config(corpus, **overrides) -> DataConfig:
    fields = dict(
        train_files=[str(corpus / "a.jsonl"), str(corpus / "b.jsonl")],
        valid_files=[str(corpus / "valid.jsonl")],
        tokenizer=str(TOKENIZER),
        seq_len=16,
        shard_windows=37,
        num_proc=1,
    )
    fields.update(overrides)
    return DataConfig(**fields)


def _shard_windows(shards) -> PackedWindows:
    rows = list(msd.MindDataset(list(shards), shuffle=False).create_dict_iterator(output_numpy=True, num_epochs=1))
    mask = [row["loss_mask"] for row in rows] if "loss_mask" in rows[0] else None
    return PackedWindows(
        np.stack([row["input_ids"] for row in rows]),
        np.stack([row["doc_ids"] for row in rows]),
        None if mask is None else np.stack(mask),
    )


def _reference_windows(path: Path, tokenizer, window: int):
    """Plain Python: documents ``[bos] + ids + [eos]`` cut every ``window`` tokens; doc ids from the window's first."""
    tokens, docs = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        ids = [tokenizer.bos_id] + tokenizer.encode(json.loads(line)["text"]) + [tokenizer.eos_id]
        tokens += ids
        docs += [number] * len(ids)
    windows = []
    for start in range(0, len(tokens) - window + 1, window):
        ids, doc = tokens[start : start + window], docs[start : start + window]
        windows.append((ids, [d - doc[0] for d in doc]))
    return windows


def test_streamed_windows_equal_a_plain_packing_of_the_same_documents(corpus, monkeypatch):
    # Batches of 7 documents: windows and shards are cut across batch and file boundaries.
    monkeypatch.setattr(documents, "BATCH_DOCUMENTS", 7)
    prepared = prepare_data(_config(corpus))
    tokenizer = load_tokenizer(TOKENIZER)
    expected = _reference_windows(corpus / "a.jsonl", tokenizer, 17) + _reference_windows(
        corpus / "b.jsonl", tokenizer, 17
    )
    got = _shard_windows(prepared.train_shards)
    assert len(expected) > 3 * 37 and len(prepared.train_shards) == -(-len(expected) // 37)
    np.testing.assert_array_equal(got.input_ids, np.array([ids for ids, _ in expected], np.int32))
    np.testing.assert_array_equal(got.doc_ids, np.array([docs for _, docs in expected], np.int32))
    valid = _shard_windows(prepared.valid_shards)
    np.testing.assert_array_equal(
        valid.input_ids, [ids for ids, _ in _reference_windows(corpus / "valid.jsonl", tokenizer, 17)]
    )
    assert prepared.unigram_val_loss == pytest.approx(unigram_loss(got, valid, tokenizer.vocab_size), rel=1e-12)


def test_weighted_mixture_streamed_through_worker_processes_draws_the_in_memory_mixture(corpus, monkeypatch):
    monkeypatch.setattr(documents, "BATCH_DOCUMENTS", 5)
    monkeypatch.setattr(text_shards, "SPILL_CHUNK", 11)
    weights = [1.0, 3.0]
    prepared = prepare_data(_config(corpus, weights=weights, num_proc=2))
    tokenizer = load_tokenizer(TOKENIZER)
    sources = []
    for name in ("a.jsonl", "b.jsonl"):
        expected = _reference_windows(corpus / name, tokenizer, 17)
        sources.append(PackedWindows(np.array([i for i, _ in expected]), np.array([d for _, d in expected])))
    counts = mixture_counts([len(s) for s in sources], weights)
    assert counts[1] > len(sources[1])  # the small source is repeated, the large one sampled
    mixed = mix_sources(sources, counts, prepare.MIXTURE_SEED)
    got = _shard_windows(prepared.train_shards)
    np.testing.assert_array_equal(got.input_ids, mixed.input_ids)
    np.testing.assert_array_equal(got.doc_ids, mixed.doc_ids)
    assert not list((corpus / "cache").glob(".read-*"))  # the spill files went with the work directory


def test_sft_shards_streamed_equal_packing_whole_files(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sft_shards, "ROWS_PER_CHUNK", 3)
    files = [SAMPLES / "business_sft_train.jsonl", SAMPLES / "business_sft_valid.jsonl"]
    cfg = DataConfig(
        train_files=[str(f) for f in files],
        valid_files=[str(files[1])],
        tokenizer=str(TOKENIZER),
        format="sft",
        seq_len=256,
    )
    cfg.sft_overlong, cfg.shard_windows = "truncate", 10
    prepared = prepare_data(cfg)
    tokenizer = load_tokenizer(TOKENIZER)
    parts = []
    for path in files:
        encoded = [encode_conversation(m, tokenizer) for m in read_conversations(path, "k")]
        parts.append(pack_conversations(encoded, 256, tokenizer.pad_id, "truncate", "k").windows)
    got = _shard_windows(prepared.train_shards)
    assert len(got) == sum(len(p) for p in parts) > 10
    for column in ("input_ids", "doc_ids", "loss_mask"):
        np.testing.assert_array_equal(getattr(got, column), np.concatenate([getattr(p, column) for p in parts]))
    valid = _shard_windows(prepared.valid_shards)
    np.testing.assert_array_equal(valid.loss_mask, parts[1].loss_mask)
    assert prepared.unigram_val_loss == pytest.approx(unigram_loss(got, valid, tokenizer.vocab_size), rel=1e-12)


def test_a_non_writer_waits_for_the_writers_entry_and_reads_no_data_file(corpus, monkeypatch):
    cfg = _config(corpus)
    with pytest.raises(TimeoutError, match=r"data\.wait_timeout_s=0\.3: waited .* data cache in .*cache"):
        prepare_data(_config(corpus, wait_timeout_s=0.3), writer=False)
    readers = []
    real_sha, real_docs = prepare.file_sha256, text_shards.iter_documents

    def sha(path):
        readers.append((threading.current_thread().name, Path(path).name))
        return real_sha(path)

    def docs(path, *args):
        readers.append((threading.current_thread().name, Path(path).name))
        return real_docs(path, *args)

    monkeypatch.setattr(prepare, "file_sha256", sha)
    monkeypatch.setattr(text_shards, "iter_documents", docs)
    waited = {}
    reader = threading.Thread(
        target=lambda: waited.update(result=prepare_data(cfg, writer=False)), name="non-writer", daemon=True
    )
    reader.start()
    reader.join(1.0)
    assert reader.is_alive()  # nothing to read before the writer is done
    written = prepare_data(cfg)
    reader.join(30)
    assert waited["result"] == written
    assert {name for thread, name in readers if thread == "non-writer"} == set()
    assert {"a.jsonl", "b.jsonl", "valid.jsonl"} <= {name for _, name in readers}
    # A later job: the writer hits the cache and points at it again; a non-writer needs no writer then.
    assert prepare_data(cfg, writer=False) == written
    # An edited file is another preparation: the non-writer does not take the old entry.
    with open(corpus / "b.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "one more memo"}) + "\n")
    with pytest.raises(TimeoutError):
        prepare_data(_config(corpus, wait_timeout_s=0.3), writer=False)
