"""LoRA fine-tuning runs (``lora.enabled=true``): the base, the adapters, and what checkpoints hold.

The base is ``model.pretrained`` (a HF directory), or ``lora.base_checkpoint`` (a mindmoe checkpoint,
whose ``state.json`` gives the architecture), or else a fresh initialisation. It is resolved into one
model config before anything is built, and :func:`mindmoe.train.init_model.build_model` builds the
model once, with the adapters in place (:mod:`mindmoe.model.lora.plan`). The base is frozen; the
optimizer sees only the adapters (and ``lora.modules_to_save``), so its state exists only for them.
Checkpoints hold those tensors (``model.safetensors``, for an exact resume) and the same adapters in
PEFT format under ``adapter/``, never the base.
"""

import logging
import math
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.lora import LoraConfig, is_adapter  # no MindSpore: the launcher plans with this module

log = logging.getLogger("mindmoe.train")

#: Sub-directory of a LoRA checkpoint holding the PEFT adapter.
ADAPTER_DIR = "adapter"


def run_lora_config(cfg) -> Optional[LoraConfig]:
    """``cfg.lora`` as a :class:`LoraConfig` when ``lora.enabled``, else None; errors name the keys."""
    lora_cfg = OmegaConf.to_object(cfg.lora)
    if not lora_cfg.enabled:
        if lora_cfg.base_checkpoint:
            raise ValueError("lora.base_checkpoint is set but lora.enabled=false")
        return None
    if isinstance(lora_cfg.target_modules, (list, tuple)) or OmegaConf.is_list(lora_cfg.target_modules):
        lora_cfg.target_modules = [str(t) for t in lora_cfg.target_modules]
    lora_cfg.modules_to_save = [str(m) for m in lora_cfg.modules_to_save]
    if lora_cfg.base_checkpoint and cfg.model.pretrained:
        raise ValueError(
            f"lora.base_checkpoint={lora_cfg.base_checkpoint!r} and model.pretrained="
            f"{cfg.model.pretrained!r} both name a base model; keep one"
        )
    return lora_cfg


def checkpoint_base_config(path: str):
    """``(checkpoint directory, ModelConfig)`` of ``lora.base_checkpoint`` (its ``state.json``)."""
    from mindmoe.model.checkpoints.files import checkpoint_model_config
    from mindmoe.train.checkpoints.checkpoint import resolve_checkpoint

    directory = resolve_checkpoint(path)
    try:
        model_cfg = checkpoint_model_config(directory)
        validate_model_config(model_cfg)
    except ValueError as err:
        raise ValueError(f"lora.base_checkpoint={path!r}: {err}") from None
    return directory, model_cfg


def held_expert_rows(model) -> dict:
    """``{name: range}`` of the stacked expert weights of which ``model`` holds a share (``parallel.ep``):
    the rows of the full tensor it holds."""
    from mindmoe.model.lora import EXPERT_PROJECTIONS
    from mindmoe.model.moe.experts import routed_expert_cells

    return {
        getattr(cell, proj).name: range(cell.first_expert, cell.first_expert + cell.num_held)
        for cell in routed_expert_cells(model)
        if cell.num_held < cell.num_experts
        for proj in EXPERT_PROJECTIONS
    }


class HeldRows:
    """A parameter holding rows ``rows`` of a full tensor of ``full_rows`` rows, as checkpoint loading sees it."""

    def __init__(self, param, rows: range, full_rows: int):
        self.param = param
        self.name = param.name
        self.shape = (full_rows,) + tuple(param.shape[1:])
        row = math.prod(param.shape[1:])
        self.part = ("flat", rows.start * row, rows.stop * row)

    def set_part(self, values) -> None:
        from mindspore import Tensor

        self.param.set_data(Tensor(values.reshape(tuple(self.param.shape)), dtype=self.param.dtype))


def load_checkpoint_base(model, directory: Path, path: str) -> None:
    """Copy the base weights of ``lora.base_checkpoint`` into the (LoRA) ``model`` before it compiles; a model
    holding a share of the experts (``parallel.ep``) reads only its rows of the expert tensors."""
    from mindmoe.train.checkpoints.shards import load_group

    held = held_expert_rows(model)
    experts = model.config.num_experts
    tensors = [
        HeldRows(p, held[p.name], experts) if p.name in held else p
        for p in model.get_parameters()
        if not is_adapter(p.name)
    ]
    verify_read_files(Path(directory), tensors)
    try:
        load_group(tensors, Path(directory), "model")
    except ValueError as err:
        raise ValueError(f"lora.base_checkpoint={path!r}: {err}") from None
    log.info("lora.base_checkpoint: base weights from %s", directory)


def verify_read_files(directory: Path, tensors) -> None:
    """Hash-check what loading ``tensors`` reads from the checkpoint: its small files (index, config, tokenizer)
    and the ``.safetensors`` files holding pieces of them, not the others (its optimizer state; under
    ``parallel.ep`` a sharded base's other ranks' files). Every listed file's size is checked."""
    from mindmoe.train.checkpoints.checkpoint import STATE_FILE, read_state, verify_files_read

    listed = read_state(directory)["files"] if (directory / STATE_FILE).is_file() else {}
    small = [name for name in listed if not name.endswith(".safetensors")]
    verify_files_read(directory, tensors, "model", also=small)


def check_base_vocab(model_cfg: ModelConfig, vocab_size: int, path: str) -> None:
    if model_cfg.vocab_size < vocab_size:
        raise ValueError(
            f"lora.base_checkpoint={path!r}: vocab_size={model_cfg.vocab_size} is smaller than the "
            f"tokenizer's {vocab_size}"
        )


class LoraRun:
    """The adapters of one run: what to checkpoint, and how to write them for PEFT."""

    def __init__(self, model, base_name):
        from mindmoe.model.lora.plan import lora_report

        self.config = model.adapter_plan.config
        self.report = lora_report(model)
        self.model = model
        self.model_type = model.adapter_plan.model_type
        self.base_name = base_name
        #: Parameters a checkpoint holds: the trained ones only.
        self.checkpoint_params = list(model.trainable_params())

    def write_adapter(self, directory: Path) -> list:
        """Write the PEFT adapter of the checkpoint being written in ``directory`` into ``directory/adapter``;
        returns the relative file names.

        The values are read back from the checkpoint's model files (written first by every rank, and indexed,
        :func:`save_checkpoint`): rank 0 reads every trained tensor at full size, expert adapters from the
        parts of the expert group (``parallel.ep``), so the adapter is that of one process whatever the
        layout, and writing it needs no collective of its own."""
        from mindmoe.model.checkpoints.shards import read_tensors
        from mindmoe.model.lora.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter

        arrays = dict(read_tensors(Path(directory), "model"))
        save_adapter(self.model, Path(directory) / ADAPTER_DIR, self.config, self.model_type, self.base_name, arrays)
        return [f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}", f"{ADAPTER_DIR}/{ADAPTER_CONFIG}"]


def lora_run_for(cfg, model_cfg: ModelConfig, model) -> Optional[LoraRun]:
    """The :class:`LoraRun` of a model :func:`~mindmoe.train.init_model.build_model` built, or None
    without ``lora.enabled``; prints the trainable share."""
    lora_cfg = run_lora_config(cfg)
    if lora_cfg is None:
        return None
    run = LoraRun(model, str(lora_cfg.base_checkpoint) if lora_cfg.base_checkpoint else model_cfg.pretrained)
    log.info("%s", run.report.summary())
    print(run.report.summary())
    return run
