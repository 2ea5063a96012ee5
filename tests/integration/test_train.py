"""End-to-end behaviour of mindmoe-train on the bundled corpus (a few steps, shared run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor
from omegaconf import OmegaConf

from tests.helpers.runs import compose_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def short_run(tmp_path_factory, data_cache):
    """40 optimizer steps of the default recipe; shared by the tests below."""
    from mindmoe.train.loop import run

    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_config(
        [
            "train.max_steps=40",
            "train.log_every=5",
            "train.eval_every=0",
            "train.save_every=20",
            "train.eval_batches=4",
            "train.progress_bar=false",
            f"data.cache_dir={data_cache}",
        ]
    )
    summary = run(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, run_dir, summary, rows


def test_forty_steps_lower_training_loss_by_half_a_nat(short_run):
    _, _, _, rows = short_run
    train_rows = [row for row in rows if "loss" in row]
    assert train_rows[0]["step"] == 5 and train_rows[-1]["step"] == 40
    assert train_rows[0]["lm_loss"] - train_rows[-1]["lm_loss"] >= 0.5


def test_metrics_rows_carry_required_fields(short_run):
    _, _, _, rows = short_run
    train_rows = [row for row in rows if "loss" in row]
    val_rows = [row for row in rows if "val_loss" in row]
    required = {
        "step",
        "loss",
        "lm_loss",
        "aux_loss",
        "z_loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "load_imbalance",
        "dropped_assignments",
    }
    for row in train_rows:
        assert required <= set(row)
        assert len(row["load_imbalance"]) == 3  # tiny_moe: 4 layers, first one dense
        assert all(value >= 1.0 for value in row["load_imbalance"])
        assert len(row["dropped_assignments"]) == 3 and all(value >= 0 for value in row["dropped_assignments"])
        assert 0 < row["mfu"] < 1
    assert val_rows and all("loss" not in row for row in val_rows)


def test_checkpoint_reload_gives_identical_logits(short_run):
    from mindmoe.model.config import ModelConfig
    from mindmoe.model.transformer import MoETransformer
    from mindmoe.train.checkpoints.checkpoint import list_checkpoints, load_model_weights, read_state

    _, run_dir, _, _ = short_run
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert [path.name for path in checkpoints] == ["step_000020", "step_000040"]  # keep_last 2, last step
    state = read_state(checkpoints[-1])
    model_cfg = ModelConfig(**state["model_config"])
    trained = MoETransformer(model_cfg, seed=0)
    load_model_weights(list(trained.get_parameters()), checkpoints[-1])
    reloaded = MoETransformer(model_cfg, seed=1)
    load_model_weights(list(reloaded.get_parameters()), checkpoints[-1])
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, model_cfg.vocab_size, (2, 32)).astype(np.int32))
    docs = Tensor(np.repeat(np.array([[0] * 20 + [1] * 12], np.int32), 2, 0))
    np.testing.assert_array_equal(trained(ids, docs)[0].asnumpy(), reloaded(ids, docs)[0].asnumpy())
    fresh = MoETransformer(model_cfg, seed=1)
    assert not np.allclose(fresh(ids, docs)[0].asnumpy(), reloaded(ids, docs)[0].asnumpy())


def test_checkpoint_of_another_architecture_is_rejected_by_name(short_run):
    from mindmoe.model.config import ModelConfig
    from mindmoe.model.transformer import MoETransformer
    from mindmoe.train.checkpoints.checkpoint import list_checkpoints, load_model_weights, read_state

    _, run_dir, _, _ = short_run
    checkpoint = list_checkpoints(run_dir / "checkpoints")[-1]
    config = dict(read_state(checkpoint)["model_config"], num_experts=4, qkv_bias=False)
    other = MoETransformer(ModelConfig(**config), seed=0)
    with pytest.raises(ValueError) as error:
        load_model_weights(list(other.get_parameters()), checkpoint)
    message = str(error.value)
    assert "unexpected: layers.0.self_attn.q_proj.bias" in message
    assert "shape: layers.1.mlp.router.weight: checkpoint (8, 192) vs model (4, 192)" in message


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mindmoe.train.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HYDRA_FULL_ERROR="0"),
    )


def test_unknown_override_fails_naming_the_key():
    result = run_cli("model.nonexistent=1")
    assert result.returncode != 0
    assert "model.nonexistent" in result.stderr + result.stdout


def test_override_of_wrong_type_fails_naming_the_key():
    result = run_cli("train.max_steps=many")
    assert result.returncode != 0
    assert "train.max_steps" in result.stderr + result.stdout


def test_invalid_model_value_fails_naming_the_key():
    cfg = compose_config(["model.top_k=9"])
    from mindmoe.model.config import validate_model_config

    with pytest.raises(ValueError, match=r"model.top_k=9: cannot exceed model.num_experts=8"):
        validate_model_config(OmegaConf.to_object(cfg.model))


def test_plain_overrides_compose():
    cfg = compose_config(["train.max_steps=5", "model.num_experts=4", "model.top_k=1", "data.seq_len=64"])
    assert (cfg.train.max_steps, cfg.model.num_experts, cfg.model.top_k, cfg.data.seq_len) == (5, 4, 1, 64)
    assert Path(cfg.data.train_files[0]).is_file()
