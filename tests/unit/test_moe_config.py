"""The ``moe.*`` section: the MoE training policy that left ``model.*`` (the architecture a checkpoint stores).

An old ``model.<key>`` on the command line names its new place; ``moe.dispatch=auto`` resolves per run
(capacity for a model initialised here, dropless for weights trained elsewhere); every bound names its key;
the published model groups set their policy under ``moe:``; old checkpoints keep theirs in ``model_config``.
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mindmoe.conf.moved_keys import MOVED_KEYS, moved_key_error
from mindmoe.conf.policy import run_moe_config
from mindmoe.conf.ranges import field_ranges
from mindmoe.model.checkpoints.files import STATE_FILE, checkpoint_model_config, checkpoint_moe_config
from mindmoe.model.config import ModelConfig
from mindmoe.model.dsa_config import DSATrainingConfig
from mindmoe.model.moe_config import MOE_CHOICES, MOE_KEYS, MoEConfig, moe_policy, validate_moe_config
from tests.helpers.runs import compose_config

TRAIN = Path(sys.executable).parent / "mindmoe-train"


def run_train(args, cwd):
    return subprocess.run([str(TRAIN), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_moved_keys_are_every_moe_field_and_none_is_left_in_model():
    policy = {field.name for field in dataclasses.fields(MoEConfig)}
    assert set(MOE_KEYS) == policy
    assert not policy & {field.name for field in dataclasses.fields(ModelConfig)}
    moved_dsa = {f"model.dsa.{key}": f"dsa.{key}" for key in ("stage", "warmup_steps", "indexer_loss_coeff")}
    assert MOVED_KEYS == {**{f"model.{key}": f"moe.{key}" for key in MOE_KEYS}, **moved_dsa}
    assert moved_key_error(["model.dsa.stage=off"]).startswith("model.dsa.stage is now dsa.stage")
    assert moved_key_error(["model.dsa.index_topk=64"]) is None  # the indexer's shape stays architecture


def test_an_old_model_key_on_the_train_command_line_exits_2_naming_the_new_key(tmp_path):
    result = run_train(["train.max_steps=2", "model.dispatch=dropless"], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "mindmoe-train: error: model.dispatch is now moe.dispatch" in result.stderr
    assert "write moe.dispatch=dropless" in result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before Hydra made a run directory


@pytest.mark.parametrize("key", MOE_KEYS)
def test_every_moved_key_names_its_new_place_in_every_override_form(key):
    assert moved_key_error([f"model.{key}=7"]).startswith(f"model.{key} is now moe.{key} ")
    assert moved_key_error([f"model.{key}=7"]).endswith(f"write moe.{key}=7")
    assert moved_key_error(["train.lr=0.1", f"+model.{key}=7"]).startswith(f"model.{key} is now moe.{key}")
    assert moved_key_error([f"~model.{key}"]).endswith(f"write moe.{key}=...")
    assert moved_key_error([f"moe.{key}=7", "model.expert_bias=true", "model=glm45"]) is None


def test_the_composed_job_has_a_moe_section_with_the_defaults(tmp_path):
    result = run_train(["--cfg", "job"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^moe:$", result.stdout, re.MULTILINE)
    job = OmegaConf.create(result.stdout)
    assert OmegaConf.to_container(job.moe) == dataclasses.asdict(MoEConfig())
    assert job.moe.dispatch == "auto"
    assert OmegaConf.to_container(job.dsa) == dataclasses.asdict(DSATrainingConfig())  # DSA's training schedule
    assert set(job.model.dsa) == {"index_n_heads", "index_head_dim", "index_topk"}
    assert not set(MOE_KEYS) & set(job.model)


def test_auto_dispatch_resolves_by_where_the_weights_come_from_and_explicit_values_stay():
    assert MoEConfig().resolved(trained_weights=False).dispatch == "capacity"
    assert MoEConfig().resolved(trained_weights=True).dispatch == "dropless"
    assert MoEConfig().resolved(trained_weights=True).dropless and not MoEConfig(dispatch="capacity").dropless
    for dispatch in ("capacity", "dropless"):
        for trained in (False, True):
            explicit = MoEConfig(dispatch=dispatch, capacity_factor=2.0, aux_loss="seq")
            assert explicit.resolved(trained) == explicit
    resolved = MoEConfig(lock_span=3, expert_lock=True).resolved(True)
    assert (resolved.lock_span, resolved.expert_lock) == (3, True)  # only dispatch is resolved
    assert moe_policy(None) == MoEConfig() and moe_policy({"lock_span": 3}) == MoEConfig(lock_span=3)


@pytest.mark.parametrize(
    "overrides, dispatch",
    [
        ([], "capacity"),
        (["model.pretrained=some_hf_dir"], "dropless"),  # the config only: no weights are read
        (["recipe=lora_business"], "dropless"),  # its base is the bundled tiny pretrained model
        (["lora.enabled=true", "lora.base_checkpoint=some_checkpoint"], "dropless"),
        (["lora.base_checkpoint=some_checkpoint"], "capacity"),  # read only with lora.enabled
        (["model.pretrained=some_hf_dir", "moe.dispatch=capacity"], "capacity"),
        (["moe.dispatch=dropless"], "dropless"),
    ],
)
def test_the_runs_policy_is_its_moe_section_with_auto_resolved(overrides, dispatch):
    moe = run_moe_config(compose_config([*overrides, "moe.lock_span=3"]))
    assert moe == MoEConfig(dispatch=dispatch, lock_span=3)


def test_bias_updates_are_refused_with_lora_naming_the_key():
    with pytest.raises(ValueError, match=r"^moe\.bias_update_rate=0\.001: LoRA keeps the base model frozen"):
        run_moe_config(compose_config(["recipe=lora_business", "moe.bias_update_rate=0.001"]))
    assert run_moe_config(compose_config(["recipe=lora_business", "moe.bias_update_rate=0"])).bias_update_rate == 0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"dispatch": "sometimes"}, "moe.dispatch='sometimes': must be one of ('auto', 'capacity', 'dropless')"),
        ({"aux_loss": "global"}, "moe.aux_loss='global': must be one of ('switch', 'seq', 'none')"),
        ({"isolation_mode": "mask"}, "moe.isolation_mode='mask': must be one of ('expert_update', 'token_grad')"),
        ({"capacity_factor": 0.0}, "moe.capacity_factor=0.0: must be > 0"),
        ({"aux_loss_coeff": -0.1}, "moe.aux_loss_coeff=-0.1: must be >= 0"),
        ({"z_loss_coeff": -0.001}, "moe.z_loss_coeff=-0.001: must be >= 0"),
        ({"bias_update_rate": -0.001}, "moe.bias_update_rate=-0.001: must be >= 0"),
        ({"lock_run_length": 0}, "moe.lock_run_length=0: must be >= 1"),
        ({"lock_span": 0}, "moe.lock_span=0: must be >= 1"),
        ({"lock_span": True}, "moe.lock_span=True: must be >= 1"),
        ({"isolation_decay": 1.5}, "moe.isolation_decay=1.5: must be in [0, 1]"),
        ({"isolation_decay": -0.1}, "moe.isolation_decay=-0.1: must be in [0, 1]"),
    ],
)
def test_a_value_no_run_can_use_is_an_error_naming_the_moe_key(changes, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        validate_moe_config(MoEConfig(**changes))


def test_every_bound_and_choice_is_checked_and_its_edges_accepted():
    checked = {"dispatch", "aux_loss", "isolation_mode", "capacity_factor", "aux_loss_coeff", "z_loss_coeff"}
    checked |= {"bias_update_rate", "lock_run_length", "lock_span", "isolation_decay"}
    assert set(field_ranges(MoEConfig)) | set(MOE_CHOICES) == checked  # the parametrization above covers each
    for edge in ({"isolation_decay": 0.0}, {"isolation_decay": 1.0}, {"aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}):
        validate_moe_config(MoEConfig(**edge))
    validate_moe_config(MoEConfig(lock_run_length=1, lock_span=1, capacity_factor=1e-3, aux_loss="none"))
    with pytest.raises(ValueError, match=r"^moe\.bias_update_rate=0\.001: needs model\.expert_bias=true"):
        validate_moe_config(MoEConfig(bias_update_rate=1e-3), expert_bias=False)
    validate_moe_config(MoEConfig(bias_update_rate=0.0), expert_bias=False)


def test_a_model_group_sets_the_published_policy_under_moe():
    cfg = compose_config(["model=glm45"])
    assert (cfg.moe.aux_loss, cfg.moe.aux_loss_coeff, cfg.moe.bias_update_rate) == ("seq", 1e-4, 1e-3)
    assert cfg.moe.dispatch == "auto"
    assert cfg.model.hidden_size == 5120 and cfg.model.expert_bias  # the architecture stays under model:
    assert run_moe_config(cfg).dispatch == "capacity"


OLD_POLICY = {"dispatch": "dropless", "aux_loss": "seq", "bias_update_rate": 0.002, "expert_lock": True}


def write_state(directory: Path, state: dict) -> Path:
    directory.mkdir()
    (directory / STATE_FILE).write_text(json.dumps(state))
    return directory


def test_an_old_state_json_with_the_policy_in_model_config_still_reads(tmp_path):
    architecture = ModelConfig(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    old_model_config = {**dataclasses.asdict(architecture), **OLD_POLICY}
    assert ModelConfig.from_dict(old_model_config, "state.json model_config") == architecture
    old = write_state(tmp_path / "old", {"step": 4, "model_config": old_model_config})
    assert checkpoint_model_config(old) == architecture
    assert checkpoint_moe_config(old) == MoEConfig(**OLD_POLICY)
    # a checkpoint of this version records the policy beside the architecture
    new_state = {
        "model_config": dataclasses.asdict(architecture),
        "moe_config": dataclasses.asdict(MoEConfig(lock_span=3)),
    }
    assert checkpoint_moe_config(write_state(tmp_path / "new", new_state)) == MoEConfig(lock_span=3)
    plain = write_state(tmp_path / "plain", {"model_config": dataclasses.asdict(architecture)})
    assert checkpoint_moe_config(plain) == MoEConfig()
    other = write_state(tmp_path / "other", {"model_config": {}, "moe_config": {"lock_span": 3, "router": "x"}})
    with pytest.raises(ValueError, match=r"moe_config: unknown moe keys router"):
        checkpoint_moe_config(other)
