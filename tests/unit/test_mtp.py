"""Multi-token prediction (DeepSeek-V3 §2.2): forward and loss against a NumPy transcription of the formula."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD, ModelOutput
from mindmoe.model.param_count import count_parameters, mtp_layer_parameters, parameter_shapes
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.step import CompiledStep

VOCAB, HIDDEN, SEQ = 23, 16, 12
MOE = MoEConfig(dispatch="dropless")


def tiny(**changes) -> ModelConfig:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_experts=4,
    )
    values.update(changes)
    return ModelConfig(**values)


def rms_norm(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def log_softmax(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def params_of(model) -> dict:
    return {p.name: p for p in model.get_parameters()}


def make_blocks_identity(model, rng):
    """Zero each MTP decoder block's output projections (attention o_proj, expert and shared-expert down_proj) so the
    block is its residual, and draw the MTP norms and eh_proj away from their defaults so a swap shows."""
    for name, param in params_of(model).items():
        if not name.startswith("mtp_layers."):
            continue
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            param.set_data(Tensor(np.zeros(param.shape, np.float32)))
        elif name.endswith(("enorm.weight", "hnorm.weight", "shared_head.norm.weight")):
            param.set_data(Tensor(rng.uniform(0.5, 2.0, param.shape).astype(np.float32)))
        elif name.endswith("eh_proj.weight"):
            param.set_data(Tensor(rng.normal(0, 0.3, param.shape).astype(np.float32)))


def numpy_mtp_loss(model, window, doc_ids, hidden0_TH, coeff):
    """``coeff / U * sum_k CE_k`` transcribed from the report: depth k at position i reads token ``t_{i+k}``, predicts
    ``t_{i+k+1}``; ``h'_i = W_k [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]`` (embedding first, as vLLM/Megatron); with
    the block an identity ``h^k = h'``; logits ``shared_head.norm(h^k) @ W_head^T``. A target counts when it is
    inside the window and in the same document as ``t_i``; ``CE_k`` is the mean over the counted targets."""
    p = {name: param.asnumpy() for name, param in params_of(model).items()}
    cfg = model.config
    eps = cfg.rms_norm_eps
    embed, head = p["embed_tokens.weight"], p["lm_head.weight"]
    batch, seq = window.shape[0], window.shape[1] - 1
    hidden = hidden0_TH.reshape(batch, seq, -1)
    losses = []
    for depth in range(1, cfg.mtp_layers + 1):
        prefix = f"mtp_layers.{depth - 1}."
        total, count = 0.0, 0
        new_hidden = np.zeros_like(hidden)
        for b in range(batch):
            for i in range(seq):
                token_in = window[b, i + depth] if i + depth <= seq else 0
                joined = np.concatenate(
                    [
                        rms_norm(embed[token_in], p[prefix + "enorm.weight"], eps),
                        rms_norm(hidden[b, i], p[prefix + "hnorm.weight"], eps),
                    ]
                )
                new_hidden[b, i] = p[prefix + "eh_proj.weight"] @ joined
                target = i + depth + 1
                if target > seq or doc_ids[b, target] != doc_ids[b, i]:
                    continue
                logits = head @ rms_norm(new_hidden[b, i], p[prefix + "shared_head.norm.weight"], eps)
                total -= log_softmax(logits)[window[b, target]]
                count += 1
        losses.append(total / count)
        hidden = new_hidden
    return coeff * float(np.mean(losses))


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_loss_equals_a_numpy_transcription_of_the_formula(depths):
    rng = np.random.default_rng(7)
    model = MoETransformer(tiny(mtp_layers=depths), seed=3, moe=MOE)
    make_blocks_identity(model, rng)
    window = rng.integers(0, VOCAB, (2, SEQ + 1))
    doc_ids = np.array([[0] * 5 + [1] * 8, [0] * 13])  # a document boundary inside the first window
    batch = {"input_ids": window, "doc_ids": doc_ids}
    hidden0 = model(Tensor(window[:, :-1].astype(np.int32)), Tensor(doc_ids[:, :-1].astype(np.int32)), True)[OUT_HEAD]
    expected = numpy_mtp_loss(model, window, doc_ids, hidden0.asnumpy(), coeff=0.25)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.0)
    stats = CompiledStep(model, optimizer, 0.0, 1, mtp_loss_coeff=0.25).step([batch])
    assert stats.mtp_loss == pytest.approx(expected, rel=1e-4)
    assert stats.loss == pytest.approx(stats.lm_loss + stats.aux_loss + stats.z_loss + stats.mtp_loss, rel=1e-5)


def test_without_mtp_layers_the_step_reports_no_mtp_loss_and_the_model_builds_none():
    model = MoETransformer(tiny(), seed=3, moe=MOE)
    assert not any(p.name.startswith("mtp_layers.") for p in model.get_parameters())
    window = np.arange(2 * (SEQ + 1)).reshape(2, SEQ + 1) % VOCAB
    stats = CompiledStep(model, nn.SGD(model.trainable_params(), learning_rate=0.0), 0.0, 1).step(
        [{"input_ids": window, "doc_ids": np.zeros_like(window)}]
    )
    assert stats.mtp_loss is None


def test_mtp_layers_do_not_change_the_main_model_outputs_or_initial_values():
    ids = Tensor(np.arange(16).reshape(2, 8).astype(np.int32) % VOCAB)
    docs = Tensor(np.zeros((2, 8), np.int32))
    plain, with_mtp = MoETransformer(tiny(), seed=5, moe=MOE), MoETransformer(tiny(mtp_layers=1), seed=5, moe=MOE)
    plain_out, mtp_out = ModelOutput.of(plain(ids, docs)), ModelOutput.of(with_mtp(ids, docs))
    np.testing.assert_array_equal(plain_out.head.asnumpy(), mtp_out.head.asnumpy())
    assert plain_out.aux_loss.asnumpy() == mtp_out.aux_loss.asnumpy()
    assert mtp_out.mtp_hidden.shape == (0,)  # without future ids (evaluation, generation) MTP does not run


def test_parameter_names_and_counts_of_the_mtp_layers():
    cfg = tiny(mtp_layers=2, vocab_size=VOCAB)
    model = MoETransformer(cfg, moe=MOE)
    shapes = parameter_shapes(cfg, include_buffers=True)
    assert [(p.name, tuple(p.shape)) for p in model.get_parameters()] == list(shapes.items())
    one_depth = sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith("mtp_layers.0."))
    assert mtp_layer_parameters(cfg) == one_depth
    counts, plain = count_parameters(cfg), count_parameters(tiny())
    assert counts.mtp == 2 * one_depth and counts.total == plain.total and counts.active == plain.active
    # eh_proj [H, 2H] and three [H] norms beside one MoE decoder layer
    assert shapes["mtp_layers.1.eh_proj.weight"] == (HIDDEN, 2 * HIDDEN)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_mtp_layers_value_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match="model.mtp_layers"):
        validate_model_config(tiny(mtp_layers=value))


ms.set_seed(0)
