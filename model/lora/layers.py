"""LoRA layers, created by the model's constructors in place of the plain projections (see :mod:`model.lora`).

A constructor receives an :class:`AdapterScope` (the adapter plan seen from the cell being built) and
asks it by projection name whether that projection gets an adapter::

    self.q_proj = projection(hidden, out, bias, std, rng, lora, "q_proj")   # Linear or LoraLinear

The base weights are drawn from the model's generator exactly as without LoRA; every ``lora_A`` comes
from the plan's own generator in build order, so a plan and a seed give the same adapters on every
build. Parameter names come from the cell tree as for every other parameter: ``lora_A`` of
``layers.0.self_attn.q_proj`` is ``layers.0.self_attn.q_proj.lora_A``.

Dropout (training only, on the adapter input) draws its masks from a :class:`DropoutStream` per adapted
projection (:mod:`model.lora.dropout`), so a resumed run draws the masks of the uninterrupted one.

The routed experts' adapters are in :mod:`model.moe.lora_experts`. Shape legend (docs/architecture.md):
Z rows of a flattened input, R rank, F input features, O output features.
"""

import math
from dataclasses import dataclass
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor

from mindmoe.model.linear import Linear
from mindmoe.model.lora import EXPERT_PROJECTIONS
from mindmoe.model.lora.dropout import DropoutStream


@dataclass
class AdapterSpec:
    """One projection's adapter: rank, scaling, dropout, and the generator its ``lora_A`` is drawn from."""

    rank: int
    scaling: float
    dropout: float
    rng: Optional[np.random.Generator]
    #: Seed of the dropout masks; None: the seed ``rng`` was created with (the plan's), without drawing from it.
    seed: Optional[int] = None

    def dropout_stream(self, name: str) -> Optional[DropoutStream]:
        """The dropout draws of the adapter of parameter ``name`` (None without dropout)."""
        if self.dropout <= 0:
            return None
        seed = self.seed
        if seed is None:
            seed = getattr(getattr(self.rng, "bit_generator", None), "seed_seq", None)
            seed = getattr(seed, "entropy", 0) or 0
        return DropoutStream(name, int(seed), self.dropout)


#: Storage dtypes of ``lora.base_dtype`` once resolved (:func:`model.lora.resolve_base_dtype`).
STORAGE_DTYPES = {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}


class AdapterScope:
    """The adapted parameter names of a plan, seen from the cell under construction (``prefix``).

    ``base_dtype`` (a MindSpore dtype) is the storage of the frozen base weights; ``saved`` (the
    modules_to_save parameters, trained in full) stay fp32 like everything a plain model builds.
    """

    def __init__(
        self,
        adapted=frozenset(),
        spec: Optional[AdapterSpec] = None,
        prefix: str = "",
        base_dtype=ms.float32,
        saved=frozenset(),
    ):
        self.adapted = adapted
        self.spec = spec
        self.prefix = prefix
        self.base_dtype = base_dtype
        self.saved = saved

    def child(self, name: str) -> "AdapterScope":
        prefix = f"{self.prefix}.{name}" if self.prefix else name
        return AdapterScope(self.adapted, self.spec, prefix, self.base_dtype, self.saved)

    def weight_dtype(self, name: str):
        """Storage dtype of the weight ``name`` of this cell (``weight``, ``q_proj.weight``, ``gate_proj``)."""
        return ms.float32 if self.child(name).prefix in self.saved else self.base_dtype

    def frozen(self, name: str) -> bool:
        """Whether the weight ``name`` of this cell is frozen: in a LoRA build (a plan's scope, with an adapter
        spec) every base weight is, except the modules_to_save; a plain model trains them all."""
        return self.spec is not None and self.child(name).prefix not in self.saved

    def linear(self, name: str) -> Optional[AdapterSpec]:
        """The adapter of the :class:`Linear` ``name`` of this cell, or None."""
        return self.spec if f"{self.child(name).prefix}.weight" in self.adapted else None

    def expert_projections(self) -> tuple:
        """The projections of the routed experts at this scope that get adapters."""
        return tuple(p for p in EXPERT_PROJECTIONS if self.child(p).prefix in self.adapted)


#: The scope of a model without adapters.
NO_LORA = AdapterScope()


def lora_a_init(rng: np.random.Generator, shape) -> Tensor:
    bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform(a=sqrt(5)) on fan_in = in features
    return Tensor(rng.uniform(-bound, bound, size=shape).astype(np.float32))


class LoraLinear(Linear):
    """A :class:`Linear` plus ``scaling * B (A dropout(x))``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        std: float,
        rng: np.random.Generator,
        adapter,
        name="lora",
        dtype=ms.float32,
    ):
        super().__init__(in_features, out_features, bias, std, rng, dtype)
        self.lora_A = Parameter(lora_a_init(adapter.rng, (adapter.rank, in_features)), name="lora_A")
        self.lora_B = Parameter(Tensor(np.zeros((out_features, adapter.rank), np.float32)), name="lora_B")
        self.scaling = adapter.scaling
        self.dropout = adapter.dropout
        # ``name``: the projection's name in the model (layers.0.self_attn.q_proj), which keys its masks.
        self.dropout_stream = adapter.dropout_stream(name)

    def construct(self, x):
        shape = x.shape
        x_ZF = x.reshape(-1, shape[-1])
        y_ZO = self.matmul(x_ZF, self.base_weight(x_ZF.dtype))
        if self.bias is not None:
            y_ZO = y_ZO + self.bias_full(self.bias)
        if self.dropout > 0 and self.training:
            x_ZF = self.dropout_stream.drop(x_ZF)
        low_ZR = self.matmul(x_ZF, self.lora_A.astype(x_ZF.dtype))
        y_ZO = y_ZO + self.matmul(low_ZR, self.lora_B.astype(x_ZF.dtype)) * self.scaling
        return y_ZO.reshape(shape[:-1] + (y_ZO.shape[-1],))


def projection(in_features: int, out_features: int, bias: bool, std: float, rng, lora: AdapterScope, name: str):
    """The :class:`Linear` ``name`` of the cell at ``lora``, with an adapter when the plan gives it one."""
    adapter = lora.linear(name)
    dtype = lora.weight_dtype(f"{name}.weight")
    if adapter is None:
        return Linear(in_features, out_features, bias, std, rng, dtype)
    return LoraLinear(in_features, out_features, bias, std, rng, adapter, lora.child(name).prefix, dtype)
