"""LoRA adapters with PEFT semantics, swapped into a built :class:`MoETransformer`.

    report = apply_lora(model, LoraConfig(enabled=True, r=8, alpha=16), seed=0)   # freezes the base
    merge_and_unload(model)                                                          # back to plain layers

A targeted :class:`~model.linear.Linear` becomes a :class:`LoraLinear` (a subclass holding the same
base parameters) and a :class:`~model.moe.experts.RoutedExperts` becomes a
:class:`LoraRoutedExperts`, so the rest of the model and its parameter names do not change.

PEFT (``peft.tuners.lora.layer.Linear``) semantics:
``y = W x + b + scaling * B (A (dropout(x)))`` with ``A [r, I] ~ U(-1/sqrt(I), 1/sqrt(I))`` (kaiming
uniform, a = sqrt(5)), ``B [O, r] = 0``, ``scaling = alpha / r`` (``alpha / sqrt(r)`` with rslora);
dropout acts on the LoRA branch only, and only while the model is in training mode
(``model.set_train(True)``). Merging adds ``scaling * B @ A`` to ``W``.

Targets use PEFT's ``target_modules`` rules on the **HF module names** of the model
(``model.layers.0.self_attn.q_proj``, ``model.layers.1.mlp.experts.3.gate_proj``): a list entry
matches a module whose name equals it or ends with ``.entry``; a string is a regular expression
that must match the whole name; ``all-linear`` takes every projection. So one setting selects
the same modules here and in PEFT on the original HF model. Routed experts are stacked
``[E, O, I]`` tensors here; their adapters are stacked too: ``A [E, r, I]``, ``B [E, O, r]``, row e
being the factors PEFT gives module ``experts.{e}.<proj>``.

Adapter parameter names: ``<layer>.lora_A`` / ``<layer>.lora_B`` (``layers.0.self_attn.q_proj.lora_A``,
``layers.1.mlp.experts.gate_proj.lora_A``). Shape legend: r rank, I in features, O out features,
E experts, C rows per expert.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindmoe.model.hf.weights import NameMap, is_stacked_expert
from mindmoe.model.linear import Linear
from mindmoe.model.moe.experts import RoutedExperts, RowScaledWeightGradMatmul

#: ``lora.target_modules`` value that takes every projection (PEFT's shorthand).
ALL_LINEAR = "all-linear"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


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


def target_matches(targets, module_name: str) -> bool:
    """PEFT's ``check_target_module_exists`` for ``target_modules``."""
    if isinstance(targets, str):
        return targets == ALL_LINEAR or re.fullmatch(targets, module_name) is not None
    return any(module_name == t or module_name.endswith("." + t) for t in targets)


def _lora_a(rng: np.random.Generator, shape) -> Tensor:
    bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform(a=sqrt(5)) on fan_in = in features
    return Tensor(rng.uniform(-bound, bound, size=shape).astype(np.float32))


class LoraLinear(Linear):
    """A :class:`Linear` plus ``scaling * B (A dropout(x))``; shares the base layer's parameters."""

    def __init__(self, base: Linear, rank: int, scaling: float, dropout: float, rng: np.random.Generator):
        nn.Cell.__init__(self)
        self.weight = base.weight
        self.bias = base.bias
        self.matmul = ops.MatMul(transpose_b=True)
        out_features, in_features = base.weight.shape
        self.lora_A = Parameter(_lora_a(rng, (rank, in_features)), name="lora_A")
        self.lora_B = Parameter(Tensor(np.zeros((out_features, rank), np.float32)), name="lora_B")
        self.scaling = scaling
        self.dropout = dropout

    def construct(self, x):
        shape = x.shape
        x_TI = x.reshape(-1, shape[-1])
        y_TO = self.matmul(x_TI, self.weight)
        if self.bias is not None:
            y_TO = y_TO + self.bias
        if self.dropout > 0 and self.training:
            x_TI = ops.dropout(x_TI, p=self.dropout, training=True)
        low_TR = self.matmul(x_TI, self.lora_A.astype(x_TI.dtype))
        y_TO = y_TO + self.matmul(low_TR, self.lora_B.astype(x_TI.dtype)) * self.scaling
        return y_TO.reshape(shape[:-1] + (y_TO.shape[-1],))

    def delta_weight(self) -> np.ndarray:
        """``scaling * B @ A`` ``[O, I]`` (PEFT ``get_delta_weight``)."""
        return self.scaling * (self.lora_B.asnumpy() @ self.lora_A.asnumpy())


class LoraRoutedExperts(RoutedExperts):
    """:class:`RoutedExperts` with per-expert adapters on some of its projections.

    With gradient isolation (``token_grad``) the adapter factors get the same row-scaled weight
    gradient as the expert weights: a locked token trains its expert's adapters with weight lambda.
    """

    def __init__(
        self, base: RoutedExperts, projections, rank: int, scaling: float, dropout: float, rng: np.random.Generator
    ):
        nn.Cell.__init__(self)
        self.gate_proj, self.up_proj, self.down_proj = base.gate_proj, base.up_proj, base.down_proj
        self.bmm = ops.BatchMatMul(transpose_b=True)
        self.scaled_bmm = RowScaledWeightGradMatmul()
        self.scaling = scaling
        self.dropout = dropout
        self.projections = tuple(p for p in EXPERT_PROJECTIONS if p in projections)
        for proj in EXPERT_PROJECTIONS:
            factors = (None, None)
            if proj in self.projections:
                experts, out_features, in_features = getattr(base, proj).shape
                factors = (
                    Parameter(_lora_a(rng, (experts, rank, in_features)), name=f"{proj}_lora_A"),
                    Parameter(Tensor(np.zeros((experts, out_features, rank), np.float32)), name=f"{proj}_lora_B"),
                )
            setattr(self, f"{proj}_lora_A", factors[0])
            setattr(self, f"{proj}_lora_B", factors[1])

    def _project(self, x_ECI, w_EOI, lora_A_ERI, lora_B_EOR, scale_EC):
        if scale_EC is None:
            y_ECO = self.bmm(x_ECI, w_EOI)
        else:
            y_ECO = self.scaled_bmm(x_ECI, w_EOI, scale_EC)
        if lora_A_ERI is None:
            return y_ECO
        if self.dropout > 0 and self.training:
            x_ECI = ops.dropout(x_ECI, p=self.dropout, training=True)
        lora_A_ERI = lora_A_ERI.astype(x_ECI.dtype)
        lora_B_EOR = lora_B_EOR.astype(x_ECI.dtype)
        if scale_EC is None:
            delta_ECO = self.bmm(self.bmm(x_ECI, lora_A_ERI), lora_B_EOR)
        else:
            delta_ECO = self.scaled_bmm(self.scaled_bmm(x_ECI, lora_A_ERI, scale_EC), lora_B_EOR, scale_EC)
        return y_ECO + delta_ECO * self.scaling

    def _forward(self, x_ECH, scale_EC):
        gate_ECI = self._project(x_ECH, self.gate_proj, self.gate_proj_lora_A, self.gate_proj_lora_B, scale_EC)
        up_ECI = self._project(x_ECH, self.up_proj, self.up_proj_lora_A, self.up_proj_lora_B, scale_EC)
        return self._project(
            ops.silu(gate_ECI) * up_ECI, self.down_proj, self.down_proj_lora_A, self.down_proj_lora_B, scale_EC
        )

    def construct(self, x_ECH):
        return self._forward(x_ECH, None)

    def with_weight_grad_scale(self, x_ECH, scale_EC):
        return self._forward(x_ECH, scale_EC)

    def delta_weight(self, proj: str) -> np.ndarray:
        """``scaling * B_e @ A_e`` for every expert, ``[E, O, I]``."""
        lora_A = getattr(self, f"{proj}_lora_A").asnumpy()
        lora_B = getattr(self, f"{proj}_lora_B").asnumpy()
        return self.scaling * np.matmul(lora_B, lora_A)


@dataclass
class LoraTarget:
    """One adaptable projection: our module path, the base parameter, its HF module name(s)."""

    path: str  # e.g. layers.1.mlp.experts  (the cell to swap)
    projection: str  # "" for a Linear, else the expert projection name
    param_name: str  # e.g. layers.1.mlp.experts.gate_proj
    hf_modules: list  # [(HF module name, expert row or None)]


def adaptable_projections(model, model_type: str = "glm4_moe") -> List[LoraTarget]:
    """Every projection LoRA can adapt, with the HF module names PEFT would see."""
    names = NameMap(model_type)
    found = []
    for path, cell in model.cells_and_names():
        if isinstance(cell, Linear):
            hf_name = names.to_hf(cell.weight.name)[0][0]
            found.append(LoraTarget(path, "", cell.weight.name, [(_module_of(hf_name), None)]))
        elif isinstance(cell, RoutedExperts):
            for proj in EXPERT_PROJECTIONS:
                param = getattr(cell, proj)
                found.append(
                    LoraTarget(
                        path,
                        proj,
                        param.name,
                        [(_module_of(hf), row) for hf, row in names.to_hf(param.name, param.shape[0])],
                    )
                )
    return found


def _module_of(hf_param_name: str) -> str:
    return hf_param_name.rsplit(".", 1)[0]


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


def apply_lora(model, cfg: LoraConfig, seed: int = 0, model_type: str = "glm4_moe") -> LoraReport:
    """Freeze ``model`` and swap adapters into the projections ``cfg.target_modules`` selects.

    ``model_type`` names the HF architecture whose module names the targets are matched against
    (the imported checkpoint's; ``glm4_moe`` for a mindmoe model). Call before anything compiles.
    """
    validate_lora_config(cfg)
    if any(isinstance(cell, (LoraLinear, LoraRoutedExperts)) for _, cell in model.cells_and_names()):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    for block in (layer.mlp for layer in model.layers if layer.is_moe):
        if block.router.has_bias and model.config.bias_update_rate > 0:
            raise ValueError(
                f"model.bias_update_rate={model.config.bias_update_rate}: LoRA keeps the base "
                "model frozen, router correction biases included; set it to 0"
            )
    rng = np.random.default_rng(seed)
    candidates = adaptable_projections(model, model_type)
    chosen = {}
    for target in candidates:
        hits = [target_matches(cfg.target_modules, hf) for hf, _ in target.hf_modules]
        if all(hits):
            chosen.setdefault(target.path, []).append(target)
        elif any(hits):
            raise ValueError(
                f"lora.target_modules={_shown(cfg.target_modules)} selects only some experts of "
                f"{target.param_name}; mindmoe adapts all experts of a layer or none"
            )
    if not chosen:
        examples = sorted({hf for t in candidates for hf, row in t.hf_modules if not row})[:8]
        raise ValueError(
            f"lora.target_modules={_shown(cfg.target_modules)} matches no projection of the model; "
            f"module names look like {', '.join(examples)}"
        )
    saved = _modules_to_save(model, cfg, model_type, chosen)
    names_before = {id(p): p.name for p in model.get_parameters()}
    for param in model.get_parameters():
        param.requires_grad = False
    adapters = {}
    for path, targets in chosen.items():
        cell = _cell(model, path)
        if isinstance(cell, Linear):
            new = LoraLinear(cell, cfg.r, cfg.scaling, cfg.dropout, rng)
            adapters[path] = (new.lora_A, new.lora_B)
        else:
            new = LoraRoutedExperts(cell, [t.projection for t in targets], cfg.r, cfg.scaling, cfg.dropout, rng)
            for proj in new.projections:
                adapters[f"{path}.{proj}"] = (getattr(new, f"{proj}_lora_A"), getattr(new, f"{proj}_lora_B"))
        _replace(model, path, new)
    _restore_names(model, names_before)
    for prefix, (lora_A, lora_B) in adapters.items():
        lora_A.name, lora_B.name = f"{prefix}.lora_A", f"{prefix}.lora_B"
    for param in model.get_parameters():
        if param.name in saved or param.name.endswith((".lora_A", ".lora_B")):
            param.requires_grad = True
    trainable = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    total = sum(int(np.prod(p.shape)) for p in model.get_parameters())
    return LoraReport(trainable, total, sorted(t.param_name for ts in chosen.values() for t in ts), sorted(saved))


def _shown(targets) -> str:
    return repr(targets if isinstance(targets, str) else list(targets))


def _modules_to_save(model, cfg: LoraConfig, model_type: str, chosen: dict) -> set:
    """Our parameter names of the ``modules_to_save`` (PEFT: module name equals or ends with an entry)."""
    if not cfg.modules_to_save:
        return set()
    names = NameMap(model_type)
    adapted = {t.param_name for ts in chosen.values() for t in ts}
    saved, used = set(), set()
    for param in model.get_parameters():
        rows = param.shape[0] if is_stacked_expert(param.name) else 0
        try:
            hf_names = names.to_hf(param.name, rows)
        except KeyError:
            continue
        for entry in cfg.modules_to_save:
            if all(_module_of(hf) == entry or _module_of(hf).endswith("." + entry) for hf, _ in hf_names):
                if param.name in adapted:
                    raise ValueError(
                        f"lora.modules_to_save entry {entry!r} is also a LoRA target ({param.name}); "
                        "a module is either adapted or trained in full"
                    )
                if not param.name.endswith("e_score_correction_bias"):  # state, never trained
                    saved.add(param.name)
                    used.add(entry)
    unused = [entry for entry in cfg.modules_to_save if entry not in used]
    if unused:
        raise ValueError(
            f"lora.modules_to_save entries {unused} match no module of the model "
            "(use HF module names such as lm_head or embed_tokens)"
        )
    return saved


def _cell(model, path: str):
    cell = model
    for part in path.split("."):
        cell = cell._cells[part]  # pylint: disable=protected-access
    return cell


def _replace(model, path: str, new) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = _cell(model, parent_path) if parent_path else model
    if isinstance(parent, nn.CellList):
        parent[int(name)] = new
    else:
        setattr(parent, name, new)


def _restore_names(model, names_before: dict) -> None:
    # MindSpore prefixes the parameters of a cell assigned as an attribute with the attribute name
    # only; the checkpoint format needs the full original names back.
    for param in model.get_parameters():
        if id(param) in names_before:
            param.name = names_before[id(param)]


def lora_parameters(model) -> dict:
    """Adapter name -> Parameter (``*.lora_A`` / ``*.lora_B``), in model order."""
    return {p.name: p for p in model.get_parameters() if p.name.endswith((".lora_A", ".lora_B"))}


def merge_and_unload(model):
    """Add every adapter's ``scaling * B @ A`` to its base weight and swap the plain layers back.

    The result is an ordinary :class:`MoETransformer` with the base parameter names (for export).
    Call before the model's forward has compiled, or use the result in a new compiled function.
    """
    names_before = {id(p): p.name for p in model.get_parameters()}
    for path, cell in list(model.cells_and_names()):
        if isinstance(cell, LoraLinear):
            cell.weight.set_data(Tensor(cell.weight.asnumpy() + cell.delta_weight(), dtype=cell.weight.dtype))
            plain = Linear.__new__(Linear)
            nn.Cell.__init__(plain)
            plain.weight, plain.bias, plain.matmul = cell.weight, cell.bias, ops.MatMul(transpose_b=True)
            _replace(model, path, plain)
        elif isinstance(cell, LoraRoutedExperts):
            for proj in cell.projections:
                weight = getattr(cell, proj)
                weight.set_data(Tensor(weight.asnumpy() + cell.delta_weight(proj), dtype=weight.dtype))
            plain = RoutedExperts.__new__(RoutedExperts)
            nn.Cell.__init__(plain)
            plain.gate_proj, plain.up_proj, plain.down_proj = cell.gate_proj, cell.up_proj, cell.down_proj
            plain.bmm = ops.BatchMatMul(transpose_b=True)
            plain.scaled_bmm = RowScaledWeightGradMatmul()
            _replace(model, path, plain)
    _restore_names(model, names_before)
    for param in model.get_parameters():
        param.requires_grad = not param.name.endswith("e_score_correction_bias")
    return model
