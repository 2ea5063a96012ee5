"""Tiny random HF transformers models (torch) to compare mindmoe against: config, O(1) weights, logits, saving."""

import copy
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

VOCAB, HIDDEN, LAYERS = 96, 32, 3
#: The tiny MLA shape of the deepseek_v3, glm4_moe_lite and glm_moe_dsa configs (HF field names): queries and keys
#: 8 + 4 wide (no-RoPE + RoPE), values 6, both latents 16 wide, 4 heads, 8 experts of width 16 top-2.
TINY_MLA_HF = dict(
    hidden_size=HIDDEN,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    v_head_dim=6,
    qk_nope_head_dim=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)


def randomize_hf(hf, seed):
    """O(1) weights; routers strong enough that routing is decisive; glm4_moe biases in [0, 0.3)
    (non-negative so that HF's masking of unselected groups with 0.0 never picks a masked expert)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("e_score_correction_bias"):
                value = 0.3 * torch.rand(tensor.shape, generator=generator)
            elif "norm" in name:
                value = 1.0 + 0.2 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name or "lm_head" in name:
                value = noise
            elif name.endswith("gate.weight"):
                value = 0.5 * noise
            else:
                value = 0.2 * noise
            tensor.copy_(value)
    return hf.eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()


def token_ids(seq_len, seed=0, batch=2):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, seq_len)).astype(np.int32)


def glm4_config(**overrides):
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_bias=True,
        use_qk_norm=True,
        moe_intermediate_size=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Glm4MoeConfig(**fields)


def deepseek_v3_config(**overrides):
    """A tiny DeepSeek-V3: MLA with values narrower than queries/keys (6 vs 8 + 4), 8 experts in 4 groups."""
    fields = dict(
        **TINY_MLA_HF,
        vocab_size=VOCAB,
        num_hidden_layers=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_interleave=True,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


#: YaRN with mscale and mscale_all_dim (MLA's softmax scale), from 16 positions.
DEEPSEEK_V3_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
#: The deepseek_v3 variants the MLA tests run: query compression, interleaved RoPE, YaRN and 4 groups choosing
#: 2; a plain q_proj, rotate-half RoPE and 2 groups choosing 1.
DEEPSEEK_V3_VARIANTS = {
    "q_lora_interleaved_yarn_groups": dict(rope_scaling=DEEPSEEK_V3_YARN),
    "plain_q_rotate_half_two_groups": dict(q_lora_rank=None, rope_interleave=False, n_group=2, topk_group=1),
}


def deepseek_v3_variant(name: str):
    """The random ``DeepseekV3ForCausalLM`` (eager attention) of :data:`DEEPSEEK_V3_VARIANTS` ``[name]``."""
    torch.manual_seed(0)
    config = deepseek_v3_config(attn_implementation="eager", **copy.deepcopy(DEEPSEEK_V3_VARIANTS[name]))
    return randomize_hf(DeepseekV3ForCausalLM(config), seed=len(name))


#: YaRN as transformers 5 writes it (``rope_parameters``, theta inside), with mscale and mscale_all_dim.
TRANSFORMERS5_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    mscale=1.0,
    mscale_all_dim=0.8,
)


def glm4_moe_lite_config(**overrides) -> dict:
    """A tiny GLM-4.7-Flash config (values for transformers 5's ``AutoConfig.for_model``): MLA with values
    narrower than queries/keys (6 vs 8 + 4), 8 experts."""
    values = dict(
        **TINY_MLA_HF,
        model_type="glm4_moe_lite",
        vocab_size=VOCAB,
        num_hidden_layers=LAYERS,
        n_shared_experts=1,
        # GLM-4.7-Flash's; transformers' MLA latent norms keep eps 1e-6 whatever it is
        rms_norm_eps=1e-5,
    )
    values.update(overrides)
    return values


#: The glm4_moe_lite variants the transformers 5 tests build: query compression with interleaved RoPE, YaRN and
#: group-limited routing; a plain q_proj with rotate-half RoPE, two leading dense layers and a transformers-4
#: style ``rope_theta``.
GLM4_MOE_LITE_VARIANTS = {
    "q_lora_interleaved_yarn_groups": glm4_moe_lite_config(
        n_group=4, topk_group=2, rope_parameters=dict(TRANSFORMERS5_YARN)
    ),
    "plain_q_rotate_half_two_dense": glm4_moe_lite_config(
        q_lora_rank=None, rope_interleave=False, mlp_layer_types=["dense", "dense", "sparse"], rope_theta=5000.0
    ),
}


def save_hf(hf, directory, **kwargs):
    hf.save_pretrained(directory, safe_serialization=True, **kwargs)
    return Path(directory)


# glm_moe_dsa (GLM-5): built by the transformers 5 reference (tests/helpers/tf5_reference.py).
#: YaRN with mscale and mscale_all_dim (MLA's softmax scale), from 16 positions.
DSA_YARN = dict(
    rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16, mscale=1, mscale_all_dim=0.8
)


def glm_moe_dsa_config(**overrides) -> dict:
    """A tiny glm_moe_dsa: MLA with values narrower than queries/keys (6 vs 8 + 4), 8 experts, 16 indexer heads keeping
    5 of up to 20 keys; the first layer dense (first_k_dense_replace)."""
    values = dict(
        **TINY_MLA_HF,
        model_type="glm_moe_dsa",
        vocab_size=96,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        index_n_heads=16,
        index_head_dim=8,
        index_topk=5,
    )
    values.update(overrides)
    return values


GLM_MOE_DSA_VARIANTS = {
    # GLM-5's structure, small: three dense layers first (mlp_layer_types), a shared expert, a sigmoid router with
    # its correction bias, routed_scaling_factor 2.5 (the class default), MLA with query compression (values wider
    # than the no-RoPE query part, as GLM-5's 256 vs 192), the indexer with unrotated channels, rope_theta 1e6.
    "glm5_shaped": glm_moe_dsa_config(
        num_hidden_layers=4,
        mlp_layer_types=["dense"] * 3 + ["sparse"],
        first_k_dense_replace=3,
        qk_nope_head_dim=12,
        v_head_dim=16,
        index_head_dim=16,
        rope_parameters=dict(rope_theta=1e6, rope_type="default"),
    ),
    # YaRN (mscale / mscale_all_dim), two dense layers, 8 indexer heads keeping 7, group-limited routing.
    "yarn_two_dense_topk7": glm_moe_dsa_config(
        rope_parameters=dict(DSA_YARN),
        mlp_layer_types=["dense", "dense", "sparse"],
        n_group=4,
        topk_group=2,
        index_n_heads=8,
        index_head_dim=12,
        index_topk=7,
    ),
}
