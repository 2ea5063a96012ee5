"""LoRA layers, created by the model's constructors in place of the plain projections (see :mod:`model.lora`).

A constructor receives an :class:`AdapterScope` (the adapter plan seen from the cell being built) and
asks it by projection name whether that projection gets an adapter::

    self.q_proj = projection(hidden, out, bias, std, rng, lora, "q_proj")   # Linear or LoraLinear

The base weights are drawn from the model's generator exactly as without LoRA; every ``lora_A`` comes
from the plan's own generator in build order, so a plan and a seed give the same adapters on every
build. Parameter names come from the cell tree as for every other parameter: ``lora_A`` of
``layers.0.self_attn.q_proj`` is ``layers.0.self_attn.q_proj.lora_A``.

The routed experts' adapters are in :mod:`model.moe.lora_experts`. Shape legend (docs/architecture.md):
Z rows of a flattened input, R rank, F input features, O output features.
"""

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from mindspore import Parameter, Tensor, ops

from mindmoe.model.linear import Linear
from mindmoe.model.lora import EXPERT_PROJECTIONS


@dataclass
class AdapterSpec:
    """One projection's adapter: rank, scaling, dropout, and the generator its ``lora_A`` is drawn from."""

    rank: int
    scaling: float
    dropout: float
    rng: Optional[np.random.Generator]


class AdapterScope:
    """The adapted parameter names of a plan, seen from the cell under construction (``prefix``)."""

    def __init__(self, adapted=frozenset(), spec: Optional[AdapterSpec] = None, prefix: str = ""):
        self.adapted = adapted
        self.spec = spec
        self.prefix = prefix

    def child(self, name: str) -> "AdapterScope":
        return AdapterScope(self.adapted, self.spec, f"{self.prefix}.{name}" if self.prefix else name)

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

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float, rng: np.random.Generator, adapter):
        super().__init__(in_features, out_features, bias, std, rng)
        self.lora_A = Parameter(lora_a_init(adapter.rng, (adapter.rank, in_features)), name="lora_A")
        self.lora_B = Parameter(Tensor(np.zeros((out_features, adapter.rank), np.float32)), name="lora_B")
        self.scaling = adapter.scaling
        self.dropout = adapter.dropout

    def construct(self, x):
        shape = x.shape
        x_ZF = x.reshape(-1, shape[-1])
        y_ZO = self.matmul(x_ZF, self.weight)
        if self.bias is not None:
            y_ZO = y_ZO + self.bias
        if self.dropout > 0 and self.training:
            x_ZF = ops.dropout(x_ZF, p=self.dropout, training=True)
        low_ZR = self.matmul(x_ZF, self.lora_A.astype(x_ZF.dtype))
        y_ZO = y_ZO + self.matmul(low_ZR, self.lora_B.astype(x_ZF.dtype)) * self.scaling
        return y_ZO.reshape(shape[:-1] + (y_ZO.shape[-1],))


def projection(in_features: int, out_features: int, bias: bool, std: float, rng, lora: AdapterScope, name: str):
    """The :class:`Linear` ``name`` of the cell at ``lora``, with an adapter when the plan gives it one."""
    adapter = lora.linear(name)
    if adapter is None:
        return Linear(in_features, out_features, bias, std, rng)
    return LoraLinear(in_features, out_features, bias, std, rng, adapter)
