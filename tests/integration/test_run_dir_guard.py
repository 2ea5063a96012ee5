"""A run dir has one writer and a resumed run continues only what its checkpoint was trained with (issue 22:
Found 5, 6, 10, 11). One short run of 2 steps is resumed with changed settings (refused before anything in
the run dir changes) and once allowed; the failures before training cost no compile."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from mindmoe.data.tokenizer_files import tokenizer_files
from mindmoe.train.checkpoints.checkpoint import list_checkpoints, read_state
from mindmoe.train.checkpoints.resume_checks import tokenizer_sha256
from mindmoe.train.checkpoints.run_lock import LOCK_FILE, RunDirBusy, RunLock
from tests.helpers.runs import REPO, compose_config, losses_by_step, metrics_rows
from tests.helpers.tiny_run import TINY_RUN


def tiny(data_cache, *extra):
    return compose_config([*TINY_RUN, f"data.cache_dir={data_cache}", "train.peak_gflops=100", *extra])


def run(cfg, run_dir):
    from mindmoe.train.loop import run as train

    return train(cfg, run_dir)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, data_cache):
    """A finished 2-step run with checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("guarded")
    run(tiny(data_cache, "train.max_steps=2", "train.save_every=1"), run_dir)
    return run_dir


def test_a_finished_run_releases_its_lock_and_records_what_resume_checks(two_steps):
    assert not (two_steps / LOCK_FILE).exists()
    checkpoint = list_checkpoints(two_steps / "checkpoints")[-1]
    state = read_state(checkpoint)
    assert state["seq_len"] == 64 and state["data_seed"] == 1234
    carried = checkpoint / state["tokenizer"][0]
    assert tokenizer_files(carried) == [carried] and state["tokenizer_sha256"] == tokenizer_sha256(carried)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.seq_len=32", "data.seq_len: the checkpoint was trained with 64, this run has 32"),
        ("train.seed=7", "train.seed: the checkpoint was trained with 1234, this run has 7"),
        ("model.rope_theta=500000", "model.rope_theta: the checkpoint was trained with 10000.0, this run has 500000.0"),
    ],
)
def test_resuming_with_other_settings_is_refused_naming_key_and_values(two_steps, data_cache, override, message):
    before = sorted(path.name for path in (two_steps / "checkpoints").iterdir())
    rows = (two_steps / "metrics.jsonl").read_text()
    with pytest.raises(ValueError) as caught:
        run(tiny(data_cache, "train.max_steps=3", override), two_steps)
    assert message in str(caught.value) and "train.resume_allow_changes=[" in str(caught.value)
    assert sorted(path.name for path in (two_steps / "checkpoints").iterdir()) == before
    assert (two_steps / "metrics.jsonl").read_text() == rows
    assert not (two_steps / LOCK_FILE).exists(), "the lock is released when the run fails"


def test_resuming_with_another_tokenizer_is_refused(two_steps, data_cache, tmp_path):
    other = tmp_path / "other.model"
    other.write_bytes(b"another tokenizer")
    with pytest.raises(ValueError, match=r"data.tokenizer=.*other.model: its tokenizer files differ"):
        run(tiny(data_cache, "train.max_steps=3", f"data.tokenizer={other}"), two_steps)


def test_an_allowed_change_resumes_and_rows_past_the_checkpoint_are_not_duplicated(two_steps, data_cache):
    # A crash after logging steps 3 and 4 whose checkpoints were never written (one non-finite).
    with open(two_steps / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"loss": 123.0, "step": 3}\n{"loss": NaN, "step": 4}\n')
    cfg = tiny(data_cache, "train.max_steps=3", "train.seed=7", "train.resume_allow_changes=[train.seed]")
    run(cfg, two_steps)
    steps = [row["step"] for row in metrics_rows(two_steps) if "loss" in row]
    assert steps == [1, 2, 3] and losses_by_step(two_steps)[3] != 123.0
    assert read_state(list_checkpoints(two_steps / "checkpoints")[-1])["data_seed"] == 7
    assert not (two_steps / LOCK_FILE).exists()


def test_a_held_run_dir_stops_the_trainer_before_it_writes(tmp_path, data_cache):
    with RunLock(tmp_path) as held:
        held.acquire()
        with pytest.raises(RunDirBusy, match=rf"held by pid {os.getpid()} on host {socket.gethostname()}"):
            run(tiny(data_cache, "train.max_steps=2"), tmp_path)
        assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK_FILE]
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_second_mindmoe_train_in_a_held_run_dir_fails_at_once(tmp_path, data_cache):
    with RunLock(tmp_path) as held:
        held.acquire()
        start = time.time()
        result = subprocess.run(
            [sys.executable, "-m", "mindmoe.train.cli", f"hydra.run.dir={tmp_path}", *TINY_RUN, "train.max_steps=2"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        assert f"{tmp_path / LOCK_FILE} is held by pid {os.getpid()}" in result.stderr
        assert time.time() - start < 60
        # Refused before Hydra wrote its config copy or log into the run dir.
        assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK_FILE]


def test_a_regular_file_as_run_dir_is_named(tmp_path):
    regular = tmp_path / "results.txt"
    regular.write_text("my notes")
    result = subprocess.run(
        [sys.executable, "-m", "mindmoe.train.cli", f"hydra.run.dir={regular}", "train.max_steps=2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert f"hydra.run.dir={regular}: {regular} is a file, not a directory" in result.stderr
    assert "Traceback" not in result.stderr and regular.read_text() == "my notes"


def test_seq_len_beyond_max_positions_fails_before_the_data_is_prepared(tmp_path):
    cache = tmp_path / "cache"
    cfg = tiny(cache, "data.seq_len=128", "model.max_position_embeddings=64")
    with pytest.raises(ValueError, match=r"data.seq_len=128 exceeds max_position_embeddings=64 of model.max_pos"):
        run(cfg, tmp_path / "run")
    assert not cache.exists() or not any(cache.iterdir()), "no tokenizer trained, no window packed"
