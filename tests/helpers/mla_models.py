"""The tiny MLA model config the MLA and DSA tests share: queries and keys 8 + 4 wide (no-RoPE + RoPE), values 6,
both latents 16 wide, 4 heads, 4 experts top-2."""

from mindmoe.model.config import ModelConfig


def tiny_mla_config(**overrides) -> ModelConfig:
    """The tiny MLA :class:`ModelConfig`, with ``overrides`` applied (``num_kv_heads`` is a GQA key MLA does not
    read; it equals the heads, as HF's ``num_key_value_heads`` in the reference configs)."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        attention_type="mla",
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=16,
        intermediate_size=32,
    )
    fields.update(overrides)
    return ModelConfig(**fields)
