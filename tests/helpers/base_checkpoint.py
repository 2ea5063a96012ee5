"""A tiny mindmoe checkpoint to use as a LoRA base (``lora.base_checkpoint``)."""

import dataclasses


def save_tiny_base_checkpoint(directory, step: int):
    """``(model config, model, checkpoint directory)`` of a 2-layer, 4-expert model saved at ``step``."""
    from mindmoe.model.config import ModelConfig
    from mindmoe.model.transformer import MoETransformer
    from mindmoe.train.checkpoints.checkpoint import save_checkpoint

    base_cfg = ModelConfig(
        vocab_size=64,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=24,
        num_experts=4,
        moe_intermediate_size=8,
        max_position_embeddings=64,
    )
    base = MoETransformer(base_cfg, seed=7)
    state = {"model_config": dataclasses.asdict(base_cfg)}
    saved = save_checkpoint(directory, step, list(base.get_parameters()), [], state, keep_last=1)
    return base_cfg, base, saved
