"""What one rank stores of the model, in the trainer's dtypes: the parameter side of ``mindmoe-plan``.

Full training keeps every parameter in fp32 (``train.dtype`` only casts the matmuls) and trains all of
them. A LoRA run (``lora.enabled``) stores the frozen projections, experts, embedding and LM head in
``lora.base_dtype`` resolved on the planned device (bf16 on Ascend), keeps norms, biases, the router
and ``lora.modules_to_save`` in fp32, and trains only the adapters (fp32) and the modules_to_save.
Routed experts and their adapters are split over the ``ep`` ranks of an expert group; everything else
is held whole by every rank. The router's correction bias is an fp32 buffer, never trained.

LoRA targets are matched as the trainer matches them (:func:`model.lora.plan.plan_adapters`, the module
names of the model's own architecture). The DSA indexer is never adapted: it stays frozen with the base, its
matrices in ``lora.base_dtype`` and its LayerNorm fp32, with no gradient.
"""

from dataclasses import dataclass, field
from math import prod
from typing import Optional

from mindmoe.model.config import ModelConfig
from mindmoe.model.param_count import parameter_category, parameter_shapes

#: Bytes per element of a storage dtype name.
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
#: The end of a :attr:`RankParameters.trained_by_layer` key of a decoder layer or MTP depth.
LAYER_SUFFIX = "/layer"
#: Categories whose weight matrices a LoRA run stores in ``lora.base_dtype`` (norms and the router stay fp32).
HALF_CATEGORIES = ("attention", "dense_ffn", "experts", "shared_experts", "embeddings")


@dataclass(frozen=True)
class Trained:
    """What a run trains: ``None`` = every parameter (full training), else the LoRA adapter plan."""

    #: Base weights with adapters; None for full training.
    adapted: Optional[frozenset] = None
    #: modules_to_save parameters (trained in full, fp32).
    saved: frozenset = frozenset()
    rank: int = 0
    #: Storage dtype of the frozen base: fp32 | fp16 | bf16.
    base_dtype: str = "fp32"

    @property
    def lora(self) -> bool:
        return self.adapted is not None

    def trains_in_full(self, name: str) -> bool:
        """Whether parameter ``name`` is trained whole (full training, or a LoRA ``modules_to_save`` tensor)."""
        return not self.lora or name in self.saved


def lora_trained(model: ModelConfig, lora, device_target: str) -> Trained:
    """The :class:`Trained` of a ``lora.*`` section, with the trainer's own target matching and checks, on the
    names the module docstring says (a non-zero ``moe.bias_update_rate`` is refused by
    :func:`conf.policy.run_moe_config`)."""
    # Imported here: the adapter plan needs MindSpore's dtypes, full-training plans do not.
    from mindmoe.model.lora.plan import plan_adapters

    adapters = plan_adapters(model, lora, device_target=device_target)
    return Trained(frozenset(adapters.adapted), frozenset(adapters.saved), lora.r, adapters.base_dtype)


def is_half_base(name: str, shape, trained: Trained) -> bool:
    """A frozen weight matrix stored in ``lora.base_dtype``."""
    return (
        not trained.trains_in_full(name)
        and len(shape) >= 2
        and parameter_category(name) in HALF_CATEGORIES
        and not name.endswith("e_score_correction_bias")
    )


@dataclass
class RankParameters:
    """Per rank: bytes of stored weights and buffers, and elements of trained tensors."""

    weight_bytes: float = 0.0
    trained: float = 0.0
    #: Elements of the trained tensors of the routed experts (split over ep), included in ``trained``.
    trained_experts: float = 0.0
    #: Trained elements of each decoder layer and MTP depth (``layers.3``, ``mtp_layers.0``) and of each tensor
    #: outside them (embedding, LM head, final norm, by name): what ZeRO-3 all-gathers around one computation.
    trained_by_layer: dict = field(default_factory=dict)
    #: Trained elements of the largest single tensor a rank holds (the update scales one gradient at a time).
    largest_tensor: float = 0.0

    @property
    def largest_layer(self) -> float:
        """Trained elements of the largest decoder layer or MTP depth held per rank."""
        return max((v for k, v in self.trained_by_layer.items() if k.endswith(LAYER_SUFFIX)), default=0.0)

    @property
    def largest_outside(self) -> float:
        """Trained elements of the largest tensor outside the layers (the embedding or the LM head)."""
        return max((v for k, v in self.trained_by_layer.items() if not k.endswith(LAYER_SUFFIX)), default=0.0)


def rank_parameters(model: ModelConfig, trained: Trained, ep: int) -> RankParameters:
    """What one rank of an expert group of ``ep`` ranks holds (module docstring)."""
    held = RankParameters()
    base_bytes = DTYPE_BYTES[trained.base_dtype]
    for name, shape in parameter_shapes(model, include_buffers=True).items():
        share = 1 / ep if parameter_category(name) == "experts" and len(shape) == 3 else 1
        numel = prod(shape) * share
        held.weight_bytes += numel * (base_bytes if is_half_base(name, shape, trained) else 4)
        if name.endswith("e_score_correction_bias"):
            continue
        elements = 0.0
        if trained.trains_in_full(name):
            elements = numel
        elif name in trained.adapted:
            elements = adapter_elements(shape, trained.rank) * share
            held.weight_bytes += 4 * elements
        held.trained += elements
        held.largest_tensor = max(held.largest_tensor, elements)
        held.trained_experts += elements if share < 1 else 0
        layer = layer_of(name)
        held.trained_by_layer[layer] = held.trained_by_layer.get(layer, 0.0) + elements
    return held


def layer_of(name: str) -> str:
    """``layers.3/layer`` / ``mtp_layers.0/layer`` of a parameter in a decoder layer or MTP depth, else its name."""
    parts = name.split(".")
    return ".".join(parts[:2]) + LAYER_SUFFIX if parts[0] in ("layers", "mtp_layers") else name


def adapter_elements(shape, rank: int) -> int:
    """Elements of ``lora_A [.., r, in]`` and ``lora_B [.., out, r]`` of a weight ``[.., out, in]``."""
    *experts, out_features, in_features = shape
    return prod(experts) * rank * (in_features + out_features)
