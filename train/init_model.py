"""Where a run's model comes from: a fresh initialisation, or a HF checkpoint (``model.pretrained``).

With ``model.pretrained`` the architecture is the directory's ``config.json``; the ``model.*`` keys
the user typed (command-line overrides) may change training settings only, and the weights are
streamed in from its safetensors before anything compiles (a graph does not see later
``set_data``). A run that resumes from its own checkpoint builds the same architecture and
skips reading the HF weights, which the checkpoint replaces anyway.
"""

import dataclasses
import logging

from omegaconf import OmegaConf

from mindmoe.model.config import ModelConfig, validate_model_config

log = logging.getLogger("mindmoe.train")


def explicit_model_keys(task_overrides) -> set:
    """Fields of ``model.*`` the command line set (Hydra's ``overrides.task``, e.g.
    ``["model.dispatch=capacity", "model.rope_scaling.factor=4"]`` -> ``{"dispatch", "rope_scaling"}``);
    ``model.pretrained`` itself excluded. Their values are read from the composed config."""
    keys = set()
    for item in task_overrides or ():
        key, sep, _ = item.lstrip("+~").partition("=")
        if sep and key.startswith("model.") and key != "model.pretrained":
            keys.add(key[len("model.") :].split(".")[0])
    return keys


def model_overrides(model_cfg: ModelConfig, explicit_keys) -> dict:
    """``{field: value}`` of the explicitly set ``model.*`` fields, with their typed values from ``model_cfg``."""
    return {key: getattr(model_cfg, key) for key in sorted(explicit_keys)}


def planned_model_config(cfg, explicit_keys=()) -> ModelConfig:
    """The architecture the run will build, known before the data is prepared: ``model.pretrained``'s
    config.json with the command-line overrides (so a wrong directory or a conflicting key fails
    first), else ``cfg.model``. ``vocab_size`` may still be 0 (= the tokenizer's)."""
    model_cfg = OmegaConf.to_object(cfg.model)
    if not model_cfg.pretrained:
        return model_cfg
    from mindmoe.model.hf import read_pretrained_config

    return read_pretrained_config(
        model_cfg.pretrained, model_overrides(model_cfg, explicit_keys), max_seq_len=cfg.data.seq_len
    ).model_config


def build_model(cfg, vocab_size: int, explicit_keys=(), load_weights: bool = True):
    """``(ModelConfig, MoETransformer)`` for the run ``cfg``; ``vocab_size`` is the tokenizer's.

    ``explicit_keys``: the ``model.*`` fields the user set (see :func:`explicit_model_keys`); only
    read with ``model.pretrained``, where every other model field comes from ``config.json``.
    """
    from mindmoe.model.transformer import MoETransformer  # MindSpore graph code; imported only when needed

    model_cfg = OmegaConf.to_object(cfg.model)
    if model_cfg.pretrained:
        return _pretrained(
            model_cfg.pretrained,
            vocab_size,
            model_overrides(model_cfg, explicit_keys),
            cfg.data.seq_len,
            load_weights,
            cfg.train.cell_reuse,
        )
    model_cfg = dataclasses.replace(model_cfg)
    if model_cfg.vocab_size == 0:
        model_cfg.vocab_size = vocab_size
    _check_vocab(model_cfg, vocab_size)
    validate_model_config(model_cfg)
    return model_cfg, MoETransformer(model_cfg, seed=cfg.train.seed, cell_reuse=cfg.train.cell_reuse)


def _pretrained(path: str, vocab_size: int, overrides: dict, seq_len: int, load_weights: bool, cell_reuse: bool):
    from mindmoe.model.hf import load_hf_pretrained, read_pretrained_config
    from mindmoe.model.transformer import MoETransformer

    if load_weights:
        model_cfg, model, notes = load_hf_pretrained(path, overrides, max_seq_len=seq_len, cell_reuse=cell_reuse)
    else:
        imported = read_pretrained_config(path, overrides, max_seq_len=seq_len)
        model_cfg, notes = imported.model_config, imported.notes
        model = MoETransformer(model_cfg, cell_reuse=cell_reuse)
    for note in notes:
        log.info("model.pretrained: %s", note)
    model_cfg = dataclasses.replace(model_cfg, pretrained=str(path))
    _check_vocab(model_cfg, vocab_size)
    log.info(
        "model.pretrained: %s %s (%s)",
        "loaded" if load_weights else "architecture of",
        path,
        "weights replaced by the resumed checkpoint" if not load_weights else "HF weights",
    )
    return model_cfg, model


def _check_vocab(model_cfg: ModelConfig, vocab_size: int) -> None:
    if model_cfg.vocab_size < vocab_size:
        source = f"{model_cfg.pretrained}/config.json" if model_cfg.pretrained else "model.vocab_size"
        raise ValueError(
            f"{source}: vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
            f"{vocab_size}; token ids past the embedding table would be out of range"
        )
