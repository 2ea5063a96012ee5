"""How a run trains what its architecture has: the MoE policy (``moe.*``, ``moe.dispatch=auto`` made concrete) and
DSA's training schedule (``dsa.*``). No MindSpore."""

from omegaconf import OmegaConf

from mindmoe.model.dsa_config import DSATrainingConfig, validate_dsa_training
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


def run_dsa_training(cfg) -> DSATrainingConfig:
    """The run's ``dsa.*``; ValueError naming the key for a value no run can use, or a dense warm-up under LoRA."""
    dsa = cfg.dsa if isinstance(cfg.dsa, DSATrainingConfig) else DSATrainingConfig(**OmegaConf.to_container(cfg.dsa))
    validate_dsa_training(dsa)
    if cfg.lora.enabled and dsa.stage == "dense_warmup":
        raise ValueError(
            "dsa.stage=dense_warmup with lora.enabled=true: the dense warm-up trains a base model's DSA indexers and "
            "freezes everything else, while LoRA freezes the base; warm the indexers up in a full training run "
            "first, or fine-tune with dsa.stage=sparse (or off)"
        )
    return dsa
