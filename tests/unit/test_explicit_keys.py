"""Which keys a run sets explicitly (command line, chosen recipe, non-default group), and the one warning
about explicit keys that have no effect in the chosen mode. No MindSpore: the launcher uses both."""

import logging

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from mindmoe.conf.explicit_keys import explicit_keys, model_fields
from mindmoe.conf.key_effects import keys_without_effect, warn_keys_without_effect
from mindmoe.conf.schema import register_configs
from mindmoe.model.config import ModelConfig

# What conf/recipe/pretrain_tiny_aux_free.yaml sets (read here independently of the code under test).
AUX_FREE_KEYS = {
    "model.score_func",
    "model.expert_bias",
    "moe.bias_update_rate",
    "moe.aux_loss",
    "moe.aux_loss_coeff",
    "model.routed_scaling_factor",
    "moe.expert_lock",
}


def hydra_job(overrides, search_dir=None):
    """``(cfg, hydra node)`` as a Hydra job sees them (``runtime.choices``, ``runtime.config_sources``)."""
    register_configs()
    extra = [f"hydra.searchpath=[file://{search_dir}]"] if search_dir else []
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides + extra, return_hydra_config=True)
    return cfg, cfg.hydra


def test_command_line_keys_are_explicit_and_group_choices_are_not_keys():
    keys = explicit_keys(["moe.dispatch=capacity", "+model.rope_scaling.factor=4", "train.lr=1e-4", "checkpoint=x"])
    assert keys == {"moe.dispatch", "model.rope_scaling.factor", "train.lr", "checkpoint"}
    assert model_fields(keys | {"model.pretrained"}) == {"rope_scaling"}  # moe.* is no model field


def test_a_named_recipe_sets_its_keys_as_if_typed_and_the_default_recipe_sets_none():
    assert AUX_FREE_KEYS <= explicit_keys(["recipe=pretrain_tiny_aux_free"])
    assert explicit_keys(["recipe=pretrain_tiny_aux_free"]) - AUX_FREE_KEYS == set()
    # pretrain_tiny (the default) is the baseline unless named; it sets nothing (the section defaults are its job).
    assert explicit_keys(["model.pretrained=/hf"]) == {"model.pretrained"}
    assert explicit_keys(["recipe=pretrain_tiny"]) == set()
    _, hydra = hydra_job(["recipe=pretrain_tiny_aux_free", "train.lr=0.1"])
    assert explicit_keys(hydra.overrides.task, hydra.runtime) == AUX_FREE_KEYS | {"train.lr"}
    _, hydra = hydra_job(["model.pretrained=/hf"])
    assert explicit_keys(hydra.overrides.task, hydra.runtime) == {"model.pretrained"}


def test_a_non_default_model_group_sets_every_key_of_its_file_and_the_default_group_none():
    glm45 = explicit_keys(["model=glm45"])
    assert {
        "model.hidden_size",
        "model.num_layers",
        "model.num_experts",
        "moe.bias_update_rate",
        "moe.aux_loss",
    } <= glm45
    assert "model.qk_norm" not in glm45  # not in the file: the dataclass default
    assert "moe.dispatch" not in glm45  # left at auto
    assert explicit_keys(["model=tiny_moe"]) == set()


def test_recipes_of_a_user_config_dir_count_with_their_package(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text(
        "# @package _global_\n# A user's recipe.\nmoe:\n  expert_lock: true\n"
        "model:\n  rope_scaling:\n    type: linear\ntrain:\n  lr: 0.001\n"
    )
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "small.yaml").write_text("defaults:\n  - base_model\nhidden_size: 96\n")
    cfg, hydra = hydra_job(["recipe=mine", "model=small"], search_dir=tmp_path)
    assert cfg.moe.expert_lock and cfg.model.hidden_size == 96  # Hydra reads the same files
    keys = explicit_keys(hydra.overrides.task, hydra.runtime)
    assert keys == {"moe.expert_lock", "model.rope_scaling.type", "train.lr", "model.hidden_size"}


def model_and_cfg(overrides, **model):
    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return cfg, ModelConfig(**{**OmegaConf.to_container(cfg.model), **model})


@pytest.mark.parametrize(
    "overrides, model, idle",
    [
        (["moe.capacity_factor=2.0", "moe.dispatch=dropless"], {}, ["moe.capacity_factor"]),
        (["moe.capacity_factor=2.0"], {}, []),
        # moe.dispatch=auto is dropless for weights trained elsewhere, capacity unless then.
        (["moe.capacity_factor=2.0", "model.pretrained=/hf"], {}, ["moe.capacity_factor"]),
        (["moe.capacity_factor=2.0", "lora.enabled=true", "lora.base_checkpoint=/ckpt"], {}, ["moe.capacity_factor"]),
        (["moe.capacity_factor=2.0", "lora.base_checkpoint=/ckpt"], {}, []),
        (["moe.capacity_factor=2.0", "moe.dispatch=capacity", "model.pretrained=/hf"], {}, []),
        (["moe.lock_span=3", "moe.isolation_mode=token_grad"], {}, ["moe.isolation_mode", "moe.lock_span"]),
        (["moe.lock_span=3", "moe.expert_lock=true"], {}, []),
        (["train.loss_scale=1024", "train.loss_scale_window=10"], {}, ["train.loss_scale", "train.loss_scale_window"]),
        (["data.format=sft", "data.text_field=body", "data.num_proc=4"], {}, ["data.num_proc", "data.text_field"]),
        (["data.text_field=body", "data.num_proc=4"], {}, []),
        (["data.vocab_size=1000", "data.tokenizer=/t.model"], {}, ["data.vocab_size"]),
        (["data.vocab_size=1000", "model.pretrained=/hf"], {}, ["data.vocab_size"]),
        (["data.vocab_size=1000"], {}, []),
        (
            ["model.dsa.index_topk=64", "dsa.indexer_loss_coeff=0.5"],
            {},
            ["dsa.indexer_loss_coeff", "model.dsa.index_topk"],
        ),
        (
            ["recipe=glm5_tiny", "dsa.stage=off", "dsa.warmup_steps=0", "model.dsa.index_topk=16"],
            {},
            ["model.dsa.index_topk"],
        ),
        (["recipe=glm5_tiny", "model.dsa.index_topk=16"], {}, []),
    ],
)
def test_the_rule_table_names_explicit_keys_that_have_no_effect(overrides, model, idle):
    cfg, model_cfg = model_and_cfg(overrides, **model)
    found = keys_without_effect(explicit_keys(overrides), cfg, model_cfg)
    assert [key for key, _ in found] == idle


def test_keys_left_at_their_defaults_are_never_named():
    # fp32, dropless and no locking: capacity_factor, loss_scale and the lock keys exist but nobody set them.
    cfg, model_cfg = model_and_cfg(["moe.dispatch=dropless"])
    assert keys_without_effect(set(), cfg, model_cfg) == []


def test_the_reason_says_when_auto_made_the_dispatch_dropless():
    cfg, model_cfg = model_and_cfg(["model.pretrained=/hf"])
    [(key, why)] = keys_without_effect({"moe.capacity_factor"}, cfg, model_cfg)
    assert (
        why
        == "moe.dispatch=dropless drops no token, so there is no capacity (auto: the weights come from a checkpoint)"
    )


def test_one_warning_names_every_idle_key_with_the_reason(caplog):
    overrides = ["moe.dispatch=dropless", "moe.capacity_factor=2.0", "train.loss_scale=1024", "train.lr=0.1"]
    cfg, model_cfg = model_and_cfg(overrides)
    with caplog.at_level(logging.WARNING, logger="mindmoe.config"):
        warn_keys_without_effect(explicit_keys(overrides), cfg, model_cfg)
    records = [r for r in caplog.records if r.name == "mindmoe.config"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "moe.capacity_factor (moe.dispatch=dropless" in message
    assert "train.loss_scale (train.dtype=fp32" in message
    assert "train.lr" not in message
