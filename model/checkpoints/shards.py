"""The tensors of a checkpoint written in pieces: its index and reading any part of a tensor.

Every rank of a job writes the parts of tensors it owns into its own files (``train/checkpoints/shards.py``);
``tensors.json`` records, per group (``model``, ``optimizer``), each tensor's global shape, dtype and pieces:

    {"format": 1, "groups": {"model": {"layers.0.mlp.experts.up_proj":
        {"shape": [8, 32, 16], "dtype": "float32",
         "pieces": [["model.safetensors", 0, 2048], ["model-rank00001.safetensors", 2048, 4096]]}, ...}}}

A piece ``[file, start, stop]`` holds the elements ``start .. stop - 1`` of the row-major flattened tensor
under the tensor's name in ``file``: shaped as whole rows when it covers whole rows (so a one-process file is
an ordinary safetensors file of full tensors), else flat. A reader asks for the element range it holds and
reads only the pieces overlapping it, and of those only the rows it needs (``safe_open(...).get_slice``).

A checkpoint written before the index existed (one ``model.safetensors`` / ``optimizer.safetensors`` of full
tensors) reads as an index of one piece per tensor, built from the files' headers. Nothing here needs MindSpore.
"""

import json
import math
from pathlib import Path
from typing import Dict, Iterable, Iterator, Tuple

import numpy as np
from safetensors import safe_open

from mindmoe.model.checkpoints.files import MODEL_FILE

#: The index of the pieces (written by rank 0 after every rank wrote its files, before ``state.json``).
INDEX_FILE = "tensors.json"
OPTIMIZER_FILE = "optimizer.safetensors"
#: The groups of tensors and the file rank 0 writes for each; rank r > 0 writes ``<group>-rank{r:05d}.safetensors``.
GROUP_FILES = {"model": MODEL_FILE, "optimizer": OPTIMIZER_FILE}


def piece_file(group: str, rank: int) -> str:
    """Rank 0 keeps the one-process names, so a one-process checkpoint is the files it always was."""
    return GROUP_FILES[group] if rank == 0 else f"{group}-rank{rank:05d}.safetensors"


def row_size(shape) -> int:
    """Elements per row of axis 0 (1 for a scalar)."""
    return math.prod(shape[1:]) if len(shape) else 1


def piece_array(values: np.ndarray, shape, start: int, stop: int) -> np.ndarray:
    """The stored form of the elements ``start .. stop - 1`` of a tensor of ``shape``: whole rows keep their shape."""
    values = np.ascontiguousarray(values)
    if start == 0 and stop == math.prod(shape):
        return values.reshape(shape)
    rows = row_size(shape)
    if len(shape) and start % rows == 0 and stop % rows == 0:
        return values.reshape(((stop - start) // rows,) + tuple(shape[1:]))
    return values.reshape(-1)


def read_index(directory: Path) -> dict:
    """``{group: {name: {"shape", "dtype", "pieces"}}}`` of a checkpoint directory (an older one's from its headers)."""
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():
        with open(directory / INDEX_FILE, encoding="utf-8") as handle:
            return json.load(handle)["groups"]
    groups = {}
    for group, name in GROUP_FILES.items():
        if (directory / name).is_file():
            groups[group] = single_file_entries(directory / name)
    return groups


def single_file_entries(path: Path) -> dict:
    """Index entries of a file of whole tensors (header only: no tensor is read)."""
    entries = {}
    with safe_open(str(path), framework="numpy") as handle:
        for name in handle.keys():
            tensor = handle.get_slice(name)
            shape = [int(n) for n in tensor.get_shape()]
            entries[name] = {
                "shape": shape,
                "dtype": _numpy_dtype(tensor.get_dtype()),
                "pieces": [[path.name, 0, math.prod(shape)]],
            }
    return entries


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32"}
_SAFETENSORS_DTYPES.update({"I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"})


def _numpy_dtype(code: str) -> str:
    return _SAFETENSORS_DTYPES.get(code, code.lower())


def files_for(entries: dict, ranges: Dict[str, Tuple[int, int]]) -> set:
    """The files holding any element of ``ranges`` (``{name: (start, stop)}``)."""
    return {
        file
        for name, (start, stop) in ranges.items()
        for file, first, last in entries[name]["pieces"]
        if first < stop and start < last
    }


class PieceReader:
    """Reads element ranges of the tensors of one group, opening each file once (closed by :meth:`close`)."""

    def __init__(self, directory: Path, entries: dict):
        self.directory = Path(directory)
        self.entries = entries
        self._open = {}

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = safe_open(str(self.directory / file), framework="numpy")
        return self._open[file]

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """The elements ``start .. stop - 1`` of the flattened tensor ``name``, a flat array."""
        entry = self.entries[name]
        out = np.empty(stop - start, dtype=entry["dtype"])
        filled = 0
        rows = row_size(entry["shape"])
        for file, first, last in entry["pieces"]:
            lo, hi = max(start, first), min(stop, last)
            if lo >= hi:
                continue
            stored = self._handle(file).get_slice(name)
            if len(stored.get_shape()) > 1:
                # Whole rows: read the rows covering [lo, hi) and cut.
                row0, row1 = (lo - first) // rows, -(-(hi - first) // rows)
                block = stored[row0:row1].reshape(-1)
                values = block[lo - first - row0 * rows : hi - first - row0 * rows]
            elif len(stored.get_shape()) == 1:
                values = stored[lo - first : hi - first].reshape(-1)
            else:
                values = self._handle(file).get_tensor(name).reshape(-1)
            out[lo - start : hi - start] = values
            filled += hi - lo
        if filled != stop - start:
            raise ValueError(f"{self.directory}: the pieces of {name} do not cover elements {start}..{stop - 1}")
        return out

    def full(self, name: str) -> np.ndarray:
        shape = self.entries[name]["shape"]
        return self.read(name, 0, math.prod(shape)).reshape(shape)

    def close(self) -> None:
        self._open.clear()


def read_tensors(
    directory: Path, group: str = "model", names: Iterable[str] = None
) -> Iterator[Tuple[str, np.ndarray]]:
    """``(name, full array)`` of the tensors of ``group`` (all, or ``names``), one at a time."""
    entries = read_index(directory).get(group, {})
    reader = PieceReader(directory, entries)
    try:
        for name in entries if names is None else names:
            yield name, reader.full(name)
    finally:
        reader.close()


def merge_manifests(manifests: list) -> dict:
    """The index ``groups`` from every rank's manifest (``{group: {name: {"shape", "dtype", "piece"}}}``),
    checking that each tensor's pieces agree on shape and dtype and cover it exactly once."""
    groups: dict = {}
    for manifest in manifests:
        for group, tensors in manifest["groups"].items():
            for name, info in tensors.items():
                entry = groups.setdefault(group, {}).setdefault(
                    name, {"shape": info["shape"], "dtype": info["dtype"], "pieces": []}
                )
                if entry["shape"] != info["shape"] or entry["dtype"] != info["dtype"]:
                    raise ValueError(f"{name}: ranks disagree on its shape or dtype ({entry} vs {info})")
                entry["pieces"].append(info["piece"])
    for tensors in groups.values():
        for name, entry in tensors.items():
            entry["pieces"].sort(key=lambda piece: piece[1])
            covered = 0
            for _, first, last in entry["pieces"]:
                if first != covered:
                    raise ValueError(f"{name}: its written parts do not tile it (elements from {covered} vs {first})")
                covered = last
            if covered != math.prod(entry["shape"]):
                raise ValueError(f"{name}: its written parts end at element {covered} of {math.prod(entry['shape'])}")
    return groups


def model_files(directory: Path) -> list:
    """The files holding the model's tensors (``model.safetensors`` alone in one process)."""
    entries = read_index(directory).get("model", {})
    return sorted({piece[0] for entry in entries.values() for piece in entry["pieces"]}) or [MODEL_FILE]
