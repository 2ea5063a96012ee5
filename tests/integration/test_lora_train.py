"""``mindmoe-train recipe=lora_business`` for a few steps on the bundled base and SFT sample: the
trainable-parameter report, adapters-only checkpoints with a PEFT copy, and resuming (which must
reload the frozen base, since checkpoints do not hold it, and continue the dropout masks: a run killed
with SIGKILL and resumed logs the losses of the uninterrupted run, which it could not without the base)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mindmoe.model.lora.peft_adapter import read_adapter_config
from mindmoe.train.checkpoints.checkpoint import list_checkpoints, verify_checkpoint
from mindmoe.train.checkpoints.resume import DROPOUT_DRAWS
from tests.helpers.base_checkpoint import save_tiny_base_checkpoint
from tests.helpers.runs import compose_config, losses_by_step

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
# The kill test: checkpoints at 3 and 6, the kill once step 4 is logged, so steps 4.. are run again.
KILL_STEPS, KILL_SAVE_EVERY, KILL_AFTER_LOGGED = 6, 3, 4


def overrides(cache, steps):
    return [
        "recipe=lora_business",
        f"train.max_steps={steps}",
        "train.save_every=2",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=2",
        "train.progress_bar=false",
        f"data.cache_dir={cache}",
        # Shorter windows keep the test quick; the longer conversations are cut (and counted).
        "data.seq_len=128",
        "data.sft_overlong=truncate",
    ]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, data_cache):
    from mindmoe.train.loop import run

    run_dir = tmp_path_factory.mktemp("lora_run")
    summary = run(compose_config(overrides(data_cache, STEPS)), run_dir)
    return run_dir, summary


def test_run_reports_the_trainable_share_and_the_base_validation_loss(lora_run):
    _, summary = lora_run
    assert 0 < summary["trainable_share"] < 0.2
    assert summary["trainable_params"] > 0
    assert np.isfinite(summary["base_val_loss"]) and np.isfinite(summary["final_val_loss"])


def test_checkpoints_hold_only_the_adapters_and_their_optimizer_state_plus_a_peft_copy(lora_run):
    run_dir, summary = lora_run
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    verify_checkpoint(checkpoint)  # the adapter files are covered by the recorded hashes
    state = json.loads((checkpoint / "state.json").read_text())
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= set(state["files"])
    model = load_file(str(checkpoint / "model.safetensors"))
    assert model and all(name.endswith((".lora_A", ".lora_B")) for name in model)
    assert sum(t.size for t in model.values()) == summary["trainable_params"]
    assert any(".mlp.experts." in name for name in model), "routed experts must be adapted"
    optimizer = load_file(str(checkpoint / "optimizer.safetensors"))
    moments = {name.split(".", 1)[1] for name in optimizer if name.startswith(("adam_m.", "adam_v."))}
    assert moments == set(model)
    peft = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    assert all(name.startswith("base_model.model.model.layers.") and ".lora_" in name for name in peft)
    assert sum(t.size for t in peft.values()) == summary["trainable_params"]
    config = read_adapter_config(checkpoint / "adapter")
    assert (config.r, config.alpha) == (8, 16.0)


def train_command(run_dir, cache):
    # Overrides go through the real entry point; the recipe's lora.dropout (0.05) stays in force.
    run_overrides = [o for o in overrides(cache, KILL_STEPS) if not o.startswith("train.save_every")]
    return [
        sys.executable,
        "-m",
        "mindmoe.train.cli",
        f"hydra.run.dir={run_dir}",
        f"train.save_every={KILL_SAVE_EVERY}",
        *run_overrides,
        "data.valid_files=[]",  # the training losses are compared: no validation before or after
    ]


def wait_for_logged_step(run_dir: Path, step: int, process, timeout=900):
    start = time.time()
    while not any(s >= step for s in (losses_by_step(run_dir) if (run_dir / "metrics.jsonl").exists() else {})):
        assert process.poll() is None, f"training exited early (its log is beside {run_dir})"
        assert time.time() - start < timeout, f"step {step} never logged in {run_dir}"
        time.sleep(0.05)


def test_sigkill_between_checkpoints_then_resume_reloads_the_base_and_reproduces_the_uninterrupted_losses(
    tmp_path, data_cache, processes
):
    assert compose_config(overrides(data_cache, KILL_STEPS)).lora.dropout > 0, "the test is about dropout masks"
    uninterrupted_dir, interrupted_dir = tmp_path / "uninterrupted", tmp_path / "interrupted"
    # The two runs are independent: the uninterrupted one trains while the other is started and killed.
    uninterrupted_log = tmp_path / "uninterrupted.log"
    with uninterrupted_log.open("w") as log:  # a file, not a pipe nobody reads while the other run is watched
        uninterrupted_run = subprocess.Popen(
            train_command(uninterrupted_dir, data_cache), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
    processes.append(uninterrupted_run)
    killed_log = tmp_path / "interrupted.log"
    with killed_log.open("w") as log:  # a pipe nobody reads while the run is watched could fill and stall it
        killed = subprocess.Popen(
            train_command(interrupted_dir, data_cache), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True
        )
    processes.append(killed)
    wait_for_logged_step(interrupted_dir, KILL_AFTER_LOGGED, killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    logged = max(losses_by_step(interrupted_dir))
    saved = [int(path.name.split("_")[1]) for path in list_checkpoints(interrupted_dir / "checkpoints")]
    assert saved and max(saved) < logged < KILL_STEPS, f"the kill must land between checkpoints: {saved}, {logged}"
    state = json.loads((list_checkpoints(interrupted_dir / "checkpoints")[-1] / "state.json").read_text())
    assert state[DROPOUT_DRAWS] == max(saved), "one draw per step (one micro-batch per step)"

    subprocess.run(train_command(interrupted_dir, data_cache), cwd=REPO, check=True, capture_output=True)
    assert uninterrupted_run.wait(timeout=900) == 0, uninterrupted_log.read_text()[-3000:]
    uninterrupted = losses_by_step(uninterrupted_dir)
    resumed = losses_by_step(interrupted_dir)
    assert sorted(resumed) == list(range(1, KILL_STEPS + 1)) == sorted(uninterrupted)
    # Bit-identical: the resumed steps draw the dropout masks of the uninterrupted run, on the pretrained base
    # reloaded from lora.base_checkpoint (the checkpoint holds only the adapters).
    assert resumed == uninterrupted


def test_base_checkpoint_gives_the_architecture_and_weights_of_a_mindmoe_checkpoint(tmp_path, monkeypatch):
    """One model is built: the checkpoint's architecture with the adapters in place, its weights in the
    base, parameter names those of the checkpoint plus ``<projection>.lora_A/B``."""
    from mindmoe.model import transformer
    from mindmoe.model.transformer import MoETransformer
    from mindmoe.train.init_model import build_model, planned_model_config
    from mindmoe.train.lora_setup import lora_run_for

    base_cfg, base, saved = save_tiny_base_checkpoint(tmp_path, 5)
    cfg = compose_config([f"lora.base_checkpoint={saved}", "lora.enabled=true", "lora.r=2", "model.hidden_size=32"])
    assert planned_model_config(cfg) == base_cfg
    built = []
    plain_init = MoETransformer.__init__

    def counted_init(self, *args, **kwargs):
        built.append(self)
        plain_init(self, *args, **kwargs)

    monkeypatch.setattr(transformer.MoETransformer, "__init__", counted_init)
    model_cfg, model = build_model(cfg, vocab_size=64)
    assert built == [model] and model_cfg.hidden_size == 16
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    adapters = {name for name in weights if name.endswith((".lora_A", ".lora_B"))}
    assert set(weights) - adapters == {p.name for p in base.get_parameters()}
    assert adapters and all(
        name.rsplit(".", 1)[0] + ".weight" in weights or name.rsplit(".", 1)[0] in weights for name in adapters
    )
    for param in base.get_parameters():
        # The frozen base is stored in lora.base_dtype (auto: fp16 on CPU): the checkpoint's values, rounded.
        loaded = weights[param.name]
        np.testing.assert_array_equal(loaded, param.asnumpy().astype(loaded.dtype), err_msg=param.name)
    assert {weights[name].dtype for name in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight")} == {
        np.dtype("float16")
    }
    lora_run = lora_run_for(cfg, model_cfg, model)
    assert lora_run.report.trainable == sum(p.size for p in model.trainable_params()) > 0
    assert {p.name for p in model.trainable_params()} == adapters

    with pytest.raises(ValueError, match="lora.base_checkpoint is set but lora.enabled=false"):
        build_model(compose_config([f"lora.base_checkpoint={saved}"]), 64)
