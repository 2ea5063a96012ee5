"""Failures and recovery: exact resume after SIGKILL, SIGTERM checkpoints, corrupt checkpoints,
non-finite steps. Runs go through the real ``mindmoe-train`` entry point in subprocesses."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.config import ModelConfig
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.checkpoints.checkpoint import CorruptCheckpointError, list_checkpoints, save_checkpoint
from mindmoe.train.checkpoints.resume import pick_resume_checkpoint
from mindmoe.train.config import TrainConfig
from mindmoe.train.optim import build_optimizer
from mindmoe.train.step import CompiledStep
from tests.helpers.runs import losses_by_step

REPO = Path(__file__).resolve().parents[2]
# Long enough that a kill or SIGTERM sent after an early checkpoint lands while training still runs.
MAX_STEPS = 20
SMALL_RUN = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=128",
    "model.moe_intermediate_size=32",
    "model.num_experts=4",
    "data.seq_len=32",
    "data.global_batch_size=4",
    "data.micro_batch_size=4",
    f"train.max_steps={MAX_STEPS}",
    "train.log_every=1",
    "train.save_every=1",
    "train.keep_last=3",
    "train.eval_every=0",
    "train.progress_bar=false",
    "train.peak_gflops=100",
    "data.valid_files=[]",  # training losses are compared: no evaluation graph to compile
]


def train_command(run_dir, data_cache, *extra):
    return [
        sys.executable,
        "-m",
        "mindmoe.train.cli",
        f"hydra.run.dir={run_dir}",
        f"data.cache_dir={data_cache}",
        *SMALL_RUN,
        *extra,
    ]


def checkpoint_steps(root: Path):
    return [int(path.name.split("_")[1]) for path in list_checkpoints(root)] if root.exists() else []


def wait_for_checkpoint(root: Path, step: int, process, timeout=600):
    """Until a checkpoint of ``step`` or later exists (older ones are pruned by train.keep_last)."""
    start = time.time()
    while not any(s >= step for s in checkpoint_steps(root)):
        assert process.poll() is None, f"training exited early:\n{process.stderr.read()}"
        assert time.time() - start < timeout, f"no checkpoint of step >= {step} in {root}"
        time.sleep(0.05)
    return max(checkpoint_steps(root))


def test_sigkill_then_sigterm_then_resume_reproduces_the_uninterrupted_losses(tmp_path, data_cache, processes):
    # The uninterrupted run is independent of the other: it trains while the other is killed and stopped.
    uninterrupted_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "interrupted"
    with (tmp_path / "uninterrupted.log").open("w") as log:  # a file: nobody reads a pipe meanwhile
        reference = subprocess.Popen(train_command(uninterrupted_dir, data_cache), cwd=REPO, stdout=log, stderr=log)
    processes.append(reference)
    killed = subprocess.Popen(
        train_command(run_dir, data_cache), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_checkpoint(run_dir / "checkpoints", 3, killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    killed_after = max(checkpoint_steps(run_dir / "checkpoints"))
    assert killed_after < MAX_STEPS, "the kill must land before the run ends"

    terminated = subprocess.Popen(
        train_command(run_dir, data_cache), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_checkpoint(run_dir / "checkpoints", killed_after + 2, terminated)
    terminated.send_signal(signal.SIGTERM)
    _, stderr = terminated.communicate(timeout=120)
    assert terminated.returncode == 3, stderr
    assert "received SIGTERM: checkpoint of step" in stderr and "train.resume=auto" in stderr
    stopped_at = list_checkpoints(run_dir / "checkpoints")[-1]
    assert stopped_at.name in stderr

    subprocess.run(train_command(run_dir, data_cache), cwd=REPO, check=True, capture_output=True, timeout=900)
    assert reference.wait(timeout=900) == 0, (tmp_path / "uninterrupted.log").read_text()[-3000:]
    uninterrupted = losses_by_step(uninterrupted_dir)
    resumed = losses_by_step(run_dir)
    assert sorted(resumed) == list(range(1, MAX_STEPS + 1)) == sorted(uninterrupted)
    # Bit-identical on one CPU process: same data position, optimizer state, LR step and weights.
    assert resumed == uninterrupted


def test_truncated_checkpoint_is_detected_and_previous_is_used_when_configured(tmp_path):
    model = MoETransformer(
        ModelConfig(
            vocab_size=32,
            hidden_size=16,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=16,
            first_k_dense=1,
        ),
        seed=0,
    )
    params = list(model.get_parameters())
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, params, params[:1], {"note": "test"}, keep_last=3)
    newest = root / "step_000002" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match=r"step_000002: model.safetensors does not match"):
        pick_resume_checkpoint("auto", root, "error")
    assert pick_resume_checkpoint("auto", root, "previous").name == "step_000001"


def test_a_save_killed_midway_leaves_the_previous_checkpoint_the_newest(tmp_path):
    model = MoETransformer(
        ModelConfig(
            vocab_size=32,
            hidden_size=16,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=16,
            first_k_dense=1,
        ),
        seed=0,
    )
    params = list(model.get_parameters())
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, params, params[:1], {}, keep_last=3)
    # What a kill during the save of step 2 leaves behind: a temporary directory, half written.
    partial = root / ".step_000002.tmp-4242"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 100)
    assert [path.name for path in list_checkpoints(root)] == ["step_000001"]
    assert pick_resume_checkpoint("auto", root, "error").name == "step_000001"


def test_non_finite_step_is_skipped_without_touching_weights_or_optimizer_state():
    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=16,
        moe_intermediate_size=8,
        num_experts=4,
        first_k_dense=1,
    )
    model = MoETransformer(cfg, seed=0)
    optimizer = build_optimizer(model.trainable_params(), TrainConfig(max_steps=10, warmup_ratio=0.0))
    trainer = CompiledStep(model, optimizer, grad_clip=1.0, accum_steps=1)
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 32, (2, 9)).astype(np.int32), "doc_ids": np.zeros((2, 9), np.int32)}
    # Poisoned before the step is compiled: MindSpore 2.9 graphs do not see a later set_data.
    poisoned = model.norm.weight
    poisoned.set_data(Tensor(np.full(poisoned.shape, np.nan, np.float32)))
    before = {p.name: p.asnumpy().copy() for p in model.trainable_params()}
    moments = [m.asnumpy().copy() for m in optimizer.exp_avg]
    step_before = optimizer.global_step.asnumpy().copy()
    stats = trainer.step([batch])
    assert stats.skipped and not np.isfinite(stats.loss)
    for param in model.trainable_params():
        np.testing.assert_array_equal(param.asnumpy(), before[param.name])
    for moment, previous in zip(optimizer.exp_avg, moments):
        np.testing.assert_array_equal(moment.asnumpy(), previous)
    np.testing.assert_array_equal(optimizer.global_step.asnumpy(), step_before)


def test_diverging_run_stops_after_max_bad_steps_with_a_clear_error(tmp_path, data_cache):
    result = subprocess.run(
        train_command(
            tmp_path, data_cache, "train.lr=1e30", "train.warmup_ratio=0", "train.grad_clip=0", "train.max_bad_steps=2"
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 2
    assert "consecutive steps" in result.stderr and "train.max_bad_steps=2" in result.stderr
