"""Attention's softmax with its hand-written backward, against torch autograd."""
import numpy as np
import mindspore as ms
from mindspore import Tensor
import torch

from model.attention import MASK_VALUE, MaskedSoftmax


def test_masked_softmax_gradient_matches_torch_and_leaves_the_mask_untrained():
    rng = np.random.default_rng(0)
    batch, heads, seq_len = 2, 3, 7
    scores = rng.normal(size=(batch, heads, seq_len, seq_len)).astype(np.float32)
    # Causal plus a document boundary after position 3 in the second sequence.
    allowed = np.tril(np.ones((seq_len, seq_len), bool))[None].repeat(batch, 0)
    allowed[1, 4:, :4] = False
    mask = np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)[:, None]
    upstream = rng.normal(size=scores.shape).astype(np.float32)
    softmax = MaskedSoftmax()

    def weighted(scores_BNSS, mask_B1SS):
        return (softmax(scores_BNSS, mask_B1SS) * Tensor(upstream)).sum()

    value, (grad_scores, grad_mask) = ms.jit(ms.value_and_grad(weighted, (0, 1)))(Tensor(scores), Tensor(mask))

    scores_t = torch.tensor(scores, requires_grad=True)
    expected = (torch.softmax(scores_t + torch.tensor(mask), -1) * torch.tensor(upstream)).sum()
    expected.backward()
    np.testing.assert_allclose(float(value.asnumpy()), expected.item(), rtol=1e-5)
    np.testing.assert_allclose(grad_scores.asnumpy(), scores_t.grad.numpy(), rtol=1e-4, atol=1e-6)
    assert np.abs(grad_scores.asnumpy()[np.broadcast_to(~allowed[:, None], scores.shape)]).max() == 0.0
    assert not grad_mask.asnumpy().any()
