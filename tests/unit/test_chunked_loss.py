"""The LM head and cross-entropy in chunks of tokens (``model.lm_loss.TokenNLL``): values and gradients of x and
the head against torch autograd of a float64 log-softmax cross-entropy, with one chunk, several chunks, a last
chunk that is smaller, tokens of zero weight and a frozen head; and the train step's loss and gradients with
chunks against the plain log-softmax of ``construct``'s logits (tied embeddings: the head's gradient joins the
embedding's)."""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor, ops

from mindmoe.bench.earlier_loss import EarlierTokenNLL
from mindmoe.model.config import ModelConfig
from mindmoe.model.lm_loss import TokenNLL, chunk_rows
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.transformer import MoETransformer
from mindmoe.train import head_loss as head_loss_module
from mindmoe.train.config import TrainConfig
from mindmoe.train.head_loss import head_loss
from mindmoe.train.precision import apply_precision
from mindmoe.train.step import CompiledStep
from tests.helpers.gradient_capture import GradientCapture

TOKENS, HIDDEN, VOCAB = 11, 8, 13


def rows_and_head(seed=0):
    rng = np.random.default_rng(seed)
    x_TH = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    head_VH = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    labels_T = rng.integers(0, VOCAB, TOKENS).astype(np.int32)
    weight_T = rng.uniform(0.5, 2.0, TOKENS).astype(np.float32)
    weight_T[[2, 7]] = 0.0  # unscored tokens
    return x_TH, head_VH, labels_T, weight_T


def torch_reference(x_TH, head_VH, labels_T, weight_T):
    """``sum_t w_t * -log_softmax(x W^T)[t, label_t]`` and its gradients of x and W, float64."""
    x = torch.tensor(x_TH, dtype=torch.float64, requires_grad=True)
    head = torch.tensor(head_VH, dtype=torch.float64, requires_grad=True)
    log_probs = torch.log_softmax(x @ head.T, -1)
    nll = -log_probs.gather(1, torch.tensor(labels_T, dtype=torch.long)[:, None])[:, 0]
    loss = (nll * torch.tensor(weight_T, dtype=torch.float64)).sum()
    loss.backward()
    return loss.item(), x.grad.numpy(), head.grad.numpy()


def torch_token_nll(x_TH, head_VH, labels_T):
    """Per-token ``-log_softmax(x W^T)[t, label_t]``, float64."""
    log_probs = torch.log_softmax(
        torch.tensor(x_TH, dtype=torch.float64) @ torch.tensor(head_VH, dtype=torch.float64).T, -1
    )
    return -log_probs.gather(1, torch.tensor(labels_T, dtype=torch.long)[:, None])[:, 0].numpy()


def chunked_loss_and_grads(cell, x_TH, head_VH, labels_T, weight_T):
    def weighted_nll(x, head, labels, weight):
        return cell(x, head, labels, weight)[0]

    grad_fn = ms.jit(ms.value_and_grad(weighted_nll, (0, 1)))
    loss, (dx, dhead) = grad_fn(Tensor(x_TH), Tensor(head_VH), Tensor(labels_T), Tensor(weight_T))
    return float(loss.asnumpy()), dx.asnumpy(), dhead.asnumpy()


@pytest.mark.parametrize("cell_class", [TokenNLL, EarlierTokenNLL], ids=["today", "recomputing (bench A/B)"])
@pytest.mark.parametrize(
    "rows, head_trainable",
    [(64, True), (4, True), (4, False), (1, True)],
    ids=["one chunk", "chunks of 4 (last 3)", "frozen head", "one token per chunk"],
)
def test_chunked_nll_and_gradients_match_torch_log_softmax(rows, head_trainable, cell_class):
    """Today's cell and the earlier one bench/kernel_ab.py's ``loss=recompute`` compares it with."""
    inputs = rows_and_head()
    loss, dx, dhead = chunked_loss_and_grads(cell_class(rows, head_trainable), *inputs)
    expected_loss, expected_dx, expected_dhead = torch_reference(*inputs)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-6)
    assert np.all(dx[[2, 7]] == 0.0)  # a token of zero weight has no gradient
    if head_trainable:
        np.testing.assert_allclose(dhead, expected_dhead, rtol=1e-5, atol=1e-6)
    else:
        assert np.all(dhead == 0.0)


@pytest.mark.parametrize("rows", [64, 4], ids=["one chunk", "chunks of 4"])
def test_gradients_scale_with_the_incoming_gradient_and_nll_is_per_token(rows):
    """The backward scales the gradients the forward computed by the loss's incoming gradient (here 2.5 and the
    mean over 7 tokens), and the per-token ``nll`` output is every token's, zero-weight tokens included."""
    x_TH, head_VH, labels_T, weight_T = rows_and_head(seed=2)
    cell = TokenNLL(rows)

    def objective(x, head, labels, weight):
        loss, nll_T, _, _ = cell(x, head, labels, weight)
        return loss * 2.5 / 7.0, nll_T

    grad_fn = ms.jit(ms.value_and_grad(objective, (0, 1), has_aux=True))
    (loss, nll_T), (dx, dhead) = grad_fn(Tensor(x_TH), Tensor(head_VH), Tensor(labels_T), Tensor(weight_T))
    expected_loss, expected_dx, expected_dhead = torch_reference(x_TH, head_VH, labels_T, weight_T)
    assert float(loss.asnumpy()) == pytest.approx(expected_loss * 2.5 / 7.0, rel=1e-6)
    np.testing.assert_allclose(nll_T.asnumpy(), torch_token_nll(x_TH, head_VH, labels_T), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx.asnumpy(), expected_dx * 2.5 / 7.0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dhead.asnumpy(), expected_dhead * 2.5 / 7.0, rtol=1e-5, atol=1e-6)


def test_an_evaluation_cell_computes_the_losses_only_and_refuses_a_gradient():
    x_TH, head_VH, labels_T, weight_T = rows_and_head(seed=3)
    cell = TokenNLL(4, grads=False)
    loss, nll_T, dx, dhead = cell(Tensor(x_TH), Tensor(head_VH), Tensor(labels_T), Tensor(weight_T))
    assert float(loss.asnumpy()) == pytest.approx(torch_reference(x_TH, head_VH, labels_T, weight_T)[0], rel=1e-6)
    np.testing.assert_allclose(nll_T.asnumpy(), torch_token_nll(x_TH, head_VH, labels_T), rtol=1e-6, atol=1e-6)
    assert dx.shape == () and dhead.shape == ()  # no gradient MatMul ran
    with pytest.raises(ValueError, match="grads=True"):
        chunked_loss_and_grads(cell, x_TH, head_VH, labels_T, weight_T)


def test_fp16_compute_rounds_only_the_logits_matmul():
    x_TH, head_VH, labels_T, weight_T = rows_and_head(seed=1)
    loss, dx, dhead = chunked_loss_and_grads(TokenNLL(4, compute_dtype=ms.float16), x_TH, head_VH, labels_T, weight_T)
    assert dx.dtype == np.float32 and dhead.dtype == np.float32
    # The reference on fp16-rounded inputs: what is left is the fp16 rounding of the logits and gradients.
    rounded = (x_TH.astype(np.float16).astype(np.float32), head_VH.astype(np.float16).astype(np.float32))
    expected_loss, expected_dx, expected_dhead = torch_reference(*rounded, labels_T, weight_T)
    exact_loss = torch_reference(x_TH, head_VH, labels_T, weight_T)[0]
    assert loss != pytest.approx(exact_loss, rel=1e-6)
    assert loss == pytest.approx(expected_loss, rel=2e-3)
    np.testing.assert_allclose(dx, expected_dx, atol=5e-3 * np.abs(expected_dx).max())
    np.testing.assert_allclose(dhead, expected_dhead, atol=5e-3 * np.abs(expected_dhead).max())


MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=1,
    first_k_dense=0,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=4,
    top_k=2,
    tie_word_embeddings=True,
)
MOE = MoEConfig(dispatch="dropless", aux_loss_coeff=0.0, z_loss_coeff=0.0)
SEQ = 16


def test_head_loss_follows_the_head_trainability_and_the_compute_dtype():
    assert chunk_rows(151552) == 55 and chunk_rows(4096) == 2048  # the default run's 2048 tokens: one chunk
    model = MoETransformer(MODEL, seed=3, moe=MOE)
    assert head_loss(model, model.trainable_params()).head_trainable
    model.embed_tokens.weight.requires_grad = False  # a LoRA run with the head frozen
    assert not head_loss(model, model.trainable_params()).head_trainable
    assert not head_loss(model).head_trainable and head_loss(model).compute_dtype == ms.float32
    assert head_loss(model, model.trainable_params()).grads and not head_loss(model).grads  # evaluation: losses only
    apply_precision(model, TrainConfig(dtype="fp16"))
    assert head_loss(model).compute_dtype == ms.float16


def test_train_step_with_chunks_gives_the_loss_and_gradients_of_the_plain_log_softmax(monkeypatch):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, MODEL.vocab_size, (2, SEQ + 1)).astype(np.int32)
    loss_mask = np.ones((2, SEQ + 1), np.int32)
    loss_mask[0, 3:9] = 0
    batch = {"input_ids": ids, "doc_ids": np.zeros_like(ids), "loss_mask": loss_mask}
    # Reference: the plain log-softmax of construct's logits, MindSpore autograd; labels are scored
    # where the label position's mask is 1 (one document).
    model = MoETransformer(MODEL, seed=3, moe=MOE)
    scored = Tensor(loss_mask[:, 1:].astype(np.float32))
    one_hot = Tensor(np.eye(MODEL.vocab_size, dtype=np.float32)[ids[:, 1:]])

    def objective(inputs, docs):
        log_probs = ops.log_softmax(model(inputs, docs)[OUT_HEAD], -1)
        return -((log_probs * one_hot).sum(-1) * scored).sum() / scored.sum()

    grad_fn = ms.jit(ms.value_and_grad(objective, None, model.trainable_params()))
    loss, grads = grad_fn(Tensor(ids[:, :-1]), Tensor(np.zeros((2, SEQ), np.int32)))
    # 32 tokens in chunks of 5: seven chunks, the last of 2.
    monkeypatch.setattr(head_loss_module, "chunk_rows", lambda vocab_size: 5)
    chunked_model = MoETransformer(MODEL, seed=3, moe=MOE)
    optimizer = GradientCapture(chunked_model.trainable_params())
    step = CompiledStep(chunked_model, optimizer, grad_clip=0.0, accum_steps=1)
    assert step.token_nll.rows == 5 and step.token_nll.head_trainable
    stats = step.step([batch])
    assert stats.lm_loss == pytest.approx(float(loss.asnumpy()), rel=1e-5)
    scale = max(np.abs(g.asnumpy()).max() for g in grads)
    for param, expected, got in zip(chunked_model.trainable_params(), grads, optimizer.captured):
        np.testing.assert_allclose(got.asnumpy(), expected.asnumpy(), atol=1e-5 * scale, err_msg=param.name)
    assert step.evaluate([batch])[0] == pytest.approx(float(loss.asnumpy()), rel=1e-5)
