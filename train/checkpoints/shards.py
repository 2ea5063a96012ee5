"""Writing and loading the tensors of a checkpoint by parts, whatever the layout (:mod:`model.checkpoints.shards`).

A tensor a checkpoint holds is a ``mindspore.Parameter`` (the whole tensor, held by every rank) or a view of
a tensor split over ranks (expert shards, :class:`train.parallel.expert_parallel.ShardedState`; ZeRO moments
and ZeRO-3 parameters, :class:`train.parallel.range_views.MomentView`) with ``name``, ``shape`` (the full one),
``part = ("flat", start, stop)`` (the elements of the row-major flattened full tensor this rank holds),
``writer`` (this rank writes that part: exactly one rank of the job writes each distinct part), ``local_part()``
and ``set_part(values)``. Only these are used, so a new kind of split needs no code here.

Writing: every rank stores the parts it writes in its own file per group, and a manifest of them (shape,
dtype, element range, the file's size and sha256) that rank 0 merges into the index. Loading: every rank
reads the element range it holds from the pieces overlapping it, so a checkpoint written with any world
size, ``ep`` or ``zero`` loads into any other, and per-rank host memory is its share plus one piece.
"""

import json
import math
import os
from pathlib import Path

import numpy as np
from mindspore import Tensor
from safetensors.numpy import save_file

from mindmoe.data.prepare import file_sha256
from mindmoe.model.checkpoints.shards import GROUP_FILES, PieceReader, files_for, piece_array, piece_file, read_index
from mindmoe.model.linear import numpy_of

#: Each rank's manifest in the temporary directory; rank 0 merges and removes them.
MANIFEST = ".rank{rank:05d}.json"


class OneProcess:
    """The :class:`train.parallel.distributed.Distributed` interface checkpoints use, for one process."""

    rank = 0
    is_main = True
    active = False

    @staticmethod
    def any_rank(flag: bool) -> bool:
        return bool(flag)

    @staticmethod
    def sum_over_ranks(values):
        return np.asarray(values, dtype=np.float32)


def part_of(tensor) -> tuple:
    """``(start, stop)``: the flat element range of the full tensor that this rank holds."""
    part = getattr(tensor, "part", None)
    if part is None:
        return 0, math.prod(tensor.shape)
    kind, start, stop = part
    if kind != "flat":
        raise ValueError(f"{tensor.name}: unknown checkpoint part {part!r} (expected ('flat', start, stop))")
    return int(start), int(stop)


def writes(tensor, rank: int) -> bool:
    """A view says whether it writes its part; a whole (replicated) tensor is written by rank 0."""
    return bool(getattr(tensor, "writer", rank == 0))


def local_values(tensor) -> np.ndarray:
    return tensor.local_part() if hasattr(tensor, "local_part") else numpy_of(tensor)


def write_pieces(directory: Path, rank: int, groups: dict) -> dict:
    """Write this rank's parts of ``groups`` (``{group: tensors}``) into its files in ``directory``, fsynced;
    its manifest (also written to ``directory``) lists them with each file's size and sha256."""
    manifest = {"groups": {}, "files": {}, "sizes": {}}
    for group, tensors in groups.items():
        file = piece_file(group, rank)
        arrays, infos = {}, {}
        for tensor in tensors:
            if not writes(tensor, rank):
                continue
            start, stop = part_of(tensor)
            if stop <= start and math.prod(tensor.shape) > 0:
                continue
            values = np.asarray(local_values(tensor))
            if values.size != stop - start:
                raise ValueError(f"{tensor.name}: local part of {values.size} elements for its range {start}..{stop}")
            arrays[tensor.name] = piece_array(values, tuple(tensor.shape), start, stop)
            infos[tensor.name] = {
                "shape": [int(n) for n in tensor.shape],
                "dtype": str(values.dtype),
                "piece": [file, start, stop],
            }
        # Rank 0 always writes its files (a one-process checkpoint has both); another rank only when it owns parts.
        if not arrays and rank != 0:
            continue
        save_file(arrays, str(directory / file))
        fsync(directory / file)
        manifest["groups"][group] = infos
        manifest["files"][file] = file_sha256(directory / file)
        manifest["sizes"][file] = (directory / file).stat().st_size
    with open(directory / MANIFEST.format(rank=rank), "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return manifest


def read_manifests(directory: Path, world_size: int) -> list:
    """Every rank's manifest (rank 0, after the barrier that follows the writes), removed once read."""
    manifests = []
    for rank in range(world_size):
        path = directory / MANIFEST.format(rank=rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: rank {rank} wrote no checkpoint files here; the checkpoint directory must be on a "
                "file system every rank of the job shares"
            )
        manifests.append(json.loads(path.read_text(encoding="utf-8")))
        path.unlink()
    return manifests


def fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    descriptor = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def group_entries(directory: Path, group: str) -> dict:
    return read_index(directory).get(group, {})


def mismatch_report(tensors, shapes: dict, source: str) -> None:
    """ValueError listing every name missing, unexpected or of another shape; ``shapes``: name -> the
    checkpoint's shape of it."""
    by_name = {t.name: t for t in tensors}
    missing = sorted(set(by_name) - set(shapes))
    unexpected = sorted(set(shapes) - set(by_name))
    wrong_shape = [
        f"{name}: checkpoint {tuple(shapes[name])} vs model {tuple(by_name[name].shape)}"
        for name in sorted(set(by_name) & set(shapes))
        if tuple(shapes[name]) != tuple(by_name[name].shape)
    ]
    if missing or unexpected or wrong_shape:
        lines = [f"{source} does not match the model:"]
        lines += [f"  missing: {name}" for name in missing]
        lines += [f"  unexpected: {name}" for name in unexpected]
        lines += [f"  shape: {line}" for line in wrong_shape]
        raise ValueError("\n".join(lines))


def files_to_read(tensors, directory: Path, group: str) -> set:
    """The files this rank reads to load ``tensors`` (the ones it hash-checks)."""
    entries = group_entries(directory, group)
    return files_for(entries, {t.name: part_of(t) for t in tensors if t.name in entries})


def load_group(tensors, directory: Path, group: str) -> None:
    """Set every tensor (Parameter or view) from the pieces of ``group`` overlapping the part it holds.

    Call it before the parameters are used by a compiled graph: MindSpore 2.9 graphs keep reading their
    own copy after a later ``set_data``."""
    tensors = list(tensors)
    entries = group_entries(directory, group)
    shapes = {name: entry["shape"] for name, entry in entries.items()}
    mismatch_report(tensors, shapes, str(Path(directory) / GROUP_FILES[group]))
    reader = PieceReader(directory, entries)
    try:
        for tensor in tensors:
            start, stop = part_of(tensor)
            values = reader.read(tensor.name, start, stop)
            if hasattr(tensor, "set_part"):
                tensor.set_part(values)
            else:
                tensor.set_data(Tensor(values.reshape(tuple(tensor.shape)), dtype=tensor.dtype))
    finally:
        reader.close()
