"""Resume compatibility (issue 22, Found 5) and metrics.jsonl hygiene (Found 10): a resumed run is checked
against what its checkpoint's state.json records; metrics rows past the resumed step are dropped; every
row is strict JSON."""

import dataclasses
import hashlib
import json
import logging
import math

import pytest

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe_config import MoEConfig
from mindmoe.train.checkpoints.resume_checks import (
    TOKENIZER_LABEL,
    architecture,
    check_resume,
    run_state,
    tokenizer_sha256,
)
from mindmoe.train.config import TrainConfig, validate_train_config
from mindmoe.train.metrics import MetricsWriter, strict_row

MODEL = ModelConfig(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
MOE = MoEConfig()


def state_of(seq_len=64, seed=1234, tokenizer="a" * 64, model=MODEL, moe=MOE) -> dict:
    """A state.json as Trainer.save writes it (the keys resume checks, and the MoE policy beside them)."""
    return {
        "step": 4,
        "seq_len": seq_len,
        "data_seed": seed,
        "tokenizer_sha256": tokenizer,
        "model_config": dataclasses.asdict(model),
        "moe_config": dataclasses.asdict(moe),
    }


def current_of(seq_len=64, seed=1234, tokenizer="a" * 64, model=MODEL) -> dict:
    return {"data.seq_len": seq_len, "train.seed": seed, TOKENIZER_LABEL: tokenizer, **architecture(model)}


def test_the_same_settings_resume_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        check_resume("ckpt", state_of(), current_of())
    assert not caplog.text


@pytest.mark.parametrize(
    "change, key, before, after",
    [
        ({"seq_len": 128}, "data.seq_len", "64", "128"),
        ({"seed": 7}, "train.seed", "1234", "7"),
        ({"tokenizer": "b" * 64}, TOKENIZER_LABEL, repr("a" * 64), repr("b" * 64)),
        ({"model": dataclasses.replace(MODEL, rope_theta=5e5)}, "model.rope_theta", "10000.0", "500000.0"),
        # the whole model.* is compared, the keys a pretrained import may override included
        (
            {"model": dataclasses.replace(MODEL, max_position_embeddings=8192)},
            "model.max_position_embeddings",
            "4096",
            "8192",
        ),
        ({"model": dataclasses.replace(MODEL, initializer_range=0.01)}, "model.initializer_range", "0.02", "0.01"),
        ({"model": dataclasses.replace(MODEL, mtp_layers=1)}, "model.mtp_layers", "0", "1"),
    ],
)
def test_a_changed_setting_is_an_error_naming_the_key_and_both_values(change, key, before, after):
    with pytest.raises(ValueError) as caught:
        check_resume("runs/x/checkpoints/step_000004", state_of(), current_of(**change))
    message = str(caught.value)
    assert f"{key}: the checkpoint was trained with {before}, this run has {after}" in message
    assert "step_000004" in message
    if key != TOKENIZER_LABEL:
        assert f"train.resume_allow_changes=[{key}]" in message
    else:
        assert "train.resume_allow_changes" not in message  # the tokenizer cannot be allowed to change


def test_an_allowed_change_resumes_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        check_resume("ckpt", state_of(), current_of(seq_len=256), allowed=["data.seq_len"])
    assert "data.seq_len: the checkpoint was trained with 64, this run has 256" in caplog.text
    with pytest.raises(ValueError, match=r"train\.seed"):  # only the listed key
        check_resume("ckpt", state_of(), current_of(seq_len=256, seed=1), allowed=["data.seq_len"])


def test_an_older_checkpoint_resumes_with_a_warning_naming_what_was_not_checked(caplog):
    old = {key: value for key, value in state_of().items() if key not in ("seq_len", "tokenizer_sha256")}
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        check_resume("ckpt", old, current_of(seq_len=32))
    assert "records no data.seq_len, tokenizer (sha256 of its files)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        check_resume("ckpt", {"step": 1, "data_seed": 1234}, current_of())
    assert "records no data.seq_len, model_config, tokenizer" in caplog.text


def test_a_planned_model_without_vocabulary_and_an_unset_head_dim_compare_equal():
    planned = dataclasses.replace(MODEL, vocab_size=0, head_dim=0)
    explicit = dataclasses.replace(MODEL, head_dim=MODEL.hidden_size // MODEL.num_heads)
    check_resume("ckpt", state_of(model=explicit), architecture(planned))
    assert "model.vocab_size" not in architecture(planned)


def test_the_moe_policy_may_change_on_resume_and_an_old_state_json_keeps_it_in_model_config(caplog):
    """How the MoE layers train (``moe.*``) is no architecture: no ``moe.*`` key is compared, and a checkpoint written
    before the ``moe.*`` section, whose model_config holds those keys, compares its architecture only."""
    assert not any(key.startswith("moe.") for key in architecture(MODEL))
    trained = MoEConfig(dispatch="dropless", aux_loss_coeff=0.1, bias_update_rate=0.01, expert_lock=True)
    old = {key: value for key, value in state_of().items() if key != "moe_config"}
    old["model_config"] = {**dataclasses.asdict(MODEL), **dataclasses.asdict(trained)}
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        check_resume("ckpt", state_of(moe=trained), current_of())
        check_resume("ckpt", old, current_of())
    assert not caplog.text
    with pytest.raises(ValueError, match=r"model\.rope_theta: the checkpoint was trained with 10000\.0"):
        check_resume("ckpt", old, current_of(model=dataclasses.replace(MODEL, rope_theta=5e5)))


def test_resume_allow_changes_accepts_checked_keys_only():
    checked = ["data.seq_len", "train.seed", "model.rope_theta", "model.max_position_embeddings", "model.rope_scaling"]
    validate_train_config(TrainConfig(resume_allow_changes=checked))
    # moe.* is not checked (it may change), model.pretrained names where the weights came from
    for entry in ("data.seqlen", "data.tokenizer", "model.pretrained", "moe.aux_loss_coeff", "model.dispatch"):
        with pytest.raises(ValueError, match=rf"train\.resume_allow_changes: '{entry}'"):
            validate_train_config(TrainConfig(resume_allow_changes=[entry]))


def test_tokenizer_hash_is_the_file_sha256_or_a_hash_of_a_directory_files(tmp_path):
    spm = tmp_path / "spm.model"
    spm.write_bytes(b"sentencepiece bytes")
    assert run_state(64, spm) == {"seq_len": 64, "tokenizer_sha256": hashlib.sha256(b"sentencepiece bytes").hexdigest()}
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text('{"model": 1}')
    (hf / "model.safetensors").write_bytes(b"not a tokenizer file")
    before = tokenizer_sha256(hf)
    (hf / "model.safetensors").write_bytes(b"other weights")
    assert tokenizer_sha256(hf) == before
    (hf / "tokenizer.json").write_text('{"model": 2}')
    assert tokenizer_sha256(hf) != before


def strict_loads(line: str):
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=reject)


def test_non_finite_values_are_written_as_null_with_a_flag(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 1, "loss": math.nan, "lr": 0.1, "layer_aux_loss": [0.5, math.inf], "lock_rate": 0.0})
    writer.write({"step": 2, "loss": 2.5, "lr": 0.1})
    writer.close()
    first, second = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert first["loss"] is None and first["layer_aux_loss"] == [0.5, None] and first["lr"] == 0.1
    assert first["nonfinite"] == ["layer_aux_loss", "loss"]
    assert "nonfinite" not in second
    json.dumps(strict_row({"step": 3, "loss": -math.inf}), allow_nan=False)


def test_resuming_drops_the_rows_past_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in range(1, 6)] + [{"step": 4, "val_loss": 1.0}]
    lines = [json.dumps(row, sort_keys=True) for row in rows]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # a kill mid-write tore the last line
    MetricsWriter(tmp_path, resumed_step=3).close()
    assert path.read_text().splitlines() == lines[:3]  # kept rows byte for byte
    MetricsWriter(tmp_path, resumed_step=3).close()
    assert path.read_text().splitlines() == lines[:3]
    assert not list(tmp_path.glob(".metrics.jsonl.tmp-*"))
    # Nothing is lost: the abandoned steps' rows (the torn line too) moved to a sibling file, once.
    assert (tmp_path / "metrics.abandoned.jsonl").read_text().splitlines() == lines[3:] + ['{"step": 6, "lo']
