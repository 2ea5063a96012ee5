"""``train.dtype``, ``train.recompute`` and ``train.cell_reuse``: CPU refuses low precision and cell reuse,
dynamic loss scaling follows its published rule and leaves updates unchanged, recompute leaves loss and
gradients unchanged, cell reuse gives all layers of a kind one reuse key."""

from dataclasses import replace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.conf.checks import validate_precision
from mindmoe.model.config import ModelConfig
from mindmoe.model.outputs import OUT_AUX_LOSS, OUT_HEAD, OUT_Z_LOSS
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.config import TrainConfig
from mindmoe.train.head_loss import masked_cross_entropy
from mindmoe.train.optim import build_optimizer
from mindmoe.train.precision import LossScale, apply_precision
from mindmoe.train.step import CompiledStep, split_window

MODEL = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=4,
    top_k=2,
)
SEQ = 16


def batches(count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "input_ids": rng.integers(0, MODEL.vocab_size, (2, SEQ + 1)).astype(np.int32),
            "doc_ids": np.repeat(rng.integers(0, 2, (2, 1)), SEQ + 1, axis=1).astype(np.int32),
        }
        for _ in range(count)
    ]


def make_trainer(loss_scale=None, model_cfg=MODEL):
    model = MoETransformer(model_cfg, seed=3)
    optimizer = build_optimizer(model.trainable_params(), TrainConfig(max_steps=10, warmup_ratio=0.0))
    return model, CompiledStep(model, optimizer, grad_clip=1.0, accum_steps=1, loss_scale=loss_scale)


def weights(model):
    return {p.name: p.asnumpy().copy() for p in model.trainable_params()}


def test_bf16_is_refused_on_cpu_naming_the_key_and_fp16_runs_there():
    with pytest.raises(ValueError, match="train.dtype=bf16: the CPU backend .* use train.dtype=fp32"):
        validate_precision(TrainConfig(dtype="bf16"), "CPU")
    validate_precision(TrainConfig(dtype="fp16"), "CPU")
    for dtype in ("bf16", "fp16"):
        validate_precision(TrainConfig(dtype=dtype), "Ascend")
    with pytest.raises(ValueError, match="train.dtype='fp8' must be one of fp32, bf16, fp16"):
        validate_precision(TrainConfig(dtype="fp8"), "Ascend")


def test_cell_reuse_is_refused_on_cpu_naming_the_key_and_keys_layers_by_kind():
    with pytest.raises(ValueError, match="train.cell_reuse=true: .* Ascend .* train.cell_reuse=false on CPU"):
        validate_precision(TrainConfig(cell_reuse=True), "CPU")
    validate_precision(TrainConfig(cell_reuse=True), "Ascend")
    # lazy_inline compiles one body per distinct key: the layers of one kind must share it.
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=32,
        num_layers=4,
        first_k_dense=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        top_k=2,
    )
    keys = [layer.cell_init_args for layer in MoETransformer(cfg, cell_reuse=True).layers]
    assert keys[1] == keys[2] == keys[3] != keys[0]
    assert not any(hasattr(layer, "cell_init_args") for layer in MoETransformer(cfg).layers)


def test_power_of_two_loss_scale_leaves_every_update_unchanged_and_doubles_after_its_window():
    plain_model, plain = make_trainer()
    scaled_model, scaled = make_trainer(LossScale(initial=2.0**10, window=2))
    scales = []
    for batch in batches(3):
        reference, stats = plain.step([batch]), scaled.step([batch])
        assert stats.loss == reference.loss and stats.grad_norm == reference.grad_norm
        assert not stats.overflow and reference.loss_scale is None
        scales.append(float(scaled.loss_scale_state[0].asnumpy()))
    # Multiplying by 2^k and dividing again is exact in floating point: identical weights.
    for name, value in weights(plain_model).items():
        np.testing.assert_array_equal(weights(scaled_model)[name], value, err_msg=name)
    assert scales == [2.0**10, 2.0**11, 2.0**11]


def test_overflowing_loss_scale_skips_the_step_and_halves():
    # O(10) weights give gradients of O(10) (and a finite loss of O(100)): times 2**127 they
    # overflow float32, as fp16 gradients overflow at a much smaller scale.
    model, trainer = make_trainer(LossScale(initial=2.0**127, window=1000), replace(MODEL, initializer_range=10.0))
    before = weights(model)
    stats = trainer.step(batches(1)[:1])
    # Only the scaled gradients overflowed: the reported loss is the finite one before scaling.
    assert stats.skipped and stats.overflow and np.isfinite(stats.loss)
    assert stats.loss_scale == 2.0**126
    for name, value in weights(model).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    assert float(trainer.loss_scale_state[0].asnumpy()) == 2.0**126


def loss_and_grads(model, batch):
    input_ids, doc_ids, labels, loss_mask = split_window(batch)

    def loss_fn(input_ids, doc_ids, labels, loss_mask):
        out = model(input_ids, doc_ids)
        loss = masked_cross_entropy(out[OUT_HEAD], labels, loss_mask)[0]
        return loss + out[OUT_AUX_LOSS] + out[OUT_Z_LOSS]

    grad_fn = ms.jit(ms.value_and_grad(loss_fn, None, model.trainable_params()))
    loss, grads = grad_fn(input_ids, doc_ids, labels, loss_mask)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


def test_recompute_gives_the_same_loss_and_gradients():
    batch = batches(1, seed=5)[0]
    loss, grads = loss_and_grads(MoETransformer(MODEL, seed=3), batch)
    recomputed_model = MoETransformer(MODEL, seed=3)
    assert apply_precision(recomputed_model, TrainConfig(recompute=True)) is None
    recomputed_loss, recomputed_grads = loss_and_grads(recomputed_model, batch)
    assert recomputed_loss == pytest.approx(loss, rel=1e-6)
    for grad, recomputed in zip(grads, recomputed_grads):
        np.testing.assert_allclose(recomputed, grad, rtol=1e-5, atol=1e-7)


def test_fp16_compute_keeps_fp32_weights_and_moves_logits_by_fp16_rounding_only():
    ids = Tensor(batches(1, seed=7)[0]["input_ids"][:, :SEQ])
    doc_ids = Tensor(np.zeros((2, SEQ), np.int32))
    reference = MoETransformer(MODEL, seed=3)(ids, doc_ids)[OUT_HEAD].asnumpy()
    model = MoETransformer(MODEL, seed=3)
    loss_scale = apply_precision(model, TrainConfig(dtype="fp16", loss_scale=1024.0, loss_scale_window=10))
    assert loss_scale == LossScale(initial=1024.0, window=10)
    assert all(p.dtype == ms.float32 for p in model.get_parameters())
    logits = model(ids, doc_ids)[OUT_HEAD].asnumpy()
    difference = np.abs(logits - reference).max()
    # fp16 has a 2^-11 relative step: the matmuls were cast (difference > 0) and nothing else broke.
    assert 0 < difference < 1e-2 * np.abs(reference).max()
