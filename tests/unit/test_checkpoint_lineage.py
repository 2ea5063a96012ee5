"""Checkpoint lineage, incomplete checkpoints, keep_last and stale temporary directories, on small
checkpoints written by the real ``save_checkpoint``.

The rule under test (``train/checkpoints/lineage.py``): a run resuming from ``step_s`` of its own run dir moves the
newer ``step_*`` directories to ``checkpoints/abandoned-<UTC time>/``; any other start moves all of them;
nothing is deleted except verified older checkpoints of the lineage (``train.keep_last``) and temporary
directories of dead writers.
"""

import logging
import subprocess
import sys

import numpy as np
import pytest
from mindspore import Parameter, Tensor

from mindmoe.conf.exit_codes import CONFIG_ERROR, exit_status
from mindmoe.train.checkpoints.checkpoint import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    CorruptCheckpointError,
    check_complete,
    save_checkpoint,
)
from mindmoe.train.checkpoints.lineage import ABANDONED_PREFIX, settle_lineage
from mindmoe.train.checkpoints.resume import pick_resume_checkpoint


class FakeDist:
    """The two things ``settle_lineage`` uses of ``train.parallel.distributed.Distributed``; records what the
    checkpoint root held when the barrier was reached."""

    def __init__(self, root, rank=0):
        self.root, self.is_main, self.seen_at_barrier = root, rank == 0, None

    def any_rank(self, flag):
        self.seen_at_barrier = names(self.root)
        return flag


def names(root):
    return sorted(path.name for path in root.iterdir()) if root.is_dir() else []


def save(root, step, keep_last=10):
    params = [Parameter(Tensor(np.full(4, step, np.float32)), name="w")]
    moments = [Parameter(Tensor(np.zeros(2, np.float32)), name="adam_m.w")]
    return save_checkpoint(root, step, params, moments, {"note": "test"}, keep_last)


def abandoned(root):
    """{abandoned dir name: [its step dirs]}."""
    return {path.name: names(path) for path in root.iterdir() if path.name.startswith(ABANDONED_PREFIX)}


def snapshot(directory):
    return {path.name: path.read_bytes() for path in directory.iterdir()}


@pytest.fixture
def root(tmp_path):
    return tmp_path / "checkpoints"


def test_resuming_an_older_checkpoint_moves_the_newer_aside_and_auto_continues_its_lineage(root, caplog):
    # Found 1: a 6-step run (save_every=2, keep_last=3) resumed from step 2 to step 3 with keep_last=1.
    for step in (2, 4, 6):
        save(root, step, keep_last=3)
    newer = {step: snapshot(root / f"step_{step:06d}") for step in (4, 6)}
    chosen = pick_resume_checkpoint(str(root / "step_000002"), root, "error")
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        settle_lineage(root, chosen, FakeDist(root))
    (moved_to,) = abandoned(root)
    assert abandoned(root) == {moved_to: ["step_000004", "step_000006"]}
    assert "step_000004, step_000006" in caplog.text and moved_to in caplog.text
    for step, files in newer.items():
        assert snapshot(root / moved_to / f"step_{step:06d}") == files

    save(root, 3, keep_last=1)
    # The run's own last checkpoint survives; the verified older one of its lineage is pruned.
    assert [name for name in names(root) if name.startswith("step_")] == ["step_000003"]
    assert abandoned(root) == {moved_to: ["step_000004", "step_000006"]}
    assert pick_resume_checkpoint("auto", root, "error") == root / "step_000003"


@pytest.mark.parametrize("start", ["none", "another directory"])
def test_a_new_lineage_moves_every_step_dir_aside_so_no_save_overwrites_one(root, tmp_path, start):
    for step in (1, 2):
        save(root, step)
    before = snapshot(root / "step_000002")
    resume_from = None if start == "none" else save(tmp_path / "elsewhere", 7)
    settle_lineage(root, resume_from, FakeDist(root))
    (moved_to,) = abandoned(root)
    assert names(root) == [moved_to] and names(root / moved_to) == ["step_000001", "step_000002"]
    save(root, 2, keep_last=1)
    assert snapshot(root / moved_to / "step_000002") == before
    assert names(root / "step_000002") == names(root / moved_to / "step_000002")


def test_only_rank_zero_moves_directories_and_only_after_the_barrier(root):
    for step in (1, 2):
        save(root, step)
    other_rank = FakeDist(root, rank=1)
    settle_lineage(root, None, other_rank)
    assert other_rank.seen_at_barrier == names(root) == ["step_000001", "step_000002"]
    main = FakeDist(root)
    settle_lineage(root, None, main)
    assert main.seen_at_barrier == ["step_000001", "step_000002"]
    assert not [name for name in names(root) if name.startswith("step_")]


def test_auto_never_resumes_an_abandoned_checkpoint(root):
    save(root, 9)
    settle_lineage(root, None, FakeDist(root))
    assert pick_resume_checkpoint("auto", root, "error") is None
    save(root, 3)
    assert pick_resume_checkpoint("auto", root, "error") == root / "step_000003"


def _drop_state(checkpoint):
    (checkpoint / STATE_FILE).unlink()
    return STATE_FILE


def _drop_listed_file(checkpoint):
    (checkpoint / OPTIMIZER_FILE).unlink()
    return OPTIMIZER_FILE


@pytest.mark.parametrize("damage", [_drop_state, _drop_listed_file])
def test_an_incomplete_checkpoint_is_an_error_naming_it_or_skipped_with_a_warning(root, damage, caplog):
    save(root, 1)
    newest = save(root, 2)
    missing = damage(newest)
    for resume in ("auto", str(newest)):
        with pytest.raises(CorruptCheckpointError, match=rf"step_000002.*{missing}") as raised:
            pick_resume_checkpoint(resume, root, "error")
        assert exit_status(raised.value) == (CONFIG_ERROR, "error")
    assert "train.on_corrupt_checkpoint=previous" in str(
        pytest.raises(CorruptCheckpointError, pick_resume_checkpoint, "auto", root, "error").value
    )
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        assert pick_resume_checkpoint("auto", root, "previous") == root / "step_000001"
    assert "step_000002" in caplog.text and missing in caplog.text


def test_the_only_checkpoint_without_state_json_under_previous_starts_fresh_and_keeps_its_files(root, caplog):
    # Found 4: before, it was skipped silently and the fresh run's save of the same step deleted it.
    only = save(root, 2)
    _drop_state(only)
    files = snapshot(only)
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        chosen = pick_resume_checkpoint("auto", root, "previous")
        settle_lineage(root, chosen, FakeDist(root))
    assert chosen is None
    assert "step_000002 is incomplete: it has no state.json" in caplog.text
    save(root, 2, keep_last=1)
    (moved_to,) = abandoned(root)
    assert snapshot(root / moved_to / "step_000002") == files


def test_keep_last_counts_only_checkpoints_that_verify_and_never_deletes_a_corrupt_one(root, caplog):
    for step in (1, 2, 3, 4):
        save(root, step)
    truncated = root / "step_000003" / MODEL_FILE
    truncated.write_bytes(truncated.read_bytes()[:-8])
    _drop_state(root / "step_000004")
    with pytest.raises(
        CorruptCheckpointError, match=r"step_000003: model.safetensors does not match its recorded size"
    ):
        check_complete(root / "step_000003")
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        save(root, 5, keep_last=2)
    # Before: the newest two by step number (4, 5) were kept and the valid step 2 deleted.
    assert [name for name in names(root) if name.startswith("step_")] == [
        "step_000002",
        "step_000003",
        "step_000004",
        "step_000005",
    ]
    assert "step_000003" in caplog.text and "not counted toward train.keep_last" in caplog.text


def test_stale_temporary_dirs_of_dead_processes_are_removed_and_a_live_ones_kept(root, caplog):
    save(root, 1)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (dead_pid, live.pid):
            partial = root / f".step_000002.tmp-{pid}"
            partial.mkdir()
            (partial / MODEL_FILE).write_bytes(b"\x00" * 10)
        with caplog.at_level(logging.INFO, logger="mindmoe.train"):
            settle_lineage(root, root / "step_000001", FakeDist(root))
        assert names(root) == [f".step_000002.tmp-{live.pid}", "step_000001"]
        assert f".step_000002.tmp-{dead_pid}" in caplog.text and "no longer running" in caplog.text
        assert f"tmp-{live.pid}" not in caplog.text
    finally:
        live.kill()
        live.wait()
