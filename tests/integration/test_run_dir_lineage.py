"""A run dir keeps every checkpoint a run did not create: resuming an older checkpoint moves the newer
ones to ``checkpoints/abandoned-*`` and ``train.resume=auto`` continues the resumed lineage (issue 22,
Found 1); a checkpoint without ``state.json`` stops the run naming it, or with
``train.on_corrupt_checkpoint=previous`` is moved aside, not overwritten (Found 4)."""

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mindmoe.model.checkpoints.files import STATE_FILE, read_state
from mindmoe.train.checkpoints.lineage import ABANDONED_PREFIX
from mindmoe.train.checkpoints.resume import pick_resume_checkpoint
from tests.helpers.runs import compose_config
from tests.helpers.tiny_run import TINY_RUN

REPO = Path(__file__).resolve().parents[2]


def run_in_process(run_dir, data_cache, *extra):
    from mindmoe.train.loop import run

    return run(compose_config([*TINY_RUN, f"data.cache_dir={data_cache}", *extra]), run_dir)


def contents(root):
    """{name: sorted entries} of the directories in ``root``, and of those under ``abandoned-*``."""
    found = {}
    for path in sorted(root.iterdir()):
        found[path.name] = sorted(entry.name for entry in path.iterdir())
    return found


def files_of(directory):
    return {path.name: path.read_bytes() for path in directory.iterdir()}


@pytest.fixture(scope="module")
def six_step_run(tmp_path_factory, data_cache):
    """Checkpoints 2, 4, 6 (save_every=2, keep_last=3), and a copy of step 2 without its state.json."""
    run_dir = tmp_path_factory.mktemp("six_steps")
    run_in_process(run_dir, data_cache, "train.max_steps=6", "train.save_every=2", "train.keep_last=3")
    incomplete = tmp_path_factory.mktemp("incomplete") / "checkpoints" / "step_000002"
    shutil.copytree(run_dir / "checkpoints" / "step_000002", incomplete)
    (incomplete / STATE_FILE).unlink()
    return run_dir, incomplete


def test_resuming_an_older_checkpoint_keeps_the_newer_ones_and_its_own_final_one(six_step_run, data_cache, caplog):
    run_dir, _ = six_step_run
    root = run_dir / "checkpoints"
    assert sorted(path.name for path in root.iterdir()) == ["step_000002", "step_000004", "step_000006"]
    newest_weights = (root / "step_000006" / "model.safetensors").read_bytes()
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        summary = run_in_process(
            run_dir, data_cache, f"train.resume={root / 'step_000002'}", "train.max_steps=3", "train.keep_last=1"
        )
    assert summary["steps"] == 3
    layout = contents(root)
    (moved_to,) = [name for name in layout if name.startswith(ABANDONED_PREFIX)]
    # step 2 is pruned by keep_last=1 (a verified older checkpoint of this lineage); 4 and 6 are kept aside.
    assert sorted(layout) == sorted([moved_to, "step_000003"])
    assert layout[moved_to] == ["step_000004", "step_000006"]
    assert (root / moved_to / "step_000006" / "model.safetensors").read_bytes() == newest_weights
    assert "moved step_000004, step_000006 aside" in caplog.text
    resumed = pick_resume_checkpoint("auto", root, "error")
    assert resumed == root / "step_000003" and read_state(resumed)["step"] == 3


def test_the_only_checkpoint_without_state_json_is_an_error_or_moved_aside(six_step_run, data_cache, caplog):
    _, incomplete = six_step_run
    run_dir, original = incomplete.parents[1], files_of(incomplete)
    stopped = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindmoe.train.cli",
            f"hydra.run.dir={run_dir}",
            f"data.cache_dir={data_cache}",
            *TINY_RUN,
            "train.max_steps=2",
            "train.save_every=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stopped.returncode == 2, stopped.stderr
    assert f"checkpoint {incomplete} is incomplete: it has no state.json" in stopped.stderr
    assert "train.on_corrupt_checkpoint=previous" in stopped.stderr
    assert files_of(incomplete) == original

    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        run_in_process(
            run_dir, data_cache, "train.max_steps=2", "train.save_every=2", "train.on_corrupt_checkpoint=previous"
        )
    assert "step_000002 is incomplete" in caplog.text and "starting from step 0" in caplog.text
    layout = contents(run_dir / "checkpoints")
    (moved_to,) = [name for name in layout if name.startswith(ABANDONED_PREFIX)]
    # The fresh run wrote its own step_000002; the incomplete one is kept, byte for byte.
    assert STATE_FILE in layout["step_000002"]
    assert files_of(run_dir / "checkpoints" / moved_to / "step_000002") == original
