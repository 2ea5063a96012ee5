"""LoRA with PEFT semantics: the ``lora.*`` config and PEFT's rules for choosing the adapted modules.

A LoRA model is built once with its adapters in place (the base is never built first and patched):

    plan = plan_adapters(model_cfg, LoraConfig(enabled=True, r=8, alpha=16), seed=0)  # model/lora/plan.py
    model = MoETransformer(model_cfg, lora=plan)        # LoraLinear / LoraRoutedExperts, base frozen
    plain = merge_and_unload(model)                     # W + scaling * B A in a plain model (export)

PEFT (``peft.tuners.lora.layer.Linear``) semantics:
``y = W x + b + scaling * B (A (dropout(x)))`` with ``A [R, F] ~ U(-1/sqrt(F), 1/sqrt(F))`` (kaiming
uniform, a = sqrt(5)), ``B [O, R] = 0``, ``scaling = alpha / R`` (``alpha / sqrt(R)`` with rslora);
dropout acts on the LoRA branch only, and only while the model is in training mode
(``model.set_train(True)``). Merging adds ``scaling * B @ A`` to ``W``.

Targets use PEFT's ``target_modules`` rules on the **HF module names** of the model
(``model.layers.0.self_attn.q_proj``, ``model.layers.1.mlp.experts.3.gate_proj``): a list entry
matches a module whose name equals it or ends with ``.entry``; a string is a regular expression
that must match the whole name; ``all-linear`` takes every projection. So one setting selects
the same modules here and in PEFT on the original HF model. Routed experts are stacked
``[E, O, F]`` tensors here; their adapters are stacked too: ``A [E, R, F]``, ``B [E, O, R]``, row e
being the factors PEFT gives module ``experts.{e}.<proj>``.

Adapter parameter names: ``<base>.lora_A`` / ``<base>.lora_B`` (``layers.0.self_attn.q_proj.lora_A``,
``layers.1.mlp.experts.gate_proj.lora_A``). Shape legend (docs/architecture.md): R rank, F input
features, O output features, E experts.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

#: ``lora.target_modules`` value that takes every projection (PEFT's shorthand).
ALL_LINEAR = "all-linear"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: ``lora.base_dtype`` values; ``auto`` resolves per device (:func:`resolve_base_dtype`).
BASE_DTYPES = ("auto", "fp32", "fp16", "bf16")
#: What ``lora.base_dtype=auto`` stores the frozen base in, per device target (others: fp32).
AUTO_BASE_DTYPE = {"Ascend": "bf16", "CPU": "fp16", "GPU": "bf16"}
#: Name endings of the adapter factors (``layers.0.self_attn.q_proj.lora_A``).
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


@dataclass
class LoraConfig:
    """LoRA fine-tuning (``lora.*`` keys); names follow PEFT's ``LoraConfig``."""

    #: Train LoRA adapters on a frozen base instead of training every parameter.
    enabled: bool = False
    #: Rank of the adapters (PEFT ``r``).
    r: int = 8
    #: Scaling numerator (PEFT ``lora_alpha``): the update is ``alpha / r * B A``.
    alpha: float = 16.0
    #: Dropout probability on the adapter input (PEFT ``lora_dropout``); the base path never sees it.
    dropout: float = 0.0
    #: Rank-stabilised scaling ``alpha / sqrt(r)`` (PEFT ``use_rslora``).
    rslora: bool = False
    #: Modules to adapt by HF module name: a list of names/suffixes, a regex string matching the
    #: whole name, or ``all-linear``. Covers attention projections, dense MLPs, shared and routed experts.
    target_modules: Any = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    #: Modules trained in full and saved with the adapters (PEFT ``modules_to_save``, e.g. ``[lm_head]``).
    modules_to_save: List[str] = field(default_factory=list)
    #: A mindmoe checkpoint directory whose model weights are the base (instead of ``model.pretrained``
    #: or a fresh initialisation); null = none.
    base_checkpoint: Optional[str] = None
    #: Storage dtype of the frozen base weights (projections, experts, embeddings and LM head unless in
    #: ``modules_to_save``): ``auto | fp32 | fp16 | bf16``. Adapters, modules_to_save, norms, biases, router and
    #: optimizer state stay fp32; a half weight is up-cast per layer to the compute dtype. ``auto``: bf16 on
    #: Ascend, fp16 on CPU (no bf16 MatMul or Gather there and slower bf16 casts; fp16 holds a bf16
    #: checkpoint's weights exactly down to 6e-5).
    base_dtype: str = "auto"

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def validate_lora_config(cfg: LoraConfig) -> None:
    """Raise ValueError naming the ``lora.*`` key whose value cannot work."""
    if cfg.r < 1:
        raise ValueError(f"lora.r={cfg.r} must be >= 1")
    if cfg.alpha <= 0:
        raise ValueError(f"lora.alpha={cfg.alpha} must be > 0")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"lora.dropout={cfg.dropout} must be in [0, 1)")
    targets = cfg.target_modules
    if isinstance(targets, str):
        if targets != ALL_LINEAR:
            try:
                re.compile(targets)
            except re.error as err:
                raise ValueError(f"lora.target_modules={targets!r} is not a valid regular expression ({err})") from None
    elif not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(
            f"lora.target_modules={targets!r} must be a non-empty list of module names, a regex "
            f"string or {ALL_LINEAR!r}"
        )
    if not all(isinstance(m, str) and m for m in cfg.modules_to_save):
        raise ValueError(f"lora.modules_to_save={list(cfg.modules_to_save)!r} must list module names")
    if cfg.base_dtype not in BASE_DTYPES:
        raise ValueError(f"lora.base_dtype={cfg.base_dtype!r} must be one of {', '.join(BASE_DTYPES)}")


def resolve_base_dtype(value: str, device_target: str) -> str:
    """``lora.base_dtype`` as a storage dtype name (``fp32 | fp16 | bf16``) on ``device_target``."""
    if value not in BASE_DTYPES:
        raise ValueError(f"lora.base_dtype={value!r} must be one of {', '.join(BASE_DTYPES)}")
    return AUTO_BASE_DTYPE.get(device_target, "fp32") if value == "auto" else value


def target_matches(targets, module_name: str) -> bool:
    """PEFT's ``check_target_module_exists`` for ``target_modules``."""
    if isinstance(targets, str):
        return targets == ALL_LINEAR or re.fullmatch(targets, module_name) is not None
    return any(module_name == t or module_name.endswith("." + t) for t in targets)


def is_adapter(param_name: str) -> bool:
    return param_name.endswith(ADAPTER_SUFFIXES)
