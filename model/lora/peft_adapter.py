"""LoRA adapters on disk in PEFT's format, so they load with ``PeftModel.from_pretrained`` on the HF model.

    <dir>/adapter_model.safetensors   only the adapters (and any modules_to_save), PEFT names:
        base_model.model.<HF module>.lora_A.weight   [r, I]
        base_model.model.<HF module>.lora_B.weight   [O, r]
        base_model.model.<HF parameter>              a modules_to_save tensor
    <dir>/adapter_config.json         PEFT's LoraConfig fields (peft_type LORA, r, lora_alpha, ...)

A stacked expert adapter ``A [E, r, I]`` is written as one ``experts.{e}.<proj>`` tensor per expert,
the modules PEFT adapts on a HF ``glm4_moe`` (transformers 4.57). HF names come from
:class:`model.hf.weights.NameMap` of the base model's architecture.

    merge_adapters(model, adapter_dir)   # a plain base model gets W + scaling * B A, in place
"""

import json
from pathlib import Path

import numpy as np
from mindspore import Tensor
from safetensors.numpy import load_file, save_file

from mindmoe.model.hf.weights import NameMap, is_stacked_expert
from mindmoe.model.lora import ADAPTER_SUFFIXES, LoraConfig
from mindmoe.model.lora.plan import merged_weights, plan_adapters

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = ADAPTER_SUFFIXES


class AdapterError(ValueError):
    """An adapter directory that does not fit the model (names the file and the tensor)."""


def peft_tensor_names(param_name: str, shape, names: NameMap) -> list:
    """``[(PEFT key, expert row or None)]`` of one of our trainable parameters."""
    for suffix in LORA_SUFFIXES:
        if param_name.endswith(suffix):
            base = param_name[: -len(suffix)]
            base_param = base if is_stacked_expert(base) else base + ".weight"
            rows = shape[0] if is_stacked_expert(base) else 0
            return [
                (f"{PEFT_PREFIX}{hf.rsplit('.', 1)[0]}{suffix}.weight", row)
                for hf, row in names.to_hf(base_param, rows)
            ]
    rows = shape[0] if is_stacked_expert(param_name) else 0
    return [(PEFT_PREFIX + hf, row) for hf, row in names.to_hf(param_name, rows)]


def adapter_parameters(model) -> list:
    """The parameters an adapter file holds: the adapters and the modules_to_save (= trainable)."""
    return list(model.trainable_params())


def peft_config_dict(cfg: LoraConfig, base_model_name_or_path=None) -> dict:
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else sorted(cfg.target_modules)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_rslora": cfg.rslora,
        "target_modules": targets,
        "modules_to_save": list(cfg.modules_to_save) or None,
        "exclude_modules": None,
        "target_parameters": None,
        "bias": "none",
        "lora_bias": False,
        "fan_in_fan_out": False,
        "use_dora": False,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_adapter(
    model, out_dir, cfg: LoraConfig, model_type: str = "glm4_moe", base_model_name_or_path=None, arrays=None
) -> Path:
    """Write the model's adapters (and modules_to_save) into ``out_dir`` in PEFT format.

    ``arrays`` (name -> array): the values to write instead of the model's own, e.g. the full expert
    adapters of a checkpoint when this process holds only a share of the experts (``parallel.ep``)."""
    names = NameMap(model_type)
    tensors = {}
    for param in adapter_parameters(model):
        array = param.asnumpy() if arrays is None else np.asarray(arrays[param.name])
        for key, row in peft_tensor_names(param.name, array.shape, names):
            tensors[key] = np.ascontiguousarray(array if row is None else array[row])
    if not any(key.endswith((".lora_A.weight", ".lora_B.weight")) for key in tensors):
        raise AdapterError("save_adapter: the model has no LoRA adapters (build it with lora=plan_adapters(...))")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(
        json.dumps(peft_config_dict(cfg, base_model_name_or_path), indent=2) + "\n", encoding="utf-8"
    )
    return out


def read_adapter_config(adapter_dir) -> LoraConfig:
    """``adapter_config.json`` -> :class:`LoraConfig`; settings mindmoe cannot reproduce are errors."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(f"{adapter_dir}: no {ADAPTER_CONFIG} (expected a PEFT LoRA adapter directory)")
    try:
        peft = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdapterError(f"{path}: not valid JSON ({err})") from None
    if peft.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type={peft.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = {
        "use_dora": False,
        "fan_in_fan_out": False,
        "lora_bias": False,
        "bias": "none",
        "layers_to_transform": None,
        "target_parameters": None,
        "exclude_modules": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    for key, plain in unsupported.items():
        if peft.get(key, plain) not in (plain, None, [], {}):
            raise AdapterError(f"{path}: {key}={peft[key]!r} is not supported (needs {plain!r})")
    try:
        return LoraConfig(
            enabled=True,
            r=int(peft["r"]),
            alpha=float(peft["lora_alpha"]),
            dropout=float(peft.get("lora_dropout") or 0.0),
            rslora=bool(peft.get("use_rslora")),
            target_modules=peft["target_modules"],
            modules_to_save=list(peft.get("modules_to_save") or []),
        )
    except KeyError as err:
        raise AdapterError(f"{path}: missing {err}") from None


def load_adapter(model, adapter_dir, model_type: str = "glm4_moe") -> None:
    """Copy an adapter file into a model built with the adapter plan of the same config.

    Every tensor must be used and every adapter filled; call before the model's graph compiles.
    """
    params = adapter_parameters(model)
    arrays = read_adapter_tensors(adapter_dir, {p.name: tuple(p.shape) for p in params}, model_type)
    for param in params:
        param.set_data(Tensor(arrays[param.name], dtype=param.dtype))


def read_adapter_tensors(adapter_dir, shapes: dict, model_type: str = "glm4_moe") -> dict:
    """Our adapter name -> array for every entry of ``shapes`` (our name -> shape), stacked expert
    factors assembled from their per-expert PEFT tensors; one AdapterError lists every mismatch."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}")
    stored = load_file(str(path))
    names = NameMap(model_type)
    used, problems, arrays = set(), [], {}
    for name, shape in shapes.items():
        array = np.empty(shape, np.float32)
        for key, row in peft_tensor_names(name, shape, names):
            expected = tuple(shape if row is None else shape[1:])
            if key not in stored:
                problems.append(f"missing {key} (for {name})")
            elif tuple(stored[key].shape) != expected:
                problems.append(f"{key}: shape {list(stored[key].shape)}, the model needs {list(expected)}")
            else:
                array[() if row is None else row] = stored[key]
                used.add(key)
        arrays[name] = array
    problems += [
        f"unexpected {key} (no such adapter in the model: other target_modules or base model?)"
        for key in sorted(set(stored) - used)
    ]
    if problems:
        raise AdapterError(f"{path} does not fit the model:\n  " + "\n  ".join(problems[:20]))
    return arrays


def merge_adapters(model, adapter_dir, model_type: str = "glm4_moe"):
    """Merge the PEFT adapter in ``adapter_dir`` into the plain ``model`` in place (``W + scaling * B A``
    per target, its modules_to_save tensors replacing the base ones); returns ``model``, ready for export."""
    cfg = read_adapter_config(adapter_dir)
    plan = plan_adapters(model.config, cfg, 0, model_type)
    params = {p.name: p for p in model.get_parameters()}
    adapter = read_adapter_tensors(
        adapter_dir, plan.adapter_shapes({n: p.shape for n, p in params.items()}), model_type
    )
    base = {name: params[name].asnumpy() for name in plan.adapted}
    for name, array in merged_weights(plan, base, adapter).items():
        params[name].set_data(Tensor(array, dtype=params[name].dtype))
    return model


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterError",
    "load_adapter",
    "merge_adapters",
    "peft_config_dict",
    "peft_tensor_names",
    "read_adapter_config",
    "read_adapter_tensors",
    "save_adapter",
]
