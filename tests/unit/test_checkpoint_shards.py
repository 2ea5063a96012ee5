"""Checkpoints written in parts by several ranks (train/checkpoints/shards.py), read back as other partitions.

Two ranks are simulated by two threads sharing a barrier: the real save protocol runs (shared temporary
directory, each rank's files, rank 0's index and state.json), and the loads are checked against the NumPy
arrays the "ranks" held, whole and split differently (rows of ep=2, flat halves and thirds of ZeRO)."""

import json
import math
import threading

import numpy as np
import pytest
from mindspore import Parameter, Tensor
from safetensors import safe_open

import mindmoe.train.checkpoints.checkpoint as checkpoint
from mindmoe.model.checkpoints.shards import INDEX_FILE, read_tensors
from mindmoe.train.checkpoints.checkpoint import (
    CorruptCheckpointError,
    load_model_weights,
    load_optimizer_state,
    save_checkpoint,
    verify_checkpoint,
)

RNG = np.random.default_rng(0)
EXPERTS = RNG.standard_normal((4, 3, 5)).astype(np.float32)  # an [E, ...] tensor split by rows
MOMENT = RNG.standard_normal((7, 3)).astype(np.float32)  # 21 elements: flat parts not on row boundaries
DENSE = RNG.standard_normal((6,)).astype(np.float32)  # replicated: rank 0 writes it


class Part:
    """A view of the elements ``start .. stop - 1`` of a full tensor (the attributes ShardedState/MomentView have)."""

    def __init__(self, name, full, start, stop, writer=True):
        self.name, self.shape, self.dtype = name, full.shape, None
        self.part = ("flat", start, stop)
        self.writer = writer
        self.values = full.reshape(-1)[start:stop].copy()

    def local_part(self):
        return self.values

    def set_part(self, values):
        assert np.asarray(values).size == self.part[2] - self.part[1]
        self.values = np.asarray(values).reshape(-1).copy()


def rows(name, full, rank, ranks):
    per = full.shape[0] // ranks * math.prod(full.shape[1:])
    return Part(name, full, rank * per, (rank + 1) * per)


def flat(name, full, rank, ranks):
    size = -(-full.size // ranks)
    return Part(name, full, min(rank * size, full.size), min((rank + 1) * size, full.size))


class ThreadRanks:
    """``Distributed``'s checkpoint interface for ``world_size`` threads: any_rank / sum_over_ranks are barriers."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.values = [None] * world_size

    def rank_view(self, rank):
        shared = self

        class Rank:
            active = True
            world_size = shared.world_size

            def __init__(self):
                self.rank, self.is_main = rank, rank == 0

            def sum_over_ranks(self, values):
                shared.values[rank] = np.asarray(values, np.float32)
                shared.barrier.wait()
                total = np.sum(shared.values, axis=0)
                shared.barrier.wait()
                return total

            def any_rank(self, flag):
                return bool(self.sum_over_ranks(np.array([float(flag)]))[0] > 0)

        return Rank()


def run_ranks(world_size, work):
    """``work(rank, dist)`` on ``world_size`` threads; re-raises the first failure."""
    ranks, errors = ThreadRanks(world_size), []

    def target(rank):
        try:
            work(rank, ranks.rank_view(rank))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
            ranks.barrier.abort()

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]


def save_as_two_ranks(root):
    """ep=2 rows of EXPERTS, ZeRO flat halves of MOMENT, DENSE replicated (rank 0 writes it)."""

    def work(rank, dist):
        model = [rows("experts", EXPERTS, rank, 2), Part("dense", DENSE, 0, DENSE.size, writer=rank == 0)]
        optimizer = [flat("adam_m.experts", MOMENT, rank, 2)]
        save_checkpoint(root, 3, model, optimizer, {"note": "test"}, keep_last=0, dist=dist)

    run_ranks(2, work)
    return root / "step_000003"


def test_each_rank_writes_only_its_parts_and_the_index_tiles_every_tensor(tmp_path):
    directory = save_as_two_ranks(tmp_path)
    names = sorted(path.name for path in directory.iterdir())
    assert names == [
        "model-rank00001.safetensors",
        "model.safetensors",
        "optimizer-rank00001.safetensors",
        "optimizer.safetensors",
        "state.json",
        INDEX_FILE,
    ]
    with safe_open(str(directory / "model-rank00001.safetensors"), framework="numpy") as handle:
        assert list(handle.keys()) == ["experts"]  # the replicated tensor only on rank 0
        np.testing.assert_array_equal(handle.get_tensor("experts"), EXPERTS[2:])
    with safe_open(str(directory / "optimizer.safetensors"), framework="numpy") as handle:
        np.testing.assert_array_equal(handle.get_tensor("adam_m.experts"), MOMENT.reshape(-1)[:11])
    index = json.loads((directory / INDEX_FILE).read_text())["groups"]
    assert index["model"]["experts"]["pieces"] == [
        ["model.safetensors", 0, 30],
        ["model-rank00001.safetensors", 30, 60],
    ]
    verify_checkpoint(directory)
    assert dict(read_tensors(directory, "model"))["experts"].tolist() == EXPERTS.tolist()


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_parts_load_into_another_partition_and_as_whole_parameters(tmp_path, ranks):
    directory = save_as_two_ranks(tmp_path)
    for rank in range(ranks):
        # Rows saved, flat parts loaded (a ZeRO layout); flat halves (0..10, 11..20) saved, other ranges loaded.
        experts = flat("experts", EXPERTS, rank, ranks)
        moment = flat("adam_m.experts", MOMENT, rank, ranks)
        if ranks == 2:  # the same split as saved would not cross a piece boundary
            moment = Part("adam_m.experts", MOMENT, rank * 10, 10 + rank * 11)
        dense = Part("dense", DENSE, 0, DENSE.size)
        load_model_weights([experts, dense], directory)
        load_optimizer_state([moment], directory)
        np.testing.assert_array_equal(experts.values, EXPERTS.reshape(-1)[slice(*experts.part[1:])])
        np.testing.assert_array_equal(moment.values, MOMENT.reshape(-1)[slice(*moment.part[1:])])
        np.testing.assert_array_equal(dense.values, DENSE)
    whole = Parameter(Tensor(np.zeros_like(EXPERTS)), name="experts")
    load_model_weights([whole, Parameter(Tensor(np.zeros_like(DENSE)), name="dense")], directory)
    np.testing.assert_array_equal(whole.asnumpy(), EXPERTS)


def test_a_one_process_checkpoint_and_one_without_an_index_load(tmp_path):
    params = [Parameter(Tensor(EXPERTS), name="experts"), Parameter(Tensor(DENSE), name="dense")]
    directory = save_checkpoint(tmp_path, 1, params, params[1:], {}, keep_last=0)
    with safe_open(str(directory / "model.safetensors"), framework="numpy") as handle:
        assert sorted(handle.keys()) == ["dense", "experts"]  # whole tensors: the one-process file as before
    (directory / INDEX_FILE).unlink()  # what a checkpoint written before the index looks like
    part = rows("experts", EXPERTS, 1, 2)
    part.values[:] = 0
    load_model_weights([part, Part("dense", DENSE, 0, 6)], directory)
    np.testing.assert_array_equal(part.values, EXPERTS[2:].reshape(-1))


def load_as_rank(directory, tensors, hashed):
    """Load ``tensors`` as a rank of a two-rank job, recording the files it hashes."""

    class Job:
        active = True

        @staticmethod
        def any_rank(flag):
            return bool(flag)

    original = checkpoint.file_sha256

    def recording(path):
        hashed.append(path.name)
        return original(path)

    checkpoint.file_sha256 = recording
    try:
        load_model_weights(tensors, directory, Job())
    finally:
        checkpoint.file_sha256 = original


def test_a_rank_hashes_only_the_files_it_reads_and_a_bad_piece_is_named(tmp_path):
    directory = save_as_two_ranks(tmp_path)
    hashed = []
    load_as_rank(directory, [rows("experts", EXPERTS, 0, 2), Part("dense", DENSE, 0, 6)], hashed)
    assert sorted(hashed) == ["model.safetensors", INDEX_FILE]
    # Altered in place (same size): only the rank reading it finds out, and the message names the file.
    other = directory / "model-rank00001.safetensors"
    data = bytearray(other.read_bytes())
    data[-1] ^= 0xFF
    other.write_bytes(bytes(data))
    load_as_rank(directory, [rows("experts", EXPERTS, 0, 2), Part("dense", DENSE, 0, 6)], [])
    with pytest.raises(CorruptCheckpointError, match=r"model-rank00001.safetensors does not match its recorded sha256"):
        load_as_rank(directory, [rows("experts", EXPERTS, 1, 2), Part("dense", DENSE, 0, 6)], [])
    other.write_bytes(bytes(data[:-10]))
    with pytest.raises(CorruptCheckpointError, match=r"model-rank00001.safetensors does not match its recorded size"):
        verify_checkpoint(directory, [])
    other.unlink()
    with pytest.raises(
        CorruptCheckpointError, match=r"model-rank00001.safetensors \(listed in state.json\) is missing"
    ):
        verify_checkpoint(directory, [])


def test_a_rank_failing_to_write_fails_every_rank_and_leaves_no_step_directory(tmp_path):
    def work(rank, dist):
        model = [rows("experts", EXPERTS, rank, 2)]
        if rank == 1:
            model[0].values = model[0].values[:-1]  # a part of the wrong size
        save_checkpoint(tmp_path, 5, model, [], {}, keep_last=0, dist=dist)

    with pytest.raises(Exception, match="experts: local part of 29 elements|another rank failed"):
        run_ranks(2, work)
    assert not list(tmp_path.glob("step_*"))
