"""Reading safetensors one tensor at a time, and writing them in bounded shards.

The format is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and the raw
little-endian data, offsets relative to the end of the header. Reading it directly (instead of
``safetensors.safe_open(framework="numpy")``) gives bf16 support, which numpy lacks (``safe_open``
raises "data type 'bfloat16' not understood" unless some other library has registered one), and
a memory bound that is easy to state: a tensor costs its own bytes, once, while it is read.
Nothing here unpickles anything.
"""

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

#: safetensors dtype -> (bytes per element, numpy dtype it is read as; bf16 is read as raw uint16).
READABLE_DTYPES = {"F32": (4, np.dtype("<f4")), "F16": (2, np.dtype("<f2")), "BF16": (2, np.dtype("<u2"))}
# A header larger than this is not a safetensors file (real ones are a few MB at most).
MAX_HEADER_BYTES = 100 * 2**20
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: ``file`` bytes ``[offset, offset + nbytes)``."""

    name: str
    dtype: str
    shape: tuple
    file: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def read_header(path: Path) -> list:
    """The tensors of one safetensors file, in file order; errors name the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path}: not a safetensors file (header length {header_len} for a file of {size} bytes)")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({err})") from None
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from None
        if not 0 <= begin <= end <= size - data_start:
            raise ValueError(
                f"{path}: tensor {name} has data_offsets [{begin}, {end}] outside the file's "
                f"{size - data_start} data bytes (truncated file?)"
            )
        entry = TensorEntry(name, dtype, shape, path, data_start + begin, end - begin)
        if dtype in READABLE_DTYPES and entry.numel * READABLE_DTYPES[dtype][0] != entry.nbytes:
            raise ValueError(
                f"{path}: tensor {name} {dtype}{list(shape)} should take "
                f"{entry.numel * READABLE_DTYPES[dtype][0]} bytes, header says {entry.nbytes}"
            )
        entries.append(entry)
    return sorted(entries, key=lambda e: e.offset)


def read_tensor(handle, entry: TensorEntry) -> np.ndarray:
    """One tensor from an open file as float32 (F32, F16, BF16; the caller rejects other dtypes)."""
    if entry.dtype not in READABLE_DTYPES:
        raise ValueError(
            f"{entry.file}: tensor {entry.name} has dtype {entry.dtype}; only {', '.join(READABLE_DTYPES)} can be read"
        )
    handle.seek(entry.offset)
    raw = np.fromfile(handle, dtype=READABLE_DTYPES[entry.dtype][1], count=entry.numel)
    if raw.size != entry.numel:
        raise ValueError(f"{entry.file}: tensor {entry.name} is truncated ({raw.size} of {entry.numel} values)")
    if entry.dtype == "BF16":
        # bf16 is the top half of an fp32: widen the bits in place of a conversion.
        widened = raw.astype(np.uint32)
        del raw
        widened <<= 16
        return widened.view(np.float32).reshape(entry.shape)
    if entry.dtype == "F16":
        return raw.astype(np.float32).reshape(entry.shape)
    return raw.reshape(entry.shape)


def read_tensor_into(handle, entry: TensorEntry, out: np.ndarray, storage: str) -> None:
    """Read one tensor of an open file into ``out`` (C-contiguous, ``entry.shape``), whose dtype is
    ``READABLE_DTYPES[storage]`` (``storage``: "F32", "F16" or "BF16", bf16 held as its raw bits).

    The same dtype is read straight into ``out``; another is converted through a temporary of the
    file's bytes (narrowing to bf16 uses one more of that size).
    """
    if entry.dtype not in READABLE_DTYPES:
        raise ValueError(
            f"{entry.file}: tensor {entry.name} has dtype {entry.dtype}; only {', '.join(READABLE_DTYPES)} can be read"
        )
    wrong_buffer = tuple(out.shape) != tuple(entry.shape) or out.dtype != READABLE_DTYPES[storage][1]
    if wrong_buffer or not out.flags.c_contiguous:
        raise ValueError(
            f"{entry.name}: cannot read {entry.dtype}{list(entry.shape)} into {out.dtype}{list(out.shape)}"
        )
    if entry.dtype == storage:
        raw = out
    else:
        raw = np.empty(entry.shape, READABLE_DTYPES[entry.dtype][1])
    handle.seek(entry.offset)
    got = handle.readinto(memoryview(raw.reshape(-1)).cast("B"))
    if got != entry.nbytes:
        raise ValueError(f"{entry.file}: tensor {entry.name} is truncated ({got} of {entry.nbytes} bytes)")
    if raw is not out:
        with np.errstate(over="ignore"):  # narrowing past the target's range gives inf, as a cast does
            _convert(raw, entry.dtype, out, storage)


def _convert(raw: np.ndarray, dtype: str, out: np.ndarray, storage: str) -> None:
    """``out[...] = raw`` between the storage dtypes (bf16 as bits: widened exactly, narrowed to nearest even).

    ``raw`` is the caller's temporary and is overwritten.
    """
    if storage == "BF16":
        wide = raw.astype(np.float32) if dtype == "F16" else raw
        bits = wide.view(np.uint32)
        bits[np.isnan(wide)] = 0x7FC00000  # a quiet NaN, which the rounding below keeps a NaN
        lowest_kept = bits >> np.uint32(16)
        lowest_kept &= np.uint32(1)
        bits += np.uint32(0x7FFF)
        bits += lowest_kept
        del lowest_kept
        bits >>= np.uint32(16)
        np.copyto(out, bits, casting="unsafe")
    elif dtype == "BF16":
        if storage == "F32":
            widened = out.view(np.uint32)
            widened[...] = raw
            widened <<= np.uint32(16)
        else:
            widened = raw.astype(np.uint32) << np.uint32(16)
            np.copyto(out, widened.view(np.float32), casting="unsafe")
    else:
        np.copyto(out, raw, casting="unsafe")  # F16 <-> F32


class ShardedWriter:
    """Writes ``(name, array)`` pairs as HF-style shards of at most ``max_shard_bytes`` each
    (one tensor larger than that gets a shard of its own); memory holds one shard at a time.

    ``close()`` names them ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` +
    ``model.safetensors.index.json``, as ``save_pretrained`` does.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int, metadata: dict = None):
        self.out_dir, self.max_shard_bytes = Path(out_dir), max_shard_bytes
        self.metadata = metadata or {"format": "pt"}
        self.pending, self.pending_bytes = {}, 0
        self.shards = []  # (temporary path, names)
        self.names = set()
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray):
        if name in self.names:
            raise ValueError(f"tensor {name} written twice")
        self.names.add(name)
        if self.pending and self.pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = np.ascontiguousarray(array)
        self.pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self):
        path = self.out_dir / f".shard-{len(self.shards):05d}.tmp"
        save_file(self.pending, str(path), metadata=self.metadata)
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def abort(self):
        """Remove the shards written so far (a failed export leaves no half directory behind)."""
        for path, _ in self.shards:
            path.unlink(missing_ok=True)
        self.shards, self.pending = [], {}

    def close(self) -> list:
        """Final file names, in order."""
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            os.replace(self.shards[0][0], self.out_dir / SINGLE_FILE)
            return [SINGLE_FILE]
        names, weight_map = [], {}
        for number, (path, tensor_names) in enumerate(self.shards, start=1):
            final = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.out_dir / final)
            names.append(final)
            weight_map.update({tensor: final for tensor in tensor_names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return names
