"""Whole-model logits of ``MoETransformer`` vs HF ``Glm4MoeForCausalLM`` (transformers 4.57.1,
eager attention, fp32) with our weights copied in.

Tiny GLM-4.5 layout: vocab 64, hidden 32, 3 layers (first dense), 4 heads / 2 KV heads, q/k/v bias,
QK-norm, partial rotary 0.5, 4 routed experts top-2 + 1 shared, sigmoid router with zero
correction bias, n_group = topk_group = 1, norm_topk_prob, routed_scaling_factor 2.5, untied head.
"""

import numpy as np
import pytest
import torch
from mindspore import Tensor
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM

from mindmoe.model.config import ModelConfig
from mindmoe.model.hf.export import hf_named_tensors
from mindmoe.model.moe.token_dispatcher import CapacityDispatcher
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD, ModelOutput
from mindmoe.model.transformer import MoETransformer

VOCAB, HIDDEN, LAYERS, FIRST_DENSE, EXPERTS, TOP_K = 64, 32, 3, 1, 4, 2
BATCH, SEQ = 2, 10
#: HF's MoE layers drop no token.
DROPLESS = MoEConfig(dispatch="dropless")


def ours_config(**overrides):
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        qkv_bias=True,
        qk_norm=True,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        rope_interleaved=False,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        intermediate_size=48,
        first_k_dense=FIRST_DENSE,
        num_experts=EXPERTS,
        top_k=TOP_K,
        moe_intermediate_size=16,
        num_shared_experts=1,
        score_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config(cfg):
    return Glm4MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        partial_rotary_factor=cfg.partial_rotary_factor,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        attention_bias=cfg.qkv_bias,
        use_qk_norm=cfg.qk_norm,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts_per_tok=cfg.top_k,
        n_shared_experts=cfg.num_shared_experts,
        n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=cfg.first_k_dense,
        norm_topk_prob=cfg.norm_topk_prob,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="eager",
    )


def to_hf_state_dict(model):
    """Our parameters under HF glm4_moe 4.57.1 names, by the mapping ``mindmoe-export`` uses."""
    named = ((param.name, param.asnumpy()) for param in model.get_parameters())
    return {name: torch.from_numpy(array.copy()) for name, array in hf_named_tensors(model.config, "glm4_moe", named)}


def randomize(model, seed):
    """O(1)-scale weights: routing decisive, attention far from uniform, every norm weight non-trivial."""
    rng = np.random.default_rng(seed)
    for name, param in model.parameters_and_names():
        if "norm" in name:
            value = 1.0 + 0.2 * rng.normal(size=param.shape)
        elif name.endswith("bias"):
            value = 0.1 * rng.normal(size=param.shape)
        elif "embed_tokens" in name or "lm_head" in name:
            value = rng.normal(size=param.shape)
        else:
            value = 0.2 * rng.normal(size=param.shape)
        param.set_data(Tensor(value.astype(np.float32)))


def build_pair(cfg, seed, moe=DROPLESS):
    ours = MoETransformer(cfg, seed=0, moe=moe)
    assert ours.moe_config == moe
    randomize(ours, seed)
    hf = Glm4MoeForCausalLM(hf_config(cfg)).eval()
    state = to_hf_state_dict(ours)
    assert set(state) == set(hf.state_dict()), "the name mapping must cover every HF tensor exactly"
    hf.load_state_dict(state, strict=True)
    return ours, hf


def capture_routing(hf):
    """Record the top-k indices every HF MoE router returns, per MoE layer."""
    routed = {}
    for layer_idx, layer in enumerate(hf.model.layers):
        if layer_idx >= FIRST_DENSE:

            def hook(module, inputs, output, layer_idx=layer_idx):
                routed[layer_idx] = output[0].numpy()

            layer.mlp.gate.register_forward_hook(hook)
    return routed


def hf_logits(hf, input_ids):
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(input_ids.astype(np.int64))).logits.numpy()


def input_ids(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def sigmoid_pair():
    ours, hf = build_pair(ours_config(), seed=1)
    return ours, hf, capture_routing(hf)


def test_logits_match_hf_glm4_moe_for_causal_lm(sigmoid_pair):
    ours, hf, routed = sigmoid_pair
    ids = input_ids()
    out = ModelOutput.of(ours(Tensor(ids), Tensor(np.zeros_like(ids))))
    logits, aux, router_z = out.head, out.aux_loss, out.z_loss
    counts, dropped = out.routing_stats[:, 0], out.layer_stats[:, 0]
    expected = hf_logits(hf, ids)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    assert np.abs(expected).max() > 1.0, "logits must be far from zero for the check to mean anything"
    np.testing.assert_allclose(logits.asnumpy(), expected, atol=1e-4, rtol=0)
    # The router statistics describe the routing HF performed.
    hf_counts = [np.bincount(routed[i].reshape(-1), minlength=EXPERTS) for i in range(FIRST_DENSE, LAYERS)]
    np.testing.assert_array_equal(counts.asnumpy(), np.stack(hf_counts))
    np.testing.assert_array_equal(dropped.asnumpy(), np.zeros(LAYERS - FIRST_DENSE))
    assert np.isfinite(float(aux.asnumpy())) and np.isfinite(float(router_z.asnumpy()))


def test_packed_documents_give_the_logits_hf_gives_for_each_document_alone(sigmoid_pair):
    # Same [B, S] shape as above, so no recompilation; HF runs every document separately from position 0.
    ours, hf, _ = sigmoid_pair
    ids = input_ids(seed=1)
    lengths = [[4, 6], [3, 5, 2]]
    doc_ids = np.stack([np.repeat(np.arange(len(row)), row) for row in lengths]).astype(np.int32)
    logits = ours(Tensor(ids), Tensor(doc_ids))[OUT_HEAD].asnumpy()
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            alone = hf_logits(hf, ids[row : row + 1, start : start + length])[0]
            np.testing.assert_allclose(logits[row, start : start + length], alone, atol=1e-4, rtol=0)
            start += length


def softmax_router_forward(self, hidden_states):
    """A torch transcription of softmax top-k routing, swapped in for HF's sigmoid router."""
    hidden_states = hidden_states.view(-1, self.config.hidden_size)
    scores = torch.nn.functional.linear(hidden_states.float(), self.weight.float()).softmax(-1)
    topk_weights, topk_indices = torch.topk(scores, self.top_k, dim=-1)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_indices, topk_weights * self.routed_scaling_factor


def test_softmax_routing_with_capacity_dispatch_matches_hf_with_a_softmax_router():
    cfg = ours_config(score_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0)
    capacity = MoEConfig(dispatch="capacity", capacity_factor=float(EXPERTS))  # capacity >= tokens: no drops
    ours, hf = build_pair(cfg, seed=2, moe=capacity)
    assert all(isinstance(layer.mlp.routed.dispatcher, CapacityDispatcher) for layer in ours.layers[FIRST_DENSE:])
    for layer in hf.model.layers[FIRST_DENSE:]:
        layer.mlp.gate.forward = softmax_router_forward.__get__(layer.mlp.gate)
    ids = input_ids(seed=2)
    out = ModelOutput.of(ours(Tensor(ids), Tensor(np.zeros_like(ids))))
    logits, dropped = out.head, out.layer_stats[:, 0]
    np.testing.assert_allclose(logits.asnumpy(), hf_logits(hf, ids), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(dropped.asnumpy(), np.zeros(LAYERS - FIRST_DENSE))
