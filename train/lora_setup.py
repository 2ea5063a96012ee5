"""LoRA fine-tuning runs (``lora.enabled=true``): the base, the adapters, and what checkpoints hold.

The base is ``model.pretrained`` (a HF directory), or ``lora.base_checkpoint`` (a mindmoe checkpoint,
whose ``state.json`` gives the architecture), or else a fresh initialisation. It is frozen; the optimizer
sees only the adapters (and ``lora.modules_to_save``), so its state exists only for them. Checkpoints hold
those tensors (``model.safetensors``, for an exact resume) and the same adapters in PEFT format under
``adapter/``, never the base.
"""

import dataclasses
import logging
from pathlib import Path

from omegaconf import OmegaConf

from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.lora import LoraConfig, LoraReport, apply_lora
from mindmoe.model.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter

log = logging.getLogger("mindmoe.train")

#: Sub-directory of a LoRA checkpoint holding the PEFT adapter.
ADAPTER_DIR = "adapter"


class LoraRun:
    """The adapters of one run: what to checkpoint, and how to write them for PEFT."""

    def __init__(self, lora_cfg: LoraConfig, report: LoraReport, model, model_type: str, base_name):
        self.config = lora_cfg
        self.report = report
        self.model = model
        self.model_type = model_type
        self.base_name = base_name
        #: Parameters a checkpoint holds: the trained ones only.
        self.checkpoint_params = list(model.trainable_params())

    def write_adapter(self, directory: Path) -> list:
        """Write the PEFT adapter into ``directory/adapter``; returns the relative file names."""
        save_adapter(self.model, Path(directory) / ADAPTER_DIR, self.config, self.model_type, self.base_name)
        return [f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}", f"{ADAPTER_DIR}/{ADAPTER_CONFIG}"]


def setup_lora(cfg, model_cfg: ModelConfig, model, vocab_size: int):
    """``(model_cfg, model, LoraRun or None)``: the run's model with adapters when ``lora.enabled``.

    Call before anything compiles: base weights from ``lora.base_checkpoint`` are copied in here.
    """
    lora_cfg = OmegaConf.to_object(cfg.lora)
    if not lora_cfg.enabled:
        if lora_cfg.base_checkpoint:
            raise ValueError("lora.base_checkpoint is set but lora.enabled=false")
        return model_cfg, model, None
    if isinstance(lora_cfg.target_modules, (list, tuple)) or OmegaConf.is_list(lora_cfg.target_modules):
        lora_cfg.target_modules = [str(t) for t in lora_cfg.target_modules]
    lora_cfg.modules_to_save = [str(m) for m in lora_cfg.modules_to_save]
    base_name = model_cfg.pretrained
    model_type = "glm4_moe"
    if model_cfg.pretrained:
        from mindmoe.model.hf import read_pretrained_config

        model_type = read_pretrained_config(model_cfg.pretrained).model_type
        if lora_cfg.base_checkpoint:
            raise ValueError(
                f"lora.base_checkpoint={lora_cfg.base_checkpoint!r} and model.pretrained="
                f"{model_cfg.pretrained!r} both name a base model; keep one"
            )
    elif lora_cfg.base_checkpoint:
        model_cfg, model = _checkpoint_base(lora_cfg.base_checkpoint, vocab_size, cfg.train.cell_reuse)
        base_name = str(lora_cfg.base_checkpoint)
    report = apply_lora(model, lora_cfg, seed=cfg.train.seed, model_type=model_type)
    log.info("%s", report.summary())
    print(report.summary())
    return model_cfg, model, LoraRun(lora_cfg, report, model, model_type, base_name)


def _checkpoint_base(path: str, vocab_size: int, cell_reuse: bool):
    from mindmoe.model.transformer import MoETransformer
    from mindmoe.train.checkpoint import load_model_weights, read_state, resolve_checkpoint, verify_checkpoint

    directory = resolve_checkpoint(path)
    verify_checkpoint(directory)
    state = read_state(directory)
    if "model_config" not in state:
        raise ValueError(f"lora.base_checkpoint={path!r}: {directory}/state.json has no model_config")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_cfg = ModelConfig(**{k: v for k, v in state["model_config"].items() if k in fields})
    validate_model_config(model_cfg)
    if model_cfg.vocab_size < vocab_size:
        raise ValueError(
            f"lora.base_checkpoint={path!r}: vocab_size={model_cfg.vocab_size} is smaller than the "
            f"tokenizer's {vocab_size}"
        )
    model = MoETransformer(model_cfg, cell_reuse=cell_reuse)
    try:
        load_model_weights(list(model.get_parameters()), directory)
    except ValueError as err:
        raise ValueError(f"lora.base_checkpoint={path!r}: {err}") from None
    log.info("lora.base_checkpoint: base weights from %s", directory)
    return model_cfg, model
