"""Read local text files into ``datasets.Dataset`` objects, and tokenise them.

Supported files (the extension decides):

- ``.jsonl`` / ``.json``: one JSON object per line holding ``data.text_field``
  (a ``.json`` file may instead be one JSON array of such objects);
- ``.parquet``: a table with a string column ``data.text_field``;
- ``.txt``: plain UTF-8 text; documents are separated by blank lines.

Every line is checked in Python while the rows are streamed into an Arrow
dataset (``Dataset.from_generator``), so bad input fails with the config key,
the file and the line instead of a pyarrow traceback. ``load_dataset("json")``
is not used for JSON because pyarrow's schema inference rejects files whose
*other* fields change type between rows (``Column(/id) changed from number to
string``), which real exports do; those fields are irrelevant here.

Empty or null texts are skipped and counted; a file with no text at all is an error.
``prepare_data`` reads the same documents as a stream instead (:mod:`data.documents`).
"""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence, Tuple

import numpy as np

# Read before ``datasets`` is imported: this pipeline never touches the Hub at run time.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from datasets.exceptions import DatasetGenerationError  # noqa: E402

from mindmoe.data.tokenizer import Tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

#: The reader each supported suffix selects: the same bytes are other documents under another suffix.
READERS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".txt": "txt"}
SUPPORTED_SUFFIXES = tuple(READERS)
TEXT_FEATURES = datasets.Features({"text": datasets.Value("string")})
IDS_FEATURES = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))})


class DataInputError(ValueError):
    """Input data that cannot be used as it is; the message names key, file and line."""


@dataclass
class SourceStats:
    """What reading one file found; logged, and stored in the cache entry's meta.json."""

    file: str
    documents: int = 0
    skipped_empty: int = 0


class Source(NamedTuple):
    """One file's documents (a Dataset with a ``text`` column) and what reading it found."""

    dataset: datasets.Dataset
    stats: SourceStats


@dataclass
class DocumentTokens:
    """Tokenised documents of one source, each ``[bos] + ids + [eos]``, concatenated."""

    tokens: np.ndarray  # int32 [total_tokens]
    doc_lengths: np.ndarray  # int64 [documents], sums to total_tokens


def checked_file(path: str, config_key: str) -> Path:
    """``path`` as an absolute path to an existing file of a supported type."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise FileNotFoundError(f"{config_key}: file not found: {resolved}")
    if not resolved.is_file():
        raise DataInputError(f"{config_key}: {resolved} is not a file (list the files themselves)")
    if resolved.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise DataInputError(
            f"{config_key}: {resolved}: unsupported file type '{resolved.suffix}' "
            f"(use one of {', '.join(SUPPORTED_SUFFIXES)})"
        )
    return resolved


def reader_name(path: Path) -> str:
    """The reader :func:`read_source` uses for ``path`` (a checked file); part of the cache keys."""
    return READERS[path.suffix.lower()]


def read_source(path: str, text_field: str, config_key: str, work_dir: Path) -> Source:
    """Read one file into a one-column (``text``) Dataset of its non-empty documents.

    ``work_dir`` holds the Arrow files ``datasets`` writes; the caller owns and deletes it.
    """
    resolved = checked_file(path, config_key)
    stats = SourceStats(file=str(resolved))
    if resolved.suffix.lower() == ".parquet":
        dataset = _read_parquet(resolved, text_field, config_key, work_dir, stats)
    else:
        try:
            dataset = datasets.Dataset.from_generator(
                _text_rows,
                features=TEXT_FEATURES,
                cache_dir=str(work_dir),
                gen_kwargs={"path": resolved, "text_field": text_field, "config_key": config_key, "stats": stats},
            )
        except DatasetGenerationError as err:
            # datasets wraps whatever the generator raises; our message is the useful one.
            if isinstance(err.__cause__, DataInputError):
                raise err.__cause__ from None
            raise
    stats.documents = len(dataset)
    if stats.documents == 0:
        raise _no_text(config_key, resolved, stats)
    if stats.skipped_empty:
        logger.warning("%s: skipped %d empty documents in %s", config_key, stats.skipped_empty, resolved)
    logger.info("%s: %d documents from %s", config_key, stats.documents, resolved)
    return Source(dataset, stats)


def _no_text(config_key: str, path: Path, stats: SourceStats) -> DataInputError:
    return DataInputError(f"{config_key}: {path} contains no text ({stats.skipped_empty} empty documents skipped)")


def _text_rows(path: Path, text_field: str, config_key: str, stats: SourceStats) -> Iterator[dict]:
    suffix = path.suffix.lower()
    if suffix == ".json" and _starts_with_array(path):
        documents = _json_array_texts(path, text_field, config_key)
    elif suffix == ".txt":
        documents = _paragraphs(_decoded_lines(path, config_key))
    else:
        documents = _json_line_texts(_decoded_lines(path, config_key), path, text_field, config_key)
    found = False
    for text in documents:
        if text is None or not text.strip():
            stats.skipped_empty += 1
        else:
            found = True
            yield {"text": text}
    if not found:  # checked here because datasets cannot build a dataset of no rows
        raise _no_text(config_key, path, stats)


def _decoded_lines(path: Path, config_key: str) -> Iterator[Tuple[int, str]]:
    """``(line_number, text)`` pairs, failing on the first line that is not UTF-8."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                # utf-8-sig drops a byte-order mark, which editors on Windows add.
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise DataInputError(
                    f"{config_key}: {path} line {number} is not valid UTF-8 "
                    f"(byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)"
                ) from None


def _paragraphs(lines: Iterator[Tuple[int, str]]) -> Iterator[str]:
    paragraph = []
    for _, line in lines:
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "\n".join(paragraph)
            paragraph = []
    if paragraph:
        yield "\n".join(paragraph)


def _json_line_texts(lines: Iterator[Tuple[int, str]], path: Path, text_field: str, config_key: str) -> Iterator[str]:
    for number, line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataInputError(
                f"{config_key}: {path} line {number} is not valid JSON ({err.msg}, column {err.colno})"
            ) from None
        yield _field_text(row, text_field, f"{config_key}: {path} line {number}")


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _json_array_texts(path: Path, text_field: str, config_key: str) -> Iterator[str]:
    raw = path.read_bytes()
    try:
        rows = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataInputError(
            f"{config_key}: {path} line {line} is not valid UTF-8 (byte 0x{raw[err.start]:02x})"
        ) from None
    except json.JSONDecodeError as err:
        raise DataInputError(
            f"{config_key}: {path} line {err.lineno} is not valid JSON ({err.msg}, column {err.colno})"
        ) from None
    for index, row in enumerate(rows):
        yield _field_text(row, text_field, f"{config_key}: {path} array element {index}")


def _field_text(row, text_field: str, where: str):
    if not isinstance(row, dict):
        raise DataInputError(f"{where} is a JSON {type(row).__name__}, expected an object with a '{text_field}' field")
    if text_field not in row:
        fields = ", ".join(repr(name) for name in row) or "none"
        raise DataInputError(
            f"{where} has no field '{text_field}' (fields: {fields}); set data.text_field to the field holding the text"
        )
    text = row[text_field]
    if text is not None and not isinstance(text, str):
        raise DataInputError(f"{where}: field '{text_field}' is a JSON {type(text).__name__}, expected a string")
    return text


def _read_parquet(path: Path, text_field: str, config_key: str, work_dir: Path, stats: SourceStats) -> datasets.Dataset:
    parquet_text_column(path, text_field, config_key)
    table = datasets.load_dataset(
        "parquet", data_files=[str(path)], columns=[text_field], split="train", cache_dir=str(work_dir)
    )
    if text_field != "text":
        table = table.rename_column(text_field, "text")
    kept = table.filter(lambda texts: [bool(t and t.strip()) for t in texts], input_columns=["text"], batched=True)
    stats.skipped_empty = len(table) - len(kept)
    return kept


def parquet_text_column(path: Path, text_field: str, config_key: str) -> None:
    """Fail, naming ``config_key``, unless ``path`` is a Parquet file with a string column ``text_field``."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        others = ", ".join(suffix for suffix in SUPPORTED_SUFFIXES if suffix != ".parquet")
        raise DataInputError(
            f"{config_key}: {path} is not a readable Parquet file ({str(err).rstrip('.')}); its "
            f"'{path.suffix}' suffix selects the Parquet reader: give it the suffix of what it holds ({others})"
        ) from None
    if text_field not in schema.names:
        raise DataInputError(
            f"{config_key}: {path} has no column '{text_field}' (columns: "
            f"{', '.join(schema.names)}); set data.text_field to the column holding the text"
        )
    column_type = schema.field(text_field).type
    if str(column_type) not in ("string", "large_string"):
        raise DataInputError(f"{config_key}: {path} column '{text_field}' has type {column_type}, expected string")


def _encode_batch(batch: dict, tokenizer: Tokenizer) -> dict:
    # Tokenizers without a BOS (GLM-4.5's) or EOS token report -1: nothing is added for them.
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id >= 0 else []
    return {"ids": [bos + ids + eos for ids in tokenizer.encode_batch(batch["text"])]}


def tokenize_documents(dataset: datasets.Dataset, tokenizer: Tokenizer, num_proc: int) -> DocumentTokens:
    """Tokenise every document (``num_proc`` processes) into one concatenated stream."""
    encoded = dataset.map(
        _encode_batch,
        fn_kwargs={"tokenizer": tokenizer},
        batched=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=["text"],
        features=IDS_FEATURES,
        desc="tokenising",
    )
    ids = encoded.data.column("ids").combine_chunks()
    return DocumentTokens(
        tokens=ids.flatten().to_numpy().astype(np.int32, copy=False),
        doc_lengths=np.diff(ids.offsets.to_numpy()).astype(np.int64),
    )


def concatenate(parts: Sequence[DocumentTokens]) -> DocumentTokens:
    """One stream of the documents of several sources, in order."""
    return DocumentTokens(
        tokens=np.concatenate([p.tokens for p in parts]), doc_lengths=np.concatenate([p.doc_lengths for p in parts])
    )
