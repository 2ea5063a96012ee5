"""The step's language-model loss is normalised by scored tokens over the whole global batch: micro-batches
with very different numbers of scored (assistant) tokens give the loss and gradient of one batch holding all
of them, checked against a NumPy log-softmax and a separately written token-mean objective."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from mindmoe.conf.checks import Layout
from mindmoe.model.config import ModelConfig
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.parallel.distributed import Distributed
from mindmoe.train.step import CompiledStep
from tests.helpers.gradient_capture import GradientCapture

# Dropless routing and no aux / z losses: the model's output for a row does not depend on which
# micro-batch holds it, so only the normalisation of the loss can make the two steps differ.
MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    first_k_dense=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=4,
    top_k=2,
)
MOE = MoEConfig(dispatch="dropless", aux_loss_coeff=0.0, z_loss_coeff=0.0)
SEQ = 16
SCORED_SPANS = [(7, 8), (3, 9), (1, SEQ + 1)]  # assistant positions of each micro-batch's rows: 1, 6, 16 labels


def sft_micro_batches():
    rng = np.random.default_rng(0)
    batches = []
    for start, stop in SCORED_SPANS:
        loss_mask = np.zeros((2, SEQ + 1), np.int32)
        loss_mask[:, start:stop] = 1
        batches.append(
            {
                "input_ids": rng.integers(0, MODEL.vocab_size, (2, SEQ + 1)).astype(np.int32),
                "doc_ids": np.zeros((2, SEQ + 1), np.int32),
                "loss_mask": loss_mask,
            }
        )
    return batches


def concatenated(batches):
    return {key: np.concatenate([batch[key] for batch in batches]) for key in batches[0]}


def step_gradients(batches, accum_steps):
    model = MoETransformer(MODEL, seed=3, moe=MOE)
    optimizer = GradientCapture(model.trainable_params())
    step = CompiledStep(model, optimizer, grad_clip=0.0, accum_steps=accum_steps)
    stats = step.step(batches)
    return stats, [g.asnumpy() for g in optimizer.captured]


def reference(batch):
    """Loss (NumPy log-softmax in float64 over the model's logits) and gradient (MindSpore autograd of
    ``sum(nll * scored) / sum(scored)``) of one batch; scored = assistant label in the input's document."""
    model = MoETransformer(MODEL, seed=3, moe=MOE)
    ids, doc_ids, mask = batch["input_ids"], batch["doc_ids"], batch["loss_mask"]
    scored = ((doc_ids[:, 1:] == doc_ids[:, :-1]) & (mask[:, 1:] > 0)).astype(np.float32)
    inputs, docs, labels = Tensor(ids[:, :-1]), Tensor(doc_ids[:, :-1]), ids[:, 1:]
    logits = model(inputs, docs)[OUT_HEAD].asnumpy().astype(np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
    loss = float((nll * scored).sum() / scored.sum())
    one_hot = Tensor(np.eye(MODEL.vocab_size, dtype=np.float32)[labels])
    weights = Tensor(scored / scored.sum())

    def objective(inputs, docs):
        log_softmax = ops.log_softmax(model(inputs, docs)[OUT_HEAD], -1)
        return -((log_softmax * one_hot).sum(-1) * weights).sum()

    grads = ms.jit(ms.value_and_grad(objective, None, model.trainable_params()))(inputs, docs)[1]
    return loss, [g.asnumpy() for g in grads], nll, scored


def test_micro_batches_of_very_different_token_counts_give_the_loss_and_gradient_of_one_batch():
    batches = sft_micro_batches()
    loss, grads, nll, scored = reference(concatenated(batches))
    # The defect this guards against: the mean of the micro-batch means weighs the single token of the
    # first micro-batch's rows as much as the 32 of the last micro-batch.
    per_micro_batch = [
        (nll[rows] * scored[rows]).sum() / scored[rows].sum() for rows in (slice(0, 2), slice(2, 4), slice(4, 6))
    ]
    assert abs(np.mean(per_micro_batch) - loss) > 0.01
    one, one_grads = step_gradients([concatenated(batches)], accum_steps=1)
    three, three_grads = step_gradients(batches, accum_steps=3)
    for stats in (one, three):
        assert stats.lm_loss == pytest.approx(loss, rel=1e-5)
        assert stats.loss == pytest.approx(loss, rel=1e-5)
        assert not stats.skipped
    assert three.grad_norm == pytest.approx(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads)), rel=1e-5)
    scale = max(np.abs(g).max() for g in grads)
    for expected, got_one, got_three in zip(grads, one_grads, three_grads):
        np.testing.assert_allclose(got_one, expected, rtol=1e-5, atol=1e-5 * scale)
        np.testing.assert_allclose(got_three, expected, rtol=1e-5, atol=1e-5 * scale)


class TwoRanks(Distributed):
    """Two replicas that hold the same count, summed the way the float32 all-reduce does."""

    def __init__(self):
        self.world_size, self.ep = 2, 1
        self.layout = Layout(world_size=2, dp=2, ep=1, accumulation=1)

    def sum_over_ranks(self, values):
        values = np.asarray(values, np.float32)
        return values + values


def test_the_global_token_count_is_summed_exactly_beyond_float32_integers():
    count = 2**25 + 3  # not representable in float32
    assert float(np.float32(count) + np.float32(count)) != 2 * count
    assert TwoRanks().sum_count_over_replicas(count) == 2 * count
