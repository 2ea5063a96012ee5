"""Where a run's model comes from: a fresh initialisation, a HF checkpoint (``model.pretrained``), or
with LoRA a mindmoe checkpoint (``lora.base_checkpoint``). The base is resolved into one model config
first; then the model is built once, with the LoRA adapters in place when ``lora.enabled``.

With ``model.pretrained`` the architecture is the directory's ``config.json``; the ``model.*`` keys
the user set explicitly (command line, chosen recipe, non-default model group: :mod:`conf.explicit_keys`)
may change the context keys only (:data:`model.hf.OVERRIDABLE_FIELDS`), the others must agree with it, and
the weights are
streamed in from its safetensors before anything compiles (a graph does not see later
``set_data``). A model whose base weights a checkpoint provides (``model.pretrained``,
``lora.base_checkpoint``) is built with them deferred (:mod:`model.deferred_init`): nothing is drawn
or allocated for them before they are read. A run that resumes from its own checkpoint builds the
same architecture and skips reading the HF weights, which the checkpoint replaces anyway (that build
still draws its initial values: the trainer sets up precision and the optimizer before it loads).
"""

import dataclasses
import logging

from omegaconf import OmegaConf

from mindmoe.conf.explicit_keys import explicit_keys, model_fields
from mindmoe.conf.key_effects import warn_keys_without_effect as warn_no_effect
from mindmoe.conf.policy import run_dsa_training, run_moe_config
from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.train.lora_setup import check_base_vocab, checkpoint_base_config, load_checkpoint_base, run_lora_config

log = logging.getLogger("mindmoe.train")


def explicit_model_keys(task_overrides, runtime=None) -> set:
    """Fields of ``model.*`` set explicitly: by the command line (Hydra's ``overrides.task``, e.g.
    ``["model.rope_theta=1e6", "model.rope_scaling.factor=4"]`` -> ``{"rope_theta", "rope_scaling"}``)
    or by a chosen recipe / model group (``recipe=pretrain_tiny_aux_free`` -> ``score_func``, ...);
    ``model.pretrained`` itself excluded. ``runtime``: see :func:`conf.explicit_keys.explicit_keys`.
    Their values are read from the composed config."""
    return model_fields(explicit_keys(task_overrides, runtime))


def warn_keys_without_effect(cfg, keys) -> None:
    """The one start-of-run warning naming the explicit dotted ``keys`` the run ignores
    (:mod:`conf.key_effects`), judged on the model the run will build."""
    warn_no_effect(keys, cfg, planned_model_config(cfg, model_fields(keys)))


def model_overrides(model_cfg: ModelConfig, fields) -> dict:
    """``{field: value}`` of the explicitly set ``model.*`` ``fields``, with their typed values from ``model_cfg``."""
    return {key: getattr(model_cfg, key) for key in sorted(fields)}


def planned_model_config(cfg, explicit_keys=()) -> ModelConfig:
    """The architecture the run will build, known before the data is prepared: ``model.pretrained``'s
    config.json with the explicit ``model.*`` keys (so a wrong directory or a conflicting key fails
    first), or ``lora.base_checkpoint``'s state.json, else ``cfg.model``. ``vocab_size`` may still be
    0 (= the tokenizer's)."""
    model_cfg = OmegaConf.to_object(cfg.model)
    lora_cfg = run_lora_config(cfg)
    if lora_cfg is not None and lora_cfg.base_checkpoint:
        return checkpoint_base_config(lora_cfg.base_checkpoint)[1]
    if not model_cfg.pretrained:
        return model_cfg
    from mindmoe.model.hf import read_pretrained_config

    return read_pretrained_config(
        model_cfg.pretrained, model_overrides(model_cfg, explicit_keys), max_seq_len=cfg.data.seq_len
    ).model_config


def build_model(cfg, vocab_size: int, explicit_keys=(), load_weights: bool = True, expert_dispatcher=None):
    """``(ModelConfig, MoETransformer)`` for the run ``cfg``, built once, with its LoRA adapters in place
    when ``lora.enabled``; ``vocab_size`` is the tokenizer's.

    ``explicit_keys``: the ``model.*`` fields the user set (see :func:`explicit_model_keys`); only
    read with ``model.pretrained``, where every other model field comes from ``config.json``.
    ``expert_dispatcher``: see :class:`model.transformer.MoETransformer` (``Distributed.expert_dispatcher``).
    """
    from mindmoe.model.lora.plan import plan_adapters
    from mindmoe.model.transformer import MoETransformer  # MindSpore graph code; imported only when needed

    model_cfg = OmegaConf.to_object(cfg.model)
    lora_cfg = run_lora_config(cfg)
    if model_cfg.pretrained:
        overrides = model_overrides(model_cfg, explicit_keys)
        return _pretrained(cfg, vocab_size, overrides, load_weights, lora_cfg, expert_dispatcher)
    if lora_cfg is not None and lora_cfg.base_checkpoint:
        return _checkpoint_base(cfg, vocab_size, lora_cfg, expert_dispatcher)
    model_cfg = dataclasses.replace(model_cfg)
    if model_cfg.vocab_size == 0:
        model_cfg.vocab_size = vocab_size
    _check_vocab(model_cfg, vocab_size)
    validate_model_config(model_cfg)
    adapters = None if lora_cfg is None else plan_adapters(model_cfg, lora_cfg, cfg.train.seed)
    return model_cfg, MoETransformer(
        model_cfg,
        seed=cfg.train.seed,
        cell_reuse=cfg.train.cell_reuse,
        expert_dispatcher=expert_dispatcher,
        lora=adapters,
        moe=run_moe_config(cfg),
        dsa=run_dsa_training(cfg),
    )


def _checkpoint_base(cfg, vocab_size: int, lora_cfg, expert_dispatcher):
    from mindmoe.model.deferred_init import checkpoint_weights, finish_deferred
    from mindmoe.model.lora.plan import plan_adapters
    from mindmoe.model.transformer import MoETransformer

    path = lora_cfg.base_checkpoint
    # Hash-checked by load_checkpoint_base: only the files this process reads.
    directory, model_cfg = checkpoint_base_config(path)
    check_base_vocab(model_cfg, vocab_size, path)
    adapters = plan_adapters(model_cfg, lora_cfg, cfg.train.seed)
    with checkpoint_weights():  # every base weight comes from the checkpoint: none is drawn first
        model = MoETransformer(
            model_cfg,
            cell_reuse=cfg.train.cell_reuse,
            expert_dispatcher=expert_dispatcher,
            lora=adapters,
            moe=run_moe_config(cfg),
            dsa=run_dsa_training(cfg),
        )
    load_checkpoint_base(model, directory, path)
    finish_deferred(model)
    return model_cfg, model


def _pretrained(cfg, vocab_size: int, overrides: dict, load_weights: bool, lora_cfg, expert_dispatcher):
    from mindmoe.model.hf import load_hf_pretrained, read_pretrained_config
    from mindmoe.model.lora.plan import plan_adapters
    from mindmoe.model.transformer import MoETransformer

    path, seq_len, cell_reuse = cfg.model.pretrained, cfg.data.seq_len, cfg.train.cell_reuse
    if load_weights:
        model_cfg, model, notes = load_hf_pretrained(
            path,
            overrides,
            max_seq_len=seq_len,
            cell_reuse=cell_reuse,
            lora=lora_cfg,
            lora_seed=cfg.train.seed,
            expert_dispatcher=expert_dispatcher,
            moe=run_moe_config(cfg),
            dsa=run_dsa_training(cfg),
        )
    else:
        imported = read_pretrained_config(path, overrides, max_seq_len=seq_len)
        model_cfg, notes = imported.model_config, imported.notes
        adapters = None if lora_cfg is None else plan_adapters(model_cfg, lora_cfg, cfg.train.seed, imported.model_type)
        model = MoETransformer(
            model_cfg,
            cell_reuse=cell_reuse,
            expert_dispatcher=expert_dispatcher,
            lora=adapters,
            moe=run_moe_config(cfg),
            dsa=run_dsa_training(cfg),
        )
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
