"""MindRecord shards of packed windows: writing them once, and reading them in
a seeded, resumable order split across data-parallel ranks.

Order. Each epoch has its own permutation of all windows, computed in NumPy
from ``(seed, epoch)``. Global batch ``s`` of an epoch is permutation entries
``[s*G, (s+1)*G)``; rank ``r`` of ``W`` takes the ``r``-th contiguous slice of
``G/W`` of them and feeds it as ``G/(W*micro)`` micro-batches. So ranks see
disjoint windows, their union is exactly the global batch a single process
would see, and the order depends only on the step, which makes resuming from
a step exact. The last ``num_windows % G`` windows of each permutation are
left out of that epoch (different ones each epoch).

Reading uses ``MindDataset`` with a ``SubsetSampler`` over this rank's indices
for the rest of the epoch, rebuilt once per epoch; MindSpore's own shuffling
and sharding are not used because they cannot resume mid-epoch.
"""

import logging
import re
from pathlib import Path
from typing import Dict, Iterator, List, Sequence

import mindspore.dataset as msd
import numpy as np
from mindspore.mindrecord import FileWriter

from mindmoe.data.cache_entry import MANIFEST, entry_damage
from mindmoe.data.packing import PackedWindows
from mindmoe.data.reader import DataInputError

logger = logging.getLogger(__name__)

COLUMNS = ["input_ids", "doc_ids"]
#: Written only by SFT data (``PackedWindows.loss_mask``): which tokens may be scored as labels.
LOSS_MASK = "loss_mask"
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}, "doc_ids": {"type": "int32", "shape": [-1]}}


def write_shards(windows: PackedWindows, out_dir: Path, prefix: str, shard_windows: int) -> List[str]:
    """Write ``windows`` in order into ``<prefix>-NNNNN.mindrecord`` files of at most
    ``shard_windows`` windows; returns the file names (relative to ``out_dir``)."""
    names = []
    for shard, start in enumerate(range(0, len(windows), shard_windows)):
        names.append(shard_name(prefix, shard))
        write_shard(windows.take(np.arange(start, min(start + shard_windows, len(windows)))), Path(out_dir) / names[-1])
    return names


def shard_name(prefix: str, shard: int) -> str:
    return f"{prefix}-{shard:05d}.mindrecord"


def write_shard(windows: PackedWindows, path: Path) -> None:
    """One MindRecord file holding ``windows`` (at least one), in order."""
    writer = FileWriter(str(path), shard_num=1)
    # The defaults (16 MB header, 32 MB pages) make every shard a >50 MB sparse
    # file; a page only has to hold a window, with room to spare.
    window_bytes = windows.input_ids[0].nbytes + windows.doc_ids[0].nbytes
    writer.set_header_size(1 << 20)
    writer.set_page_size(min(1 << 28, max(1 << 20, 2 * window_bytes)))
    has_mask = windows.loss_mask is not None
    writer.add_schema(dict(SCHEMA, **({LOSS_MASK: SCHEMA["input_ids"]} if has_mask else {})), "packed token windows")
    writer.write_raw_data(
        [
            dict(
                {"input_ids": windows.input_ids[i], "doc_ids": windows.doc_ids[i]},
                **({LOSS_MASK: windows.loss_mask[i]} if has_mask else {}),
            )
            for i in range(len(windows))
        ]
    )
    writer.commit()


def unreadable_shards(shard_files: Sequence[str], error: RuntimeError) -> DataInputError:
    """The error for shards MindSpore failed on, naming the damaged file when the cache entry's
    ``files.json`` tells which (MindSpore's own message often names none)."""
    # The "Dataset Pipeline Error Message" part, without MindSpore's banners and C++ call stack.
    reason = re.search(r"\[ERROR\] (?:\[Internal ERROR\] )?(.*?)(?:\n-{10}|\Z)", str(error), re.S)
    reason = " ".join((reason.group(1) if reason else str(error)).split())
    entry = Path(shard_files[0]).parent
    if not (entry / MANIFEST).is_file():
        return DataInputError(f"MindRecord shards {', '.join(map(str, shard_files))} cannot be read: {reason}")
    damage = entry_damage(entry)
    return DataInputError(
        f"MindRecord shards of the data cache entry {entry} cannot be read ({reason})"
        + (f": {damage}; the next run rebuilds the entry" if damage else f"; delete {entry} to have it rebuilt")
    )


def count_windows(shard_files: Sequence[str]) -> int:
    try:
        return msd.MindDataset(list(shard_files), columns_list=COLUMNS, shuffle=False).get_dataset_size()
    except RuntimeError as err:
        raise unreadable_shards(shard_files, err) from None


def _read(
    shard_files: Sequence[str], columns: List[str], indices: np.ndarray, batch_size: int
) -> Iterator[Dict[str, np.ndarray]]:
    """Windows ``indices`` (positions in the concatenated shards), in that order, in batches of ``columns``."""
    if len(indices) == 0:
        return
    # One worker keeps memory low; order is fixed by the sampler either way.
    try:
        dataset = msd.MindDataset(
            list(shard_files), columns_list=columns, num_parallel_workers=1, sampler=msd.SubsetSampler(indices.tolist())
        )
        dataset = dataset.batch(batch_size, drop_remainder=False)
        # A shard cut short opens fine and fails here, with a message naming no file.
        for row in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1):
            yield dict(zip(columns, row))
    except RuntimeError as err:
        raise unreadable_shards(shard_files, err) from None


def shard_columns(shard_files: Sequence[str]) -> List[str]:
    """``COLUMNS``, plus ``loss_mask`` for shards of SFT data."""
    try:
        names = msd.MindDataset(list(shard_files), shuffle=False).get_col_names()
    except RuntimeError as err:
        raise unreadable_shards(shard_files, err) from None
    return COLUMNS + ([LOSS_MASK] if LOSS_MASK in names else [])


class WindowLoader:
    """Endless micro-batches of this rank, epoch after epoch, starting at ``start_step``.

    Yields ``{"input_ids", "doc_ids"}``, int32 ``[micro_batch_size, seq_len + 1]``;
    ``accumulation_steps`` consecutive micro-batches make this rank's part of one
    global batch. ``step`` counts the global batches fully yielded (including
    ``start_step``): save it with a checkpoint and pass it back as ``start_step``.
    """

    def __init__(
        self,
        shard_files: Sequence[str],
        micro_batch_size: int,
        global_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        start_step: int = 0,
    ):
        if global_batch_size % (micro_batch_size * world_size):
            raise ValueError(
                f"data.global_batch_size={global_batch_size} must be a multiple of "
                f"data.micro_batch_size={micro_batch_size} x data-parallel size {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside data-parallel size {world_size}")
        self.shard_files = list(shard_files)
        self.columns = shard_columns(self.shard_files)
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.step = start_step
        self.num_windows = count_windows(self.shard_files)
        self.steps_per_epoch = self.num_windows // global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training data has {self.num_windows} windows, fewer than one global batch "
                f"(data.global_batch_size={global_batch_size}); add data or lower data.seq_len"
            )
        self.accumulation_steps = global_batch_size // (micro_batch_size * world_size)
        self._batches = self._generate()

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All window indices in the order of ``epoch`` (same on every rank)."""
        if not self.shuffle:
            return np.arange(self.num_windows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def rank_indices(self, epoch: int, first_step: int) -> np.ndarray:
        """This rank's window indices for steps ``first_step..`` of ``epoch``, in feeding order."""
        per_rank = self.global_batch_size // self.world_size
        steps = self.epoch_order(epoch)[: self.steps_per_epoch * self.global_batch_size]
        by_step = steps.reshape(self.steps_per_epoch, self.world_size, per_rank)
        return by_step[first_step:, self.rank].reshape(-1)

    def state(self) -> Dict[str, int]:
        return {"step": self.step, "epoch": self.step // self.steps_per_epoch, "seed": self.seed}

    def __iter__(self) -> "WindowLoader":
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        return next(self._batches)

    def _generate(self) -> Iterator[Dict[str, np.ndarray]]:
        while True:
            epoch, first_step = divmod(self.step, self.steps_per_epoch)
            logger.debug("rank %d: epoch %d from step %d", self.rank, epoch, first_step)
            indices = self.rank_indices(epoch, first_step)
            for number, batch in enumerate(_read(self.shard_files, self.columns, indices, self.micro_batch_size), 1):
                if number % self.accumulation_steps == 0:
                    self.step += 1
                yield batch


class EvalLoader:
    """Every validation window once per iteration, in file order, split across ranks.

    Evaluation batch ``b`` holds windows ``[b*B*W, (b+1)*B*W)``; rank ``r`` gets
    the ``r``-th slice of ``B = batch_size``. The last batch is filled up with
    padding windows in which every token is its own document (``doc_ids``
    ``0..L-1``, token id 0): they have no scored label and, placed last, cannot
    displace real tokens from expert capacity. So the loss covers exactly the
    label positions the unigram baseline of ``prepare_data`` is computed on,
    every batch keeps the compiled shape, and all ranks run the same number of
    batches. ``max_batches > 0`` stops early; ``evaluated_windows`` counts the
    real windows scored.
    """

    def __init__(
        self, shard_files: Sequence[str], batch_size: int, rank: int = 0, world_size: int = 1, max_batches: int = 0
    ):
        self.shard_files = list(shard_files)
        self.columns = shard_columns(self.shard_files)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_windows = count_windows(self.shard_files)
        per_batch = batch_size * world_size
        self.num_batches = -(-self.num_windows // per_batch)
        if max_batches > 0:
            self.num_batches = min(self.num_batches, max_batches)
        self.evaluated_windows = min(self.num_windows, self.num_batches * per_batch)
        first = next(_read(self.shard_files, self.columns, np.zeros(1, np.int64), 1))
        self.window_length = first["input_ids"].shape[1]

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        positions = np.arange(self.num_batches * self.batch_size * self.world_size)
        positions = positions.reshape(self.num_batches, self.world_size, self.batch_size)[:, self.rank].reshape(-1)
        real = _read(self.shard_files, self.columns, positions[positions < self.num_windows], self.batch_size)
        for _ in range(self.num_batches):
            yield self._filled(next(real, None))

    def _filled(self, batch) -> Dict[str, np.ndarray]:
        missing = self.batch_size - (0 if batch is None else len(batch["input_ids"]))
        if missing == 0:
            return batch
        padding = {
            "input_ids": np.zeros((missing, self.window_length), np.int32),
            "doc_ids": np.tile(np.arange(self.window_length, dtype=np.int32), (missing, 1)),
            LOSS_MASK: np.zeros((missing, self.window_length), np.int32),
        }
        if batch is None:
            return {name: padding[name] for name in self.columns}
        return {name: np.concatenate([batch[name], padding[name]]) for name in batch}
