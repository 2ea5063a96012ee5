"""Every numeric ``train.*`` / ``data.*`` / ``moe.*`` key has a domain, checked before a run prepares data or builds
a model; errors name the key, its value and the allowed range, all violations in one message."""

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from mindmoe.conf.checks import validate_run_config
from mindmoe.conf.exit_codes import CONFIG_ERROR
from mindmoe.conf.ranges import field_ranges
from mindmoe.data.config import DataConfig
from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.moe_config import MoEConfig
from mindmoe.train.config import TrainConfig
from mindmoe.train.optim import build_optimizer
from tests.helpers.runs import compose_config
from tests.helpers.tiny_run import TINY_RUN

REPO = Path(__file__).resolve().parents[2]
#: Numeric keys checked elsewhere, with the reason.
CHECKED_ELSEWHERE = {
    "data.weights",  # one per data.train_files entry: data.config.validate_data_config
    # against other model keys or with a special value (model.config.validate_model_config)
    "model.head_dim",  # 0 = hidden_size / num_heads
    "model.q_lora_rank",  # null = a plain q_proj
    "model.first_k_dense",  # at most num_layers
    "model.n_group",  # divides num_experts
    "model.topk_group",  # at most n_group
    "model.mtp_layers",  # an integer (a float would build a fraction of a layer)
}


def check(*overrides):
    validate_run_config(compose_config([*TINY_RUN, *overrides]), None)


@pytest.mark.parametrize(
    "override, message",
    [
        # Found 9 of issue 22: each ran with exit 0.
        ("train.lr=-0.001", r"train\.lr=-0\.001 must be > 0"),
        ("train.min_lr_ratio=5", r"train\.min_lr_ratio=5\.0 must be in \[0, 1\]"),
        ("train.grad_clip=-1", r"train\.grad_clip=-1\.0 must be >= 0 \(0 disables clipping\)"),
        ("train.keep_last=-1", r"train\.keep_last=-1 must be >= 1"),
        ("train.betas=[0.9,1.5]", r"train\.betas=\[0\.9, 1\.5\] must be two values \(beta1, beta2\), each in \(0, 1\)"),
        ("train.betas=[0.9]", r"train\.betas=\[0\.9\] must be two values"),
        ("train.weight_decay=-0.1", r"train\.weight_decay=-0\.1 must be >= 0"),
        ("train.eps=0", r"train\.eps=0\.0 must be > 0"),
        ("train.eval_every=-1", r"train\.eval_every=-1 must be >= 0 \(0 = only at the end\)"),
        ("train.eval_batches=-2", r"train\.eval_batches=-2 must be >= 0"),
        ("train.seed=-5", r"train\.seed=-5 must be in \[0, 4294967295\]"),
        ("train.peak_gflops=-1", r"train\.peak_gflops=-1\.0 must be >= 0"),
        ("train.loss_scale_window=0", r"train\.loss_scale_window=0 must be >= 1"),
        ("train.lr=nan", r"train\.lr=nan must be > 0"),
        ("data.seq_len=0", r"data\.seq_len=0 must be >= 1"),
        ("data.micro_batch_size=0", r"data\.micro_batch_size=0 must be >= 1"),
        ("data.num_proc=0", r"data\.num_proc=0 must be >= 1"),
        ("moe.capacity_factor=0", r"moe\.capacity_factor=0\.0: must be > 0"),
        ("moe.isolation_decay=1.5", r"moe\.isolation_decay=1\.5: must be in \[0, 1\]"),
        ("moe.lock_span=0", r"moe\.lock_span=0: must be >= 1"),
    ],
)
def test_out_of_range_value_names_the_key_value_and_range(override, message):
    with pytest.raises(ValueError, match=message) as error:
        check(override)
    # Never mindformers' argument names (beta1, weight_decay without its section).
    assert "beta1'" not in str(error.value) and "For 'AdamW'" not in str(error.value)


def test_every_violation_is_listed_in_one_message():
    with pytest.raises(ValueError) as error:
        check("train.lr=-0.001", "train.min_lr_ratio=5", "train.grad_clip=-1", "train.keep_last=-1")
    text = str(error.value)
    assert text.startswith("4 config values are out of range:")
    for key in ("train.lr=", "train.min_lr_ratio=", "train.grad_clip=", "train.keep_last="):
        assert key in text


def test_boundary_values_that_mean_something_are_accepted():
    check(
        "train.grad_clip=0",
        "train.eval_every=0",
        "train.eval_batches=0",
        "train.min_lr_ratio=0",
        "train.min_lr_ratio=1",
        "train.weight_decay=0",
        "train.warmup_ratio=0",
        "train.betas=[0.5,0.999]",
        "train.keep_last=1",
        "train.seed=0",
        "train.peak_gflops=0",
    )
    check()  # the defaults


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": 0}, r"model\.hidden_size=0: must be >= 1"),
        ({"rope_theta": -1.0}, r"model\.rope_theta=-1\.0: must be >= 0"),
        ({"routed_scaling_factor": 0.0}, r"model\.routed_scaling_factor=0\.0: must be > 0"),
        ({"partial_rotary_factor": 0.0}, r"model\.partial_rotary_factor=0\.0: must be in \(0, 1\]"),
    ],
)
def test_a_model_value_out_of_its_field_domain_names_the_key(changes, message):
    with pytest.raises(ValueError, match=message):
        validate_model_config(ModelConfig(**changes))


def _numeric(annotation) -> bool:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, list, typing.List):
        return any(_numeric(arg) for arg in args if arg is not type(None))
    return annotation in (int, float)


@pytest.mark.parametrize(
    "section, cls",
    [("train", TrainConfig), ("data", DataConfig), ("moe", MoEConfig), ("model", ModelConfig)],
)
def test_every_numeric_key_has_a_range(section, cls):
    ranges = field_ranges(cls)
    hints = typing.get_type_hints(cls)
    numeric = {f"{section}.{field.name}" for field in dataclasses.fields(cls) if _numeric(hints[field.name])}
    covered = {f"{section}.{key}" for key in ranges} | CHECKED_ELSEWHERE
    assert numeric - covered == set(), "declare the domain of these keys on their fields (conf.ranges.bounded)"
    assert {f"{section}.{key}" for key in ranges} <= numeric


@pytest.mark.parametrize(
    "train, message",
    [
        (TrainConfig(betas=[0.9, 1.0]), r"train\.betas=\[0\.9, 1\.0\]"),
        (TrainConfig(weight_decay=-1.0), r"train\.weight_decay=-1\.0 must be >= 0"),
        (TrainConfig(eps=-1e-8), r"train\.eps=-1e-08 must be > 0"),
    ],
)
def test_optimizer_names_the_train_key_before_mindformers_checks(train, message):
    """mindformers' AdamW would raise first with its own names ("beta2", "weight_decay" of 'AdamW')."""
    with pytest.raises(ValueError, match=message):
        build_optimizer([], train)


def test_train_command_exits_2_before_preparing_data(tmp_path):
    cache = tmp_path / "cache"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindmoe.train.cli",
            *TINY_RUN,
            "train.lr=-0.001",
            "train.betas=[0.9,1.5]",
            f"data.cache_dir={cache}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == CONFIG_ERROR, result.stderr[-2000:]
    assert "train.lr=-0.001 must be > 0" in result.stderr and "train.betas=[0.9, 1.5]" in result.stderr
    assert not cache.exists() or not any(cache.iterdir())  # no tokenizer trained, nothing packed
    assert not (tmp_path / "run" / "checkpoints").exists()
