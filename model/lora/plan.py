"""The adapter plan: which projections get LoRA adapters, computed from the model config before the build.

    plan = plan_adapters(model_cfg, lora_cfg, seed=0, model_type="glm4_moe")  # "" = the model's own names
    model = MoETransformer(model_cfg, lora=plan)          # adapters in place, base frozen
    report = lora_report(model)

The parameter names of a model are known from its config (:func:`model.param_count.parameter_shapes`),
and their HF module names from :class:`model.hf.weights.NameMap` of the architecture, so PEFT's target
rules are applied to the config, not to a built model. Merging for export is arithmetic on named
arrays (:func:`merged_weights`): ``W + scaling * B @ A`` per adapted weight.

Shape legend (docs/architecture.md): R rank, F input features, O output features, E experts.
"""

import dataclasses
from dataclasses import dataclass
from typing import List

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindmoe.model.config import ModelConfig
from mindmoe.model.hf.weights import NameMap, is_stacked_expert
from mindmoe.model.linear import numpy_of
from mindmoe.model.lora import LoraConfig, is_adapter, resolve_base_dtype, target_matches, validate_lora_config
from mindmoe.model.lora.layers import STORAGE_DTYPES, AdapterScope, AdapterSpec
from mindmoe.model.param_count import parameter_shapes

# The router's correction bias is state moved by the trainer, never a trained tensor.
STATE_SUFFIX = "e_score_correction_bias"
#: Name endings of the 2-D projection weights LoRA can adapt (MLA's ``kv_a_proj_with_mqa`` included).
PROJECTION_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight")
#: Parameters of a DSA indexer (model/dsa.py), never adapted.
INDEXER = ".self_attn.indexer."


@dataclass(frozen=True)
class AdapterPlan:
    """What :class:`MoETransformer` builds for a LoRA run; ``adapted``/``saved`` are our parameter names."""

    config: LoraConfig
    model_type: str  # the HF architecture whose module names the targets were matched against
    seed: int  # of the generator every lora_A is drawn from, in build order
    adapted: tuple  # base weights with adapters: layers.0.self_attn.q_proj.weight, layers.1.mlp.experts.up_proj
    saved: tuple  # modules_to_save parameters, trained in full
    base_dtype: str = "fp32"  # storage of the frozen base weights: lora.base_dtype resolved on the device

    def scope(self) -> AdapterScope:
        """A fresh root scope for one build (its generator starts at ``seed``)."""
        spec = AdapterSpec(self.config.r, self.config.scaling, self.config.dropout, np.random.default_rng(self.seed))
        return AdapterScope(frozenset(self.adapted), spec, "", STORAGE_DTYPES[self.base_dtype], frozenset(self.saved))

    def freeze(self, model) -> None:
        """Only the adapters and the modules_to_save train."""
        for param in model.get_parameters():
            param.requires_grad = param.name in self.saved or is_adapter(param.name)

    def adapter_shapes(self, base_shapes: dict) -> dict:
        """Name -> shape of every tensor an adapter file holds (factors and modules_to_save), in model order."""
        adapted, saved, rank = set(self.adapted), set(self.saved), self.config.r
        shapes = {}
        for name, shape in base_shapes.items():
            if name in adapted:
                prefix = name if len(shape) == 3 else name[: -len(".weight")]
                *experts, out_features, in_features = shape
                shapes[prefix + ".lora_A"] = (*experts, rank, in_features)
                shapes[prefix + ".lora_B"] = (*experts, out_features, rank)
            elif name in saved:
                shapes[name] = tuple(shape)
        return shapes


@dataclass
class LoraTarget:
    """One adaptable projection: our base parameter and the HF module name(s) PEFT would see."""

    param_name: str  # e.g. layers.1.mlp.experts.gate_proj
    hf_modules: list  # [(HF module name, expert row or None)]


def names_type(model_cfg: ModelConfig) -> str:
    """The HF architecture whose module names a mindmoe model's adapters use when no checkpoint gave one:
    ``glm_moe_dsa`` with a DSA indexer, ``deepseek_v3`` for other MLA models, else ``glm4_moe``."""
    if model_cfg.attention_type != "mla":
        return "glm4_moe"
    return "glm_moe_dsa" if model_cfg.dsa.enabled else "deepseek_v3"


def _name_map(model_cfg: ModelConfig, model_type: str) -> NameMap:
    """HF names of ``model_type``, MTP depths (``mtp_layers.{k}``) included when the model has them."""
    return NameMap(model_type or names_type(model_cfg), model_cfg.num_layers if model_cfg.mtp_layers else None)


def adaptable_projections(model_cfg: ModelConfig, model_type: str = "") -> List[LoraTarget]:
    """Every projection LoRA can adapt in a model of ``model_cfg``, in model order (not the DSA indexer's:
    it is not a LoRA layer and stays frozen with the base)."""
    names = _name_map(model_cfg, model_type)
    found = []
    for name, shape in _shapes(model_cfg).items():
        if INDEXER in name:
            continue
        if is_stacked_expert(name):
            found.append(LoraTarget(name, [(_module_of(hf), row) for hf, row in names.to_hf(name, shape[0])]))
        elif name.endswith(PROJECTION_SUFFIXES):
            found.append(LoraTarget(name, [(_module_of(names.to_hf(name)[0][0]), None)]))
    return found


def _shapes(model_cfg: ModelConfig) -> dict:
    # Names do not depend on the vocabulary, which may not be known yet (0 = the tokenizer's).
    return parameter_shapes(dataclasses.replace(model_cfg, vocab_size=max(model_cfg.vocab_size, 1)), True)


def _module_of(hf_param_name: str) -> str:
    return hf_param_name.rsplit(".", 1)[0]


def plan_adapters(
    model_cfg: ModelConfig, cfg: LoraConfig, seed: int = 0, model_type: str = "", device_target: str = None
):
    """The :class:`AdapterPlan` of ``cfg`` on a model of ``model_cfg``; errors name the ``lora.*`` key.

    ``model_type`` names the HF architecture whose module names the targets are matched against
    (the imported checkpoint's; empty for a mindmoe model: :func:`names_type`). ``device_target`` (default:
    the context's) resolves ``lora.base_dtype=auto``.
    """
    model_type = model_type or names_type(model_cfg)
    validate_lora_config(cfg)
    candidates = adaptable_projections(model_cfg, model_type)
    adapted = []
    for target in candidates:
        hits = [target_matches(cfg.target_modules, hf) for hf, _ in target.hf_modules]
        if all(hits):
            adapted.append(target.param_name)
        elif any(hits):
            raise ValueError(
                f"lora.target_modules={_shown(cfg.target_modules)} selects only some experts of "
                f"{target.param_name}; mindmoe adapts all experts of a layer or none"
            )
    if not adapted:
        examples = sorted({hf for t in candidates for hf, row in t.hf_modules if not row})[:8]
        raise ValueError(
            f"lora.target_modules={_shown(cfg.target_modules)} matches no projection of the model; "
            f"module names look like {', '.join(examples)}"
        )
    saved = _modules_to_save(model_cfg, cfg, model_type, set(adapted))
    device = device_target or ms.get_context("device_target")
    base_dtype = resolve_base_dtype(cfg.base_dtype, device)
    return AdapterPlan(cfg, model_type, seed, tuple(adapted), tuple(sorted(saved)), base_dtype)


def _shown(targets) -> str:
    return repr(targets if isinstance(targets, str) else list(targets))


def _modules_to_save(model_cfg: ModelConfig, cfg: LoraConfig, model_type: str, adapted: set) -> set:
    """Our parameter names of the ``modules_to_save`` (PEFT: module name equals or ends with an entry)."""
    if not cfg.modules_to_save:
        return set()
    names = _name_map(model_cfg, model_type)
    saved, used = set(), set()
    for name, shape in _shapes(model_cfg).items():
        hf_names = names.to_hf(name, shape[0] if is_stacked_expert(name) else 0)
        for entry in cfg.modules_to_save:
            if all(_module_of(hf) == entry or _module_of(hf).endswith("." + entry) for hf, _ in hf_names):
                if name in adapted:
                    raise ValueError(
                        f"lora.modules_to_save entry {entry!r} is also a LoRA target ({name}); "
                        "a module is either adapted or trained in full"
                    )
                if not name.endswith(STATE_SUFFIX):
                    saved.add(name)
                    used.add(entry)
    unused = [entry for entry in cfg.modules_to_save if entry not in used]
    if unused:
        raise ValueError(
            f"lora.modules_to_save entries {unused} match no module of the model "
            "(use HF module names such as lm_head or embed_tokens)"
        )
    return saved


@dataclass
class LoraReport:
    trainable: int  # trainable parameter count (adapters + modules_to_save)
    total: int  # all parameters, adapters included
    adapted: List[str]  # our parameter names that got adapters
    saved_modules: List[str]  # our parameter names trained in full (modules_to_save)

    @property
    def share(self) -> float:
        return self.trainable / max(self.total, 1)

    def summary(self) -> str:
        return (
            f"LoRA: {self.trainable:,} trainable parameters of {self.total:,} ({100 * self.share:.3f}%); "
            f"{len(self.adapted)} projections adapted, {len(self.saved_modules)} tensors trained in full"
        )


def lora_report(model) -> LoraReport:
    """The trainable share of a model built with an adapter plan."""
    plan = model.adapter_plan
    trainable = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    total = sum(int(np.prod(p.shape)) for p in model.get_parameters())
    return LoraReport(trainable, total, sorted(plan.adapted), sorted(plan.saved))


def lora_parameters(model) -> dict:
    """Adapter name -> Parameter (``*.lora_A`` / ``*.lora_B``), in model order."""
    return {p.name: p for p in model.get_parameters() if is_adapter(p.name)}


def merged_weights(plan: AdapterPlan, base: dict, adapter: dict) -> dict:
    """Base parameter name -> array after merging: ``W + scaling * B @ A`` for each adapted weight
    (PEFT ``get_delta_weight``; per expert for stacked weights) and the adapter's modules_to_save
    tensors in place of the base ones. ``base``/``adapter`` map our names to numpy arrays."""
    merged = {}
    for name in plan.adapted:
        prefix = name if is_stacked_expert(name) else name[: -len(".weight")]
        lora_A, lora_B = adapter[prefix + ".lora_A"], adapter[prefix + ".lora_B"]
        merged[name] = base[name] + plan.config.scaling * np.matmul(lora_B, lora_A)
    for name in plan.saved:
        merged[name] = adapter[name]
    return merged


def merge_and_unload(model):
    """A plain :class:`MoETransformer` (base parameter names, all trainable but router biases) whose
    weights are ``model``'s with every adapter merged in (for export)."""
    from mindmoe.model.transformer import MoETransformer  # MindSpore graph code; imported only when needed

    # A half base is merged in fp32: the merged weight is the rounded base plus the fp32 delta.
    arrays = {p.name: numpy_of(p).astype(np.float32) for p in model.get_parameters()}
    arrays.update(merged_weights(model.adapter_plan, arrays, arrays))
    plain = MoETransformer(model.config, moe=model.moe_config)
    for param in plain.get_parameters():
        param.set_data(Tensor(arrays[param.name], dtype=param.dtype))
    return plain
