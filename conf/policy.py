"""The MoE training policy of a run (``moe.*``) with ``moe.dispatch=auto`` made concrete. No MindSpore."""

from omegaconf import OmegaConf

from mindmoe.model.moe_config import MoEConfig, validate_moe_config


def run_moe_config(cfg) -> MoEConfig:
    """The run's ``moe.*`` with ``dispatch=auto`` resolved: dropless when the model's weights come from a
    checkpoint (``model.pretrained``, ``lora.base_checkpoint``), capacity for a model initialised here.
    ValueError naming the key for a value no run can use (checked against the model by the model build)."""
    moe = cfg.moe if isinstance(cfg.moe, MoEConfig) else MoEConfig(**OmegaConf.to_container(cfg.moe, resolve=True))
    validate_moe_config(moe)
    if cfg.lora.enabled and moe.bias_update_rate > 0:
        raise ValueError(
            f"moe.bias_update_rate={moe.bias_update_rate}: LoRA keeps the base model frozen, router correction "
            "biases included; set it to 0"
        )
    trained = bool(cfg.model.pretrained) or bool(cfg.lora.enabled and cfg.lora.base_checkpoint)
    return moe.resolved(trained)
