"""The config keys a run sets explicitly: the command line's, plus every key of the group options the
user chose (a recipe, a non-default model group), as if each had been typed.

They matter twice: with ``model.pretrained`` only explicit ``model.*`` keys apply on top of
``config.json`` (the dataclass defaults never do), and an explicit key that has no effect in the
chosen mode is worth a warning (:mod:`conf.key_effects`).

A group option counts when the command line names it (``recipe=lora_business``, ``model=glm45``) or
when it differs from the root ``config.yaml``'s default for its group (chosen through another
option's defaults list). The default options themselves (``model: tiny_moe``, ``recipe:
pretrain_tiny``) are the baseline, like the dataclass defaults: ``mindmoe-train model.pretrained=X``
takes nothing from them. The option files are read as YAML, honouring their ``# @package`` header.
No MindSpore, no Hydra job needed: the overrides list alone is enough for the usual case.
"""

import importlib.resources
import re
from pathlib import Path
from typing import Iterable, List, Optional, Set

from omegaconf import DictConfig, ListConfig, OmegaConf

#: Where mindmoe's own config tree is (``pkg://mindmoe.conf``).
CONFIG_PACKAGE = "mindmoe.conf"
ROOT_CONFIG = "config.yaml"


def explicit_keys(task_overrides: Iterable[str], runtime=None) -> Set[str]:
    """Dotted keys (``moe.expert_lock``, ``train.lr``, ``model.rope_scaling.type``) set by the command
    line (Hydra's ``overrides.task``) or by a chosen group option's YAML file.

    ``runtime``: Hydra's ``hydra.runtime`` node (``choices``, ``config_sources``) when a Hydra job
    runs; without it the group options are the ones the overrides name, read from mindmoe's config tree.
    """
    overrides = [item for item in task_overrides or () if "=" in item]
    config_dirs = _config_dirs(runtime)
    choices = dict(runtime.choices) if runtime is not None else {}
    groups = {group for group in choices if not group.startswith("hydra")}
    keys, named = set(), {}
    for item in overrides:
        key, _, value = item.lstrip("+~").partition("=")
        group, _, package = key.partition("@")
        if group in groups or (not choices and _is_group(group, config_dirs)):
            named[group] = (choices.get(group, value), package or None)
        else:
            keys.add(key)
    defaults = _root_defaults(config_dirs)
    for group, option in choices.items():
        if group in groups and group not in named and option is not None and option != defaults.get(group):
            named[group] = (option, None)
    for group, (option, package) in named.items():
        if option not in (None, "null"):
            keys |= option_keys(group, option, config_dirs, package)
    return keys


def model_fields(keys: Iterable[str]) -> Set[str]:
    """The ``ModelConfig`` fields among dotted ``keys`` (``model.rope_scaling.factor`` -> ``rope_scaling``);
    ``model.pretrained`` itself excluded (it names the base, it does not override it)."""
    fields = {key.split(".")[1] for key in keys if key.startswith("model.") and key.count(".") >= 1}
    return fields - {"pretrained"}


def option_keys(group: str, option: str, config_dirs: List[Path], package: Optional[str] = None) -> Set[str]:
    """Dotted keys the option file ``<group>/<option>.yaml`` sets (its ``defaults`` list excluded)."""
    path = next((d / group / f"{option}.yaml" for d in config_dirs if (d / group / f"{option}.yaml").is_file()), None)
    if path is None:
        return set()
    text = path.read_text(encoding="utf-8")
    package = package or _header_package(text) or "_group_"
    if package == "_global_":
        prefix = ""
    elif package == "_group_":
        prefix = group.replace("/", ".")
    else:
        prefix = package.replace("_global_.", "")
    values = OmegaConf.to_container(OmegaConf.create(text), resolve=False) if text.strip() else {}
    keys = set()
    if isinstance(values, dict):
        for key, value in values.items():
            if key != "defaults":
                _collect(value, f"{prefix}.{key}" if prefix else str(key), keys)
    return keys


def _collect(value, dotted: str, keys: Set[str]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _collect(item, f"{dotted}.{key}", keys)
    else:
        keys.add(dotted)


def _header_package(text: str) -> Optional[str]:
    """The ``# @package <name>`` of a config file, read as Hydra reads it: from the leading ``# @key value``
    lines only (the first other non-empty line, even a plain comment, ends the header)."""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if not re.match(r"#\s*@", stripped):
            return None
        words = stripped.lstrip("#").split()
        if words[0] == "@package" and len(words) == 2:
            return words[1]
    return None


def _config_dirs(runtime) -> List[Path]:
    """The directories of the config search path, in Hydra's order (mindmoe's tree without a job)."""
    sources = [] if runtime is None else list(runtime.get("config_sources") or [])
    dirs = []
    for source in sources:
        if source.get("provider") == "hydra" or source.get("schema") not in ("pkg", "file"):
            continue
        if source["schema"] == "file":
            dirs.append(Path(source["path"]))
        else:
            try:
                dirs.append(Path(str(importlib.resources.files(source["path"]))))
            except ModuleNotFoundError:
                continue
    return dirs or [Path(str(importlib.resources.files(CONFIG_PACKAGE)))]


def _is_group(name: str, config_dirs: List[Path]) -> bool:
    return bool(name) and "." not in name and any((d / name).is_dir() for d in config_dirs)


def _root_defaults(config_dirs: List[Path]) -> dict:
    """``{group: option}`` of the root config's defaults list."""
    path = next((d / ROOT_CONFIG for d in config_dirs if (d / ROOT_CONFIG).is_file()), None)
    defaults = OmegaConf.load(path).get("defaults", []) if path else []
    entries = {}
    for entry in defaults if isinstance(defaults, ListConfig) else []:
        if isinstance(entry, DictConfig):
            for group, option in entry.items():
                entries[str(group).split("@")[0].removeprefix("override ").strip()] = option
    return entries
