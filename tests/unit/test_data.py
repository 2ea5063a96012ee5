"""Specification of the data pipeline: corpus, tokenizer, reading, packing, MindRecord, cache.

Expected values come from independent computations (brute-force loops over
document lengths, hand-computed losses, the single-process batch order), never
from the code under test.
"""

import importlib.util
import json
import math
import multiprocessing
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

import mindmoe.data as data
from mindmoe.data import documents
from mindmoe.data.config import DataConfig
from mindmoe.data.documents import Tokenising, iter_documents
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
from mindmoe.data.prepare import build_once, prepare_data
from mindmoe.data.reader import DataInputError, SourceStats, checked_file
from mindmoe.data.tokenizer import load_tokenizer, train_sentencepiece

SAMPLES = Path(data.__file__).parent / "samples"


def _generator_module():
    spec = importlib.util.find_spec("tools.samples.generate_corpus")  # the repository root is on the path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDMOE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """The first documents of the bundled corpus: both languages, all document kinds, fast to train on."""
    root = tmp_path_factory.mktemp("corpus")
    lines = (SAMPLES / "corpus_train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "train.jsonl").write_text("".join(lines[:240]), encoding="utf-8")
    (root / "extra.jsonl").write_text("".join(lines[240:300]), encoding="utf-8")
    (root / "valid.jsonl").write_text("".join(lines[300:340]), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def small_tokenizer(small_corpus, tmp_path_factory):
    texts = [json.loads(line)["text"] for line in (small_corpus / "train.jsonl").open(encoding="utf-8")]
    return load_tokenizer(train_sentencepiece(texts, 2048, tmp_path_factory.mktemp("spm") / "spm"))


def _small_config(small_corpus, **overrides):
    fields = dict(
        train_files=[str(small_corpus / "train.jsonl")],
        valid_files=[str(small_corpus / "valid.jsonl")],
        seq_len=32,
        vocab_size=2048,
        num_proc=1,
        shard_windows=100,
    )
    fields.update(overrides)
    return DataConfig(**fields)


# ---------------------------------------------------------------- sample corpus
def test_generated_corpus_is_bilingual_large_and_regenerates_byte_identically(tmp_path):
    train, valid = _generator_module().generate(tmp_path)
    assert train.read_bytes() == (SAMPLES / "corpus_train.jsonl").read_bytes()
    assert valid.read_bytes() == (SAMPLES / "corpus_valid.jsonl").read_bytes()
    assert train.stat().st_size >= 2_000_000
    assert 100_000 <= valid.stat().st_size <= 150_000
    texts = [json.loads(line)["text"] for line in train.open(encoding="utf-8")]
    chinese = sum(bool(re.search(r"[\u4e00-\u9fff]{4}", text)) for text in texts)
    assert 0.45 <= chinese / len(texts) <= 0.55
    assert len(set(texts)) == len(texts)


MONEY = r"(?:[$€£]|USD )([\d,]+\.\d\d)"


def _cents(amount):
    return int(amount.replace(",", "").replace(".", ""))


def _labelled_cents(label, text):
    return [_cents(a) for a in re.findall(rf"{label}.*?{MONEY}", text)]


def test_generated_invoices_add_up():
    checked = 0
    for line in (SAMPLES / "corpus_valid.jsonl").open(encoding="utf-8"):
        text = json.loads(line)["text"]
        if not re.match(r"(Invoice|Order confirmation) [A-Z]+-\d", text):
            continue
        items = re.findall(rf"(\d+) x {MONEY} = {MONEY}", text)
        for quantity, unit, amount in items:
            assert int(quantity) * _cents(unit) == _cents(amount)
        subtotal = _labelled_cents("Subtotal", text)[0]
        assert subtotal == sum(_cents(amount) for _, _, amount in items)
        discount = (_labelled_cents("discount", text) or [0])[0]
        assert _labelled_cents("Total due", text)[0] == subtotal - discount + _labelled_cents("Tax", text)[0]
        checked += 1
    assert checked > 3


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_round_trips_chinese_and_english(small_tokenizer):
    texts = [
        "Invoice INV-2405-0042\nSubtotal: $1,234.50\n\n  two  spaces",
        "本季度公司实现营业收入¥23,074,000.00，环比增长9.7%。\n- 合计：12台",
        "unseen 字符 ☃ and emoji 😀 fall back to bytes",
    ]
    for text in texts:
        ids = small_tokenizer.encode(text)
        assert small_tokenizer.decode(ids) == text
        assert all(0 <= i < small_tokenizer.vocab_size for i in ids)
    assert small_tokenizer.vocab_size == 2048
    assert len({small_tokenizer.pad_id, small_tokenizer.bos_id, small_tokenizer.eos_id}) == 3


def test_tokenizer_training_is_byte_identical_wherever_it_is_written(small_corpus, tmp_path):
    texts = [json.loads(line)["text"] for line in (small_corpus / "valid.jsonl").open(encoding="utf-8")]
    (tmp_path / "elsewhere").mkdir()
    first = train_sentencepiece(texts, 1024, tmp_path / "spm")
    second = train_sentencepiece(texts, 1024, tmp_path / "elsewhere" / "other-name")
    assert first.read_bytes() == second.read_bytes()


def test_missing_tokenizer_names_the_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.tokenizer: .*nope\.model"):
        load_tokenizer(tmp_path / "nope.model")


def test_vocab_too_large_for_the_corpus_names_vocab_size(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=5000: Vocabulary size too high"):
        train_sentencepiece(["tiny corpus", "微型语料"] * 5, 5000, tmp_path / "spm")


# ---------------------------------------------------------------- reading
def _write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def _read(path, text_field, config_key):
    """A file's documents and stats, read the way ``prepare_data`` reads it: checked, then streamed."""
    stats = SourceStats(file=str(path))
    return list(iter_documents(checked_file(str(path), config_key), text_field, config_key, stats)), stats


@pytest.mark.parametrize(
    "name, content, pattern",
    [
        (
            "bad.jsonl",
            '{"text": "a"}\n{"text": "b"}\n{"text": "c" "d"}\n',
            r"data\.train_files\[0\]: .*bad\.jsonl line 3 is not valid JSON \(Expecting ',' delimiter",
        ),
        (
            "field.jsonl",
            '{"text": "a"}\n{"body": "b", "id": 7}\n',
            r"data\.train_files\[0\]: .*field\.jsonl line 2 has no field 'text' \(fields: 'body', 'id'\)",
        ),
        (
            "bytes.jsonl",
            b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
            r"data\.train_files\[0\]: .*bytes\.jsonl line 2 is not valid UTF-8",
        ),
        ("empty.jsonl", "", r"data\.train_files\[0\]: .*empty\.jsonl contains no text"),
        (
            "blank.jsonl",
            '{"text": ""}\n{"text": "  "}\n',
            r"blank\.jsonl contains no text \(2 empty documents skipped\)",
        ),
        ("list.jsonl", '["text"]\n', r"list\.jsonl line 1 is a JSON list, expected an object"),
        ("number.jsonl", '{"text": 5}\n', r"number\.jsonl line 1: field 'text' is a JSON int"),
        ("bytes.txt", b"fine\n\n\xff\xfe\n", r"bytes\.txt line 3 is not valid UTF-8"),
        ("array.json", b'[{"text": "a"},\n {"text": "\xe9"}]', r"array\.json line 2 is not valid UTF-8"),
        ("broken.json", '[{"text": "a"},\n {"text": }]', r"broken\.json line 2 is not valid JSON \(Expecting value"),
        ("table.csv", "text\nhello\n", r"unsupported file type '\.csv'"),
    ],
)
def test_bad_input_error_names_key_file_and_line(tmp_path, name, content, pattern):
    path = _write(tmp_path / name, content)
    with pytest.raises(DataInputError, match=pattern):
        _read(path, "text", "data.train_files[0]")


@pytest.mark.parametrize("tokenizer", [None, str(SAMPLES / "tiny_base" / "tokenizer.model")], ids=["trained", "given"])
@pytest.mark.parametrize(
    "name, content, pattern",
    [
        ("bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": "c" "d"}\n', r"bad\.jsonl line 3 is not valid JSON"),
        ("blank.jsonl", '{"text": ""}\n', r"blank\.jsonl contains no text \(1 empty documents skipped\)"),
        ("list.parquet", None, r"list\.parquet column 'text' has type list<element: string>, expected string"),
    ],
    ids=["bad_json", "no_text", "list_column"],
)
def test_prepare_data_raises_the_readers_error_whether_it_trains_the_tokenizer_or_not(
    tmp_path, small_corpus, tokenizer, name, content, pattern
):
    # The tokenizer trainer reads the training files first, from C++: its own failure must not hide the reader's.
    path = tmp_path / name
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [["a", "b"]]}), path)
    else:
        _write(path, content)
    cfg = _small_config(small_corpus, train_files=[str(path)], tokenizer=tokenizer)
    with pytest.raises(DataInputError, match=rf"^data\.train_files\[0\]: .*{pattern}"):
        prepare_data(cfg)


def test_missing_file_error_names_the_config_key(tmp_path, small_corpus):
    missing = tmp_path / "missing.jsonl"
    cfg = _small_config(small_corpus, train_files=[str(small_corpus / "train.jsonl"), str(missing)])
    with pytest.raises(FileNotFoundError, match=rf"data\.train_files\[1\]: file not found: {re.escape(str(missing))}"):
        prepare_data(cfg)


def test_empty_texts_are_skipped_and_counted(tmp_path):
    path = _write(
        tmp_path / "mixed.jsonl",
        '{"text": "one"}\n\n{"text": ""}\n{"text": null, "id": "x"}\n{"text": "two", "id": 3}\n',
    )
    texts, stats = _read(path, "text", "data.train_files[0]")
    assert texts == ["one", "two"]
    assert (stats.documents, stats.skipped_empty) == (2, 2)


def test_txt_documents_are_blank_line_separated_and_json_arrays_are_read(tmp_path):
    txt = _write(tmp_path / "notes.txt", "first line\nsecond line\n\n\nnext doc\n")
    texts, _ = _read(txt, "text", "k")
    assert texts == ["first line\nsecond line", "next doc"]
    array = _write(tmp_path / "rows.json", '[{"body": "a"}, {"body": "b"}]')
    texts, _ = _read(array, "body", "k")
    assert texts == ["a", "b"]


def test_parquet_is_read_and_a_missing_column_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"content": ["alpha", "", None, "beta"], "id": [1, 2, 3, 4]}), path)
    texts, stats = _read(path, "content", "k")
    assert texts == ["alpha", "beta"] and stats.skipped_empty == 2
    with pytest.raises(DataInputError, match=r"k: .*rows\.parquet has no column 'text' \(columns: content, id\)"):
        _read(path, "text", "k")


def test_parallel_tokenisation_wraps_each_document_in_bos_and_eos(small_corpus, small_tokenizer, monkeypatch):
    monkeypatch.setattr(documents, "BATCH_DOCUMENTS", 7)  # several batches, spread over the workers
    path = small_corpus / "valid.jsonl"
    texts = [json.loads(line)["text"] for line in path.open(encoding="utf-8")]
    expected = [[small_tokenizer.bos_id] + small_tokenizer.encode(text) + [small_tokenizer.eos_id] for text in texts]
    stats = SourceStats(file=str(path))
    with Tokenising(small_tokenizer, num_proc=2) as tokenising:
        batches = list(tokenising.batches(iter_documents(path, "text", "data.valid_files[0]", stats)))
    assert len(batches) > 2
    stream_lengths = np.concatenate([batch.doc_lengths for batch in batches])
    stream_tokens = np.concatenate([batch.tokens for batch in batches])
    assert stream_lengths.tolist() == [len(ids) for ids in expected]
    assert stream_tokens.tolist() == [token for ids in expected for token in ids]


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


# ---------------------------------------------------------------- prepare and cache
def _independent_unigram_loss(train_files, valid_files, vocab_size):
    def scored_labels(files):
        for batch in EvalLoader(files, batch_size=1):
            ids, docs = batch["input_ids"][0].tolist(), batch["doc_ids"][0].tolist()
            yield from (ids[t + 1] for t in range(len(ids) - 1) if docs[t + 1] == docs[t])

    counts = Counter(scored_labels(train_files))
    total = sum(counts.values())
    valid = list(scored_labels(valid_files))
    return -sum(math.log((counts[label] + 1) / (total + vocab_size)) for label in valid) / len(valid)


def test_prepare_data_builds_once_and_reuses_the_cache(small_corpus, isolated_cache, monkeypatch):
    cfg = _small_config(small_corpus)
    first = prepare_data(cfg)
    assert first.vocab_size == 2048 and Path(first.tokenizer_path).is_file()
    assert first.num_train_windows > 100 and first.num_valid_windows > 10
    assert all(Path(f).is_relative_to(isolated_cache) for f in first.train_shards + first.valid_shards)
    assert first.unigram_val_loss == pytest.approx(
        _independent_unigram_loss(first.train_shards, first.valid_shards, 2048), rel=1e-9
    )
    for name in ("_build_shards", "train_sentencepiece"):
        monkeypatch.setattr(f"mindmoe.data.prepare.{name}", lambda *a, **k: pytest.fail("rebuilt a cached entry"))
    assert prepare_data(cfg) == first


def test_cache_key_changes_when_a_file_or_setting_changes(small_corpus, tmp_path):
    valid = tmp_path / "valid.jsonl"
    valid.write_bytes((small_corpus / "valid.jsonl").read_bytes())
    cfg = _small_config(small_corpus, valid_files=[str(valid)])
    first = prepare_data(cfg)
    with valid.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "Late addition: one more memo."}) + "\n")
    changed = prepare_data(cfg)
    assert changed.cache_key != first.cache_key
    assert changed.tokenizer_path == first.tokenizer_path  # the tokenizer only depends on training files
    shorter = prepare_data(_small_config(small_corpus, valid_files=[str(valid)], seq_len=16))
    assert shorter.cache_key != changed.cache_key


def test_weighted_mixture_of_two_files(small_corpus):
    files = [str(small_corpus / "train.jsonl"), str(small_corpus / "extra.jsonl")]
    plain = prepare_data(_small_config(small_corpus, train_files=files))
    # As Hydra passes it: an OmegaConf node, lists as ListConfig.
    weighted = prepare_data(OmegaConf.structured(_small_config(small_corpus, train_files=files, weights=[1.0, 1.0])))
    assert weighted.num_train_windows == plain.num_train_windows
    meta = json.loads((Path(weighted.train_shards[0]).parent / "meta.json").read_text())
    used = [source["windows_used"] for source in meta["sources"]]
    assert abs(used[0] - used[1]) <= 1 and used[1] > meta["sources"][1]["windows"]
    with pytest.raises(ValueError, match=r"data\.weights has 1 entries but data\.train_files has 2"):
        prepare_data(_small_config(small_corpus, train_files=files, weights=[1.0]))


def _slow_build(entry, marker_dir, results):
    def build(staging):
        (marker_dir / f"built-{multiprocessing.current_process().pid}").touch()
        time.sleep(0.5)
        (staging / "payload").write_text("done")
        return {"ok": True}

    results.put(build_once(entry, build))


def test_concurrent_processes_build_a_cache_entry_once(tmp_path):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_slow_build, args=(tmp_path / "entry", tmp_path, results)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    assert [results.get(timeout=5) for _ in workers] == [{"ok": True}] * 3
    assert len(list(tmp_path.glob("built-*"))) == 1
    assert (tmp_path / "entry" / "payload").read_text() == "done"
    assert not list(tmp_path.glob(".entry.*"))
