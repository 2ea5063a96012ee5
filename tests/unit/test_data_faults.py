"""Data preparation under faults and mistakes: cache keys that follow the reader, leftovers of killed
processes, damaged cache entries, and inputs that used to fail with a library's message.

Each test builds the faulty case as a user meets it (a renamed file, a killed preparation, a shard cut
short) and checks what prepare_data does with it.
"""

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import mindmoe.data as data
from mindmoe.data import prepare
from mindmoe.data.config import DataConfig
from mindmoe.data.mindrecord import WindowLoader
from mindmoe.data.prepare import prepare_data
from mindmoe.data.reader import DataInputError
from mindmoe.data.scratch import OWNED_NAME
from mindmoe.data.tokenizer import MAX_SENTENCE_BYTES, _line_pieces, load_tokenizer

SAMPLES = Path(data.__file__).parent / "samples"
HOST = socket.gethostname()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDMOE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _sample_lines(count: int) -> str:
    return "".join((SAMPLES / "corpus_train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:count])


def _config(*train_files, **overrides) -> DataConfig:
    fields = dict(train_files=[str(f) for f in train_files], valid_files=[], seq_len=32, vocab_size=2048, num_proc=1)
    fields.update(overrides)
    return DataConfig(**fields)


def _meta(prepared) -> dict:
    return json.loads((Path(prepared.train_shards[0]).parent / "meta.json").read_text())


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------- cache keys
def test_same_bytes_as_jsonl_and_txt_are_read_as_different_documents_with_their_own_cache_entries(tmp_path, cache):
    lines = _sample_lines(40)
    as_jsonl, as_txt = tmp_path / "corpus.jsonl", tmp_path / "corpus.txt"
    as_jsonl.write_text(lines, encoding="utf-8")
    as_txt.write_text(lines, encoding="utf-8")
    jsonl = prepare_data(_config(as_jsonl))
    txt = prepare_data(_config(as_txt))
    # JSON lines are 40 documents; as text, 40 lines without a blank one are one paragraph.
    assert [s["documents"] for s in _meta(jsonl)["sources"]] == [40]
    assert [s["documents"] for s in _meta(txt)["sources"]] == [1]
    assert txt.cache_key != jsonl.cache_key
    # The tokenizer trained on the JSON texts is not reused for the raw lines (with their braces and quotes).
    assert txt.tokenizer_path != jsonl.tokenizer_path
    assert len([entry for entry in (cache / "tokenizer").iterdir() if entry.is_dir()]) == 2
    # The same file under its own name again is a hit.
    assert prepare_data(_config(as_jsonl)) == jsonl


# ---------------------------------------------------------------- leftovers of killed processes
def test_stale_temporary_directories_of_dead_processes_are_removed_and_live_ones_kept(
    tmp_path, cache, caplog, monkeypatch
):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_sample_lines(40), encoding="utf-8")
    dead, live = _dead_pid(), os.getppid()
    leftovers = {
        "dead read": cache / f".read-{dead}@{HOST}-k2x_9a1q",
        "dead staging": cache / "data" / f".0123456789abcdef0123.{dead}@{HOST}-zz0",
        "live read": cache / f".read-{live}@{HOST}-abc",
        "live staging": cache / "tokenizer" / f".0123456789abcdef0123.{live}@{HOST}-q1",
        "other host": cache / f".read-{dead}@{HOST}-elsewhere-abc",
    }
    for path in leftovers.values():
        path.mkdir(parents=True)
        (path / "data-00000-of-00001.arrow").write_bytes(b"x" * 100)
    work_dirs = []
    real_write = prepare.write_text_shards

    def recording_write(staging, cfg, train, valid, tokenizer, work_dir, seed):
        work_dirs.append(work_dir)
        return real_write(staging, cfg, train, valid, tokenizer, work_dir, seed)

    monkeypatch.setattr(prepare, "write_text_shards", recording_write)
    with caplog.at_level(logging.WARNING, logger="mindmoe.data"):
        prepare_data(_config(corpus))
    assert not leftovers["dead read"].exists() and not leftovers["dead staging"].exists()
    assert all(leftovers[name].is_dir() for name in ("live read", "live staging", "other host"))
    removed = [r.getMessage() for r in caplog.records if "no longer running" in r.getMessage()]
    assert len(removed) == 2 and all(f"process {dead}," in message for message in removed)
    assert str(leftovers["dead read"]) in removed[0] + removed[1]
    # This run's own read directory carried its owner, and is gone.
    owner = OWNED_NAME.match(work_dirs[0].name)
    assert owner and (int(owner["pid"]), owner["host"]) == (os.getpid(), HOST)
    assert not work_dirs[0].exists()


# ---------------------------------------------------------------- inputs that failed with a library's message
def test_a_single_line_document_longer_than_the_trainers_sentence_limit_trains_a_tokenizer(tmp_path, cache):
    texts = [json.loads(line)["text"].replace("\n", " ") for line in _sample_lines(400).splitlines()]
    line = " ".join(texts)
    while len(line.encode("utf-8")) < (1 << 20):
        line = f"{line} {line}"
    assert len(line.encode("utf-8")) > 64 * MAX_SENTENCE_BYTES
    corpus = tmp_path / "one_line.jsonl"
    corpus.write_text(json.dumps({"text": line}, ensure_ascii=False) + "\n", encoding="utf-8")
    prepared = prepare_data(_config(corpus))
    tokenizer = load_tokenizer(prepared.tokenizer_path)
    assert tokenizer.vocab_size == 2048
    sample = texts[0][:300]
    assert tokenizer.decode(tokenizer.encode(sample)) == sample
    # Trained on the document's pieces: well below one token per UTF-8 byte.
    assert len(tokenizer.encode(sample)) < 0.6 * len(sample.encode("utf-8"))
    assert prepared.num_train_windows >= 1000


def test_long_lines_are_cut_before_a_space_or_between_characters():
    words = " ".join(["alpha"] * 8000)
    pieces = list(_line_pieces(words))
    assert "".join(pieces) == words and all(len(p.encode()) <= MAX_SENTENCE_BYTES for p in pieces)
    assert all(p.startswith(" alpha") for p in pieces[1:])  # no word cut in two
    chinese = "数据" * 9000  # no spaces; 3 bytes a character
    pieces = list(_line_pieces(chinese))
    assert "".join(pieces) == chinese and all(len(p.encode()) <= MAX_SENTENCE_BYTES for p in pieces)


def test_a_text_file_named_parquet_is_an_error_naming_the_key_the_file_and_the_suffix(tmp_path, cache):
    good = tmp_path / "good.jsonl"
    good.write_text(_sample_lines(5), encoding="utf-8")
    notes = tmp_path / "notes.parquet"
    notes.write_text("plain notes\nnot a table\n", encoding="utf-8")
    pattern = (
        rf"data\.valid_files\[0\]: {notes} is not a readable Parquet file \(Parquet magic bytes not found.*\); "
        r"its '\.parquet' suffix selects the Parquet reader: give it the suffix of what it holds \(\.jsonl, \.json"
    )
    with pytest.raises(DataInputError, match=pattern):
        prepare_data(_config(good, valid_files=[str(notes)], tokenizer=str(SAMPLES / "tiny_base" / "tokenizer.model")))


# ---------------------------------------------------------------- damaged cache entries
def test_a_truncated_cached_shard_is_rebuilt_with_a_warning_and_named_when_cut_during_a_run(tmp_path, cache, caplog):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(_sample_lines(60), encoding="utf-8")
    cfg = _config(corpus, shard_windows=200, tokenizer=str(SAMPLES / "tiny_base" / "tokenizer.model"))
    first = prepare_data(cfg)
    assert len(first.train_shards) >= 2
    shard = Path(first.train_shards[1])
    written = shard.read_bytes()
    shard.write_bytes(written[: len(written) // 2])  # a full disk, an interrupted copy
    with caplog.at_level(logging.WARNING, logger="mindmoe.data"):
        again = prepare_data(cfg)
    assert again == first and shard.read_bytes() == written
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"cache entry {shard.parent} is damaged: {shard.name} has {len(written) // 2} bytes, "
        f"{len(written)} were written; rebuilding it"
    ]
    loader = WindowLoader(first.train_shards, 16, 16, seed=0, shuffle=False)
    windows = sum(len(next(loader)["input_ids"]) for _ in range(loader.steps_per_epoch))
    assert windows == loader.steps_per_epoch * 16
    # Cut while a run has it open: the shard opens, then reading fails; the error names the file and what to do.
    shard.write_bytes(written[: len(written) // 2])
    loader = WindowLoader(first.train_shards, 16, 16, seed=0, shuffle=False)
    pattern = (
        rf"MindRecord shards of the data cache entry {shard.parent} cannot be read \(.+\): {shard.name} has "
        rf"{len(written) // 2} bytes, {len(written)} were written; the next run rebuilds the entry"
    )
    with pytest.raises(DataInputError, match=pattern):
        for _ in range(loader.steps_per_epoch):
            next(loader)
