"""``train.max_bad_steps`` counts bad steps only: an fp16 loss-scale overflow (injected here: fp16 does not run
on CPU) is skipped and logged at INFO with the new scale, a non-finite fp32 loss counts and stops the run."""

import logging

import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.config import ModelConfig
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.bad_steps import BadStepCounter
from mindmoe.train.config import TrainConfig
from mindmoe.train.optim import build_optimizer
from mindmoe.train.precision import LossScale
from mindmoe.train.step import CompiledStep, StepStats


def stats(kind: str) -> StepStats:
    """A step that was ``ok``, a loss-scale ``overflow`` (finite loss, scale halved), or ``bad`` (NaN loss)."""
    return StepStats(
        skipped=kind != "ok",
        loss=float("nan") if kind == "bad" else 2.5,
        lm_loss=2.5,
        aux_loss=0.0,
        z_loss=0.0,
        grad_norm=float("inf") if kind != "ok" else 1.0,
        lr=1e-3,
        routing_stats=np.zeros((1, 3, 4)),
        layer_stats=np.zeros((1, 5)),
        overflow=kind == "overflow",
        loss_scale=1024.0,
    )


def run(kinds, max_bad_steps=2):
    counter = BadStepCounter(max_bad_steps)
    for step, kind in enumerate(kinds, start=1):
        counter.record(step, stats(kind))
    return counter


def test_overflow_skips_never_count_toward_max_bad_steps_and_are_logged_at_info_with_the_scale(caplog):
    with caplog.at_level(logging.INFO, logger="mindmoe.train"):
        counter = run(["overflow"] * 10 + ["ok", "overflow"], max_bad_steps=1)
    assert counter.in_row == 0 and counter.skipped == 11
    records = [r for r in caplog.records if "overflowed" in r.getMessage()]
    assert len(records) == 11 and all(r.levelno == logging.INFO for r in records)
    assert "loss scale lowered to 1024" in records[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_non_finite_fp32_losses_in_a_row_stop_the_run_and_an_overflow_between_them_does_not_reset_the_count(caplog):
    assert run(["bad", "ok", "bad", "ok"]).in_row == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mindmoe.train"):
        with pytest.raises(FloatingPointError, match=r"2 consecutive steps up to step 3 .*train.max_bad_steps=2"):
            run(["bad", "overflow", "bad"])
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]


def test_a_real_non_finite_loss_under_loss_scaling_is_a_bad_step_not_an_overflow():
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
    # Poisoned before the step is compiled: MindSpore 2.9 graphs do not see a later set_data.
    model.norm.weight.set_data(Tensor(np.full(model.norm.weight.shape, np.nan, np.float32)))
    optimizer = build_optimizer(model.trainable_params(), TrainConfig(max_steps=10, warmup_ratio=0.0))
    step = CompiledStep(model, optimizer, grad_clip=1.0, accum_steps=1, loss_scale=LossScale(initial=1024.0, window=10))
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 32, (2, 9)).astype(np.int32), "doc_ids": np.zeros((2, 9), np.int32)}
    result = step.step([batch])
    assert result.skipped and not result.overflow and not np.isfinite(result.loss)
    assert result.loss_scale == 512.0
    with pytest.raises(FloatingPointError, match="train.max_bad_steps=1"):
        BadStepCounter(1).record(1, result)
