"""Keys that have no effect in the chosen mode: the one table of them, and the warning a run prints.

A key the user set explicitly (command line, recipe, non-default group; :mod:`conf.explicit_keys`)
that the run then ignores is almost always a mistake (a capacity factor under dropless dispatch, a
loss scale in fp32), so every command that starts a run prints ONE warning naming all of them.
Keys left at their defaults are never named. No MindSpore.
"""

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, List, Tuple

from mindmoe.conf.policy import run_moe_config
from mindmoe.model.config import GQA_ONLY_KEYS

log = logging.getLogger("mindmoe.config")


@dataclass(frozen=True)
class NoEffectRule:
    """``keys`` do nothing when ``idle(cfg, model)`` holds; ``why(cfg, model)`` says why.

    ``cfg``: the composed run config; ``model``: the ``ModelConfig`` the run builds (with
    ``model.pretrained`` that is config.json plus the explicit keys, not ``cfg.model``).
    """

    keys: Tuple[str, ...]
    idle: Callable
    why: Callable


RULES = (
    NoEffectRule(
        tuple(f"model.{key}" for key in GQA_ONLY_KEYS),
        lambda cfg, model: model.attention_type == "mla",
        lambda cfg, model: "model.attention_type=mla reads its own widths (q_lora_rank .. v_head_dim), not GQA's",
    ),
    NoEffectRule(
        ("moe.capacity_factor",),
        lambda cfg, model: run_moe_config(cfg).dropless,
        lambda cfg, model: (
            "moe.dispatch=dropless drops no token, so there is no capacity"
            + (" (auto: the weights come from a checkpoint)" if cfg.moe.dispatch == "auto" else "")
        ),
    ),
    NoEffectRule(
        ("moe.lock_run_length", "moe.lock_span", "moe.isolation_decay", "moe.isolation_mode"),
        lambda cfg, model: not cfg.moe.expert_lock,
        lambda cfg, model: "moe.expert_lock=false: locking and its gradient isolation are off",
    ),
    NoEffectRule(
        ("train.loss_scale", "train.loss_scale_window"),
        lambda cfg, model: cfg.train.dtype != "fp16",
        lambda cfg, model: f"train.dtype={cfg.train.dtype}: the dynamic loss scale is used with fp16 only",
    ),
    NoEffectRule(
        ("train.grad_reduce_dtype",),
        lambda cfg, model: cfg.train.dtype == "fp32",
        lambda cfg, model: "train.dtype=fp32: gradients are fp32, and reduced in fp32",
    ),
    NoEffectRule(
        ("train.mtp_loss_coeff",),
        lambda cfg, model: model.mtp_layers == 0,
        lambda cfg, model: "model.mtp_layers=0: there is no multi-token-prediction loss to weight",
    ),
    NoEffectRule(
        ("model.dsa.index_head_dim", "model.dsa.index_topk", "dsa.stage", "dsa.warmup_steps", "dsa.indexer_loss_coeff"),
        lambda cfg, model: not model.dsa.enabled,
        lambda cfg, model: "model.dsa.index_n_heads=0: the model has no DSA indexer",
    ),
    NoEffectRule(
        ("model.dsa.index_topk", "dsa.indexer_loss_coeff"),
        lambda cfg, model: model.dsa.enabled and cfg.dsa.stage == "off",
        lambda cfg, model: "dsa.stage=off: the indexer does not run (dense attention, no indexer loss)",
    ),
    NoEffectRule(
        ("data.text_field", "data.num_proc"),
        lambda cfg, model: cfg.data.format == "sft",
        lambda cfg, model: (
            "data.format=sft: conversations are read from messages or prompt/response, not from text rows"
        ),
    ),
    NoEffectRule(
        ("data.vocab_size",),
        lambda cfg, model: bool(_given_tokenizer(cfg)),
        lambda cfg, model: f"the tokenizer comes from {_given_tokenizer(cfg)}; data.vocab_size sizes one trained here",
    ),
)


def _given_tokenizer(cfg) -> str:
    """The key that names the run's tokenizer, or "" when one is trained on the data."""
    if cfg.data.tokenizer:
        return "data.tokenizer"
    if cfg.model.pretrained:
        return "model.pretrained"
    return "lora.base_checkpoint" if cfg.lora.enabled and cfg.lora.base_checkpoint else ""


def keys_without_effect(explicit: Iterable[str], cfg, model) -> List[Tuple[str, str]]:
    """``[(key, why)]`` for every explicit key a rule of :data:`RULES` makes idle, sorted by key."""
    explicit = set(explicit)
    found = []
    for rule in RULES:
        hit = [key for key in rule.keys if any(k == key or k.startswith(key + ".") for k in explicit)]
        if hit and rule.idle(cfg, model):
            found += [(key, rule.why(cfg, model)) for key in hit]
    return sorted(found)


def warn_keys_without_effect(explicit: Iterable[str], cfg, model) -> List[Tuple[str, str]]:
    """Log the one warning naming the idle keys (nothing when there are none); returns them."""
    found = keys_without_effect(explicit, cfg, model)
    if found:
        log.warning(
            "these keys have no effect in this run: %s",
            "; ".join(f"{key} ({why})" for key, why in found),
        )
    return found
