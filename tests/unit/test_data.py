"""Specification of the data pipeline: corpus, tokenizer, reading, cache. Packing and MindRecord are in
``test_data_packing.py``.

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
from mindmoe.data.mindrecord import EvalLoader
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
