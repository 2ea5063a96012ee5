"""Read the documents of local text files, checking every line, for :mod:`data.documents` to stream.

Supported files (the extension decides):

- ``.jsonl`` / ``.json``: one JSON object per line holding ``data.text_field``
  (a ``.json`` file may instead be one JSON array of such objects);
- ``.parquet``: a table with a string column ``data.text_field``;
- ``.txt``: plain UTF-8 text; documents are separated by blank lines.

Every line is checked in Python as it is read, so bad input fails with the config key, the file and
the line instead of a library's traceback. JSON is parsed line by line rather than by pyarrow, whose
schema inference rejects files whose *other* fields change type between rows (``Column(/id) changed
from number to string``), which real exports do; those fields are irrelevant here.

Empty or null texts are skipped and counted; a file with no text at all is an error.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

#: The reader each supported suffix selects: the same bytes are other documents under another suffix.
READERS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".txt": "txt"}
SUPPORTED_SUFFIXES = tuple(READERS)


class DataInputError(ValueError):
    """Input data that cannot be used as it is; the message names key, file and line."""


@dataclass
class SourceStats:
    """What reading one file found; logged, and stored in the cache entry's meta.json."""

    file: str
    documents: int = 0
    skipped_empty: int = 0


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
    """The reader :func:`data.documents.iter_documents` uses for ``path`` (a checked file); part of the cache keys."""
    return READERS[path.suffix.lower()]


def no_text_error(config_key: str, path: Path, stats: SourceStats) -> DataInputError:
    return DataInputError(f"{config_key}: {path} contains no text ({stats.skipped_empty} empty documents skipped)")


def text_documents(path: Path, text_field: str, config_key: str, stats: SourceStats) -> Iterator[str]:
    """The non-empty documents of the checked JSON or text file ``path``, in file order;
    ``stats.skipped_empty`` counts the empty and null ones."""
    suffix = path.suffix.lower()
    if suffix == ".json" and _starts_with_array(path):
        documents = _json_array_texts(path, text_field, config_key)
    elif suffix == ".txt":
        documents = _paragraphs(_decoded_lines(path, config_key))
    else:
        documents = _json_line_texts(_decoded_lines(path, config_key), path, text_field, config_key)
    for text in documents:
        if text is None or not text.strip():
            stats.skipped_empty += 1
        else:
            yield text


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
