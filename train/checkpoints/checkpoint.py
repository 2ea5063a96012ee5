"""Checkpoints: a directory per step with safetensors files, written atomically.

    <run dir>/checkpoints/step_000300/
        model.safetensors       rank 0's parts of the parameters, by their model names (in one
                                process: every parameter, whole)
        model-rank00001.safetensors ...   the parts other ranks own (expert shards, ``parallel.ep``)
        optimizer.safetensors   AdamW moments (``adam_m.*``, ``adam_v.*``) and ``global_step``; other
          optimizer-rank*.safetensors     ranks' parts (expert moments, ZeRO-1 ranges) beside it
        tensors.json            the index: every tensor's shape, dtype and which file holds which
                                element range (:mod:`model.checkpoints.shards`)
        tokenizer.model         the run's tokenizer: a sentencepiece file, or a HF tokenizer's
          or tokenizer/*          files (tokenizer.json, tokenizer_config.json, ..., config.json)
        config.yaml             the run's resolved config
        state.json              step, data position, seed, model_config, tokenizer (the names of
                                its files, relative to this directory), file hashes; written last

Each rank writes only the parts it owns (:mod:`train.checkpoints.shards`), and a checkpoint written with
any world size, ``parallel.ep`` or ``parallel.zero`` loads into any other: each rank reads only the pieces
overlapping what it holds, and hash-checks only the files it reads. Rank 0's files keep the one-process
names, so a one-process checkpoint is the same files as before the index existed (and one written before
it, without ``tensors.json``, still loads).

A checkpoint carries its tokenizer and config so that it can be exported, evaluated or resumed on
another machine, with the training data's cache gone.

A checkpoint is assembled in a hidden temporary directory and renamed into place only when
complete, so a crash while saving leaves the previous checkpoints untouched and never a
half-written one under a ``step_*`` name. ``state.json`` records the size and sha256 of the other
files, so a checkpoint truncated or altered afterwards is detected before it is loaded. Which
``step_*`` directories belong to the run writing them is :mod:`train.checkpoints.lineage`'s concern.
"""

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Dict, Optional

import numpy as np
from mindspore import Tensor

from mindmoe.data.prepare import file_sha256
from mindmoe.data.tokenizer_files import read_tokenizer

# The file names and readers are shared with model/hf, whose HF export reads checkpoint directories.
from mindmoe.model.checkpoints.files import (  # noqa: F401
    CONFIG_FILE,
    MODEL_FILE,
    STATE_FILE,
    TOKENIZER_KEY,
    checkpoint_model_config,
    read_state,
)
from mindmoe.model.checkpoints.shards import INDEX_FILE, OPTIMIZER_FILE, merge_manifests, read_index  # noqa: F401
from mindmoe.model.linear import numpy_of
from mindmoe.train.checkpoints.lineage import move_aside, step_dirs, step_of, temporary_dir
from mindmoe.train.checkpoints.shards import (
    OneProcess,
    files_to_read,
    fsync,
    fsync_dir,
    load_group,
    mismatch_report,
    read_manifests,
    write_pieces,
)

#: ``state.json`` key: the size in bytes of each file of ``files``, checked without hashing.
SIZES_KEY = "file_sizes"

log = logging.getLogger("mindmoe.train")


def parameters_to_numpy(params) -> dict:
    """Name -> array; a bf16 parameter (a half frozen base) is saved as fp32, exactly, and cast back on load."""
    return {p.name: numpy_of(p) for p in params}


def load_parameters(params, tensors: dict, source: str) -> None:
    """Copy ``tensors`` into ``params`` by name; every name and shape must match exactly.

    MindSpore's own ``strict_load`` does not report missing or unexpected names, so the
    check is done here and lists every mismatch. Call it before the parameters are used by a
    compiled graph: MindSpore 2.9 graphs keep reading their own copy after a later ``set_data``.
    """
    params = list(params)
    by_name = {p.name: p for p in params}
    mismatch_report(params, {name: array.shape for name, array in tensors.items()}, source)
    for name, array in tensors.items():
        param = by_name[name]
        param.set_data(Tensor(array, dtype=param.dtype))


@dataclasses.dataclass(frozen=True)
class CarriedFiles:
    """What a checkpoint carries besides its tensors so it can be used elsewhere: the tokenizer (relative
    name -> bytes, as :func:`data.tokenizer_files.read_tokenizer` reads it) and the resolved config."""

    tokenizer: Dict[str, bytes]
    config_yaml: Optional[str] = None

    @classmethod
    def of_run(cls, tokenizer_path, config_yaml: Optional[str] = None) -> "CarriedFiles":
        return cls(read_tokenizer(tokenizer_path), config_yaml)

    def write(self, directory: Path) -> list:
        """Write the files into ``directory``; the relative names written."""
        files = dict(self.tokenizer)
        if self.config_yaml is not None:
            files[CONFIG_FILE] = self.config_yaml.encode("utf-8")
        for name, content in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(content)
        return list(files)


def save_checkpoint(
    checkpoint_root: Path,
    step: int,
    model_params,
    optimizer_params,
    state: dict,
    keep_last: int,
    write_extra=None,
    carried: Optional[CarriedFiles] = None,
    dist=None,
) -> Path:
    """Write ``step_{step:06d}`` under ``checkpoint_root`` atomically and prune to ``keep_last``
    (:func:`prune_checkpoints`). Every rank of ``dist`` (None: one process) calls it: each writes the parts it
    owns (:mod:`train.checkpoints.shards`) into one shared temporary directory; after a barrier rank 0 writes
    the index, the rest and ``state.json``, and renames the directory into place.

    ``write_extra(directory) -> [relative file names]`` adds files (hashed like the others), e.g. a
    LoRA run's PEFT adapter; ``carried`` adds the tokenizer (named in ``state.json`` ``tokenizer``) and
    ``config.yaml``; both run on rank 0 only, after the index is written. A ``step_*`` directory of the same
    name (which :func:`train.checkpoints.lineage.settle_lineage` makes impossible in a training run) is moved aside,
    never deleted."""
    dist = dist or OneProcess()
    final = checkpoint_root / f"step_{step:06d}"
    tmp = _shared_temporary_dir(checkpoint_root, step, dist)
    error = None
    try:
        write_pieces(tmp, dist.rank, {"model": list(model_params), "optimizer": list(optimizer_params)})
    except Exception as caught:  # every rank must reach the barrier, or the others would wait forever
        error = caught
    if dist.any_rank(error is not None):
        raise error or RuntimeError(f"checkpoint of step {step}: another rank failed to write its part")
    if dist.is_main:
        try:
            _finish_checkpoint(tmp, final, step, state, dist, write_extra, carried)
            prune_checkpoints(checkpoint_root, keep_last, final)
        except Exception as caught:
            error = caught
    # Every rank returns once the checkpoint is in place (or every rank raises).
    if dist.any_rank(error is not None):
        raise error or RuntimeError(f"checkpoint of step {step}: rank 0 failed to complete it")
    return final


def _shared_temporary_dir(checkpoint_root: Path, step: int, dist) -> Path:
    """Rank 0 creates the temporary directory, named by its pid; the others learn the pid (a barrier too:
    below 2**24, exact in the float32 sum)."""
    pid = 0
    if dist.is_main:
        checkpoint_root.mkdir(parents=True, exist_ok=True)
        tmp = temporary_dir(checkpoint_root, step)
        # The name carries this process's pid: one left by an earlier process with the same pid is stale.
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        pid = os.getpid()
    pid = int(dist.sum_over_ranks(np.array([pid]))[0]) if dist.active else os.getpid()
    return checkpoint_root / f".step_{step:06d}.tmp-{pid}"


def _finish_checkpoint(tmp: Path, final: Path, step: int, state: dict, dist, write_extra, carried) -> None:
    """Rank 0: the index from every rank's manifest, the extra and carried files, ``state.json`` last; fsync
    everything, rename into place, fsync the parent directory."""
    manifests = read_manifests(tmp, getattr(dist, "world_size", 1))
    with open(tmp / INDEX_FILE, "w", encoding="utf-8") as handle:
        json.dump({"format": 1, "groups": merge_manifests(manifests)}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    # Each rank hashed the files it wrote; rank 0 hashes only its own and the small files.
    files, sizes = {}, {}
    for manifest in manifests:
        files.update(manifest["files"])
        sizes.update(manifest["sizes"])
    names = [INDEX_FILE] + (list(write_extra(tmp)) if write_extra else [])
    if carried is not None:
        names += carried.write(tmp)
        state = dict(state, **{TOKENIZER_KEY: sorted(carried.tokenizer)})
    for name in names:
        fsync(tmp / name)
        files[name] = file_sha256(tmp / name)
        sizes[name] = (tmp / name).stat().st_size
    with open(tmp / STATE_FILE, "w", encoding="utf-8") as handle:
        json.dump(dict(state, step=step, files=files, **{SIZES_KEY: sizes}), handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(tmp)
    if final.exists():
        move_aside(final.parent, [final], f"a checkpoint of step {step} is being written again")
    os.replace(tmp, final)
    fsync_dir(final.parent)


def prune_checkpoints(checkpoint_root: Path, keep_last: int, newest: Path) -> list:
    """Delete the oldest checkpoints before ``newest`` (the one just written) so that ``keep_last``
    remain, ``newest`` included; the deleted directories. ``keep_last`` <= 0 keeps all.

    Only checkpoints that pass :func:`check_complete` count and only they are deleted: an incomplete or
    truncated one is reported and left in place, so a corrupt checkpoint never pushes a good one out.
    Hashes are not recomputed here (that would re-read every kept checkpoint at each save); they are
    checked when a checkpoint is resumed, and :func:`train.checkpoints.lineage.settle_lineage` has moved aside the
    newer ones that failed then. ``newest`` and everything after it are never deleted: the step
    directories that remain older than ``newest`` are its lineage (:mod:`train.checkpoints.lineage`).
    """
    if keep_last <= 0:
        return []
    older_complete = []
    for path in step_dirs(checkpoint_root):
        if step_of(path) >= step_of(newest):
            continue
        try:
            check_complete(path)
        except CorruptCheckpointError as error:
            log.warning("%s; not counted toward train.keep_last and not deleted", error)
            continue
        older_complete.append(path)
    doomed = older_complete[: max(0, len(older_complete) - (keep_last - 1))]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


class CorruptCheckpointError(ValueError):
    """A checkpoint that is incomplete (no ``state.json``, a listed file missing) or whose files do not
    match the sizes or hashes recorded when it was written."""


def check_complete(checkpoint_dir: Path) -> dict:
    """What can be checked without hashing: ``state.json`` is there and readable, and every file it lists
    exists with its recorded size (when recorded: checkpoints written before sizes were have only names).
    Raise :class:`CorruptCheckpointError` naming the checkpoint and every problem; the recorded hashes."""
    if not (checkpoint_dir / STATE_FILE).is_file():
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint_dir} is incomplete: it has no {STATE_FILE} (written last: its save did not "
            "finish, or the directory was copied in part)"
        )
    try:
        state = read_state(checkpoint_dir)
        expected, sizes = dict(state["files"]), dict(state.get(SIZES_KEY, {}))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(f"checkpoint {checkpoint_dir}: unreadable {STATE_FILE} ({error})") from error
    problems = []
    for name in sorted(expected):
        path = checkpoint_dir / name
        if not path.is_file():
            problems.append(f"{name} (listed in {STATE_FILE}) is missing")
        elif name in sizes and path.stat().st_size != sizes[name]:
            problems.append(
                f"{name} does not match its recorded size ({path.stat().st_size} bytes, {sizes[name]} recorded: "
                "truncated or modified)"
            )
    if problems:
        raise CorruptCheckpointError(f"checkpoint {checkpoint_dir}: " + "; ".join(problems))
    return expected


def verify_checkpoint(checkpoint_dir: Path, names=None) -> None:
    """Raise :class:`CorruptCheckpointError` naming every file that is missing or altered: the sizes of all,
    then the hashes of ``names`` (None: every file)."""
    expected = check_complete(checkpoint_dir)
    if names is not None:
        unknown = sorted(set(names) - set(expected))
        if unknown:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint_dir}: {', '.join(unknown)} not listed in {STATE_FILE}"
            )
        expected = {name: expected[name] for name in names}
    problems = [
        f"{name} does not match its recorded sha256 (truncated or modified)"
        for name, digest in sorted(expected.items())
        if file_sha256(checkpoint_dir / name) != digest
    ]
    if problems:
        raise CorruptCheckpointError(f"checkpoint {checkpoint_dir}: " + "; ".join(problems))


def list_checkpoints(checkpoint_root: Path) -> list:
    """The ``step_*`` directories under ``checkpoint_root`` that have a ``state.json``, oldest first
    (:func:`train.checkpoints.lineage.step_dirs` lists the incomplete ones too)."""
    return [path for path in step_dirs(checkpoint_root) if (path / STATE_FILE).is_file()]


def resolve_checkpoint(path: str) -> Path:
    """Accept a checkpoint directory or one of its ``.safetensors`` files; fail clearly otherwise."""
    candidate = Path(path).expanduser()
    if candidate.is_file() and candidate.suffix == ".safetensors":
        candidate = candidate.parent
    if not (candidate / MODEL_FILE).is_file():
        raise FileNotFoundError(
            f"checkpoint {path}: no {MODEL_FILE} found (expected a checkpoint directory "
            f"such as <run dir>/checkpoints/step_000300)"
        )
    return candidate


def load_model_weights(model_params, checkpoint_dir: Path, dist=None) -> None:
    """Load the model tensors; with ``dist`` (a job of several ranks), each rank first hash-checks the files it
    reads (the caller verified every file otherwise, :func:`verify_checkpoint`)."""
    _load(model_params, checkpoint_dir, "model", dist)


def load_optimizer_state(optimizer_params, checkpoint_dir: Path, dist=None) -> None:
    _load(optimizer_params, checkpoint_dir, "optimizer", dist)


def _load(tensors, checkpoint_dir: Path, group: str, dist) -> None:
    tensors = list(tensors)
    if dist is None or not dist.active:
        load_group(tensors, checkpoint_dir, group)
        return
    error = None
    try:
        verify_files_read(checkpoint_dir, tensors, group)
    except CorruptCheckpointError as caught:
        error = caught
    # Every rank stops if one found a corrupt file (it hashed only what it reads).
    if dist.any_rank(error is not None):
        raise error or CorruptCheckpointError(f"checkpoint {checkpoint_dir}: another rank found a corrupt file")
    load_group(tensors, checkpoint_dir, group)


def verify_files_read(checkpoint_dir: Path, tensors, group: str, also=()) -> None:
    """Hash-check what loading ``tensors`` of ``group`` reads: the index first (it says which files hold what)
    and the listed files ``also``, then the ``.safetensors`` holding their pieces; every listed file's size."""
    first = {INDEX_FILE} if (checkpoint_dir / INDEX_FILE).is_file() else set()
    verify_checkpoint(checkpoint_dir, sorted(first | set(also)))
    verify_checkpoint(checkpoint_dir, sorted(files_to_read(tensors, checkpoint_dir, group)))


def checkpoint_groups(checkpoint_dir: Path) -> dict:
    """``{group: {name: entry}}`` of the tensors a checkpoint holds (:func:`model.checkpoints.shards.read_index`)."""
    return read_index(checkpoint_dir)
