"""HF ``config.json`` -> :class:`ModelConfig`, per architecture (``glm4_moe``, ``qwen3_moe``, ``mixtral``,
``deepseek_v3``, ``glm4_moe_lite``, ``glm_moe_dsa``).

The reverse (a ``config.json`` for an export) is :func:`model.hf.export.hf_config_from_model`.

``config.json`` is read as data only: ``auto_map`` (``trust_remote_code``) is noted and never
followed. Keys missing from a ``config.json`` take the defaults of the transformers 4.57.1 config
class of that ``model_type``, exactly as ``from_pretrained`` would. Every setting mindmoe cannot
reproduce is an error naming the key; settings that do not change the forward pass mindmoe runs
(attention dropout, router jitter noise) become notes.

==============  ==========================  ==========================  ===========================
                glm4_moe                    qwen3_moe                   mixtral
==============  ==========================  ==========================  ===========================
router          sigmoid + correction bias,  softmax, top-k,             softmax, top-k, always
                group-limited top-k         ``norm_topk_prob``          renormalised
shared experts  ``n_shared_experts``        none                        none
dense layers    first ``first_k_dense_``    ``mlp_only_layers`` /       none
                ``replace``                 ``decoder_sparse_step``
                                            (leading layers only)
attention       q/k/v bias optional,        QK-norm, no bias            no bias, no QK-norm
                QK-norm optional
RoPE            rotate_half, partial        rotate_half, full           rotate_half, full
==============  ==========================  ==========================  ===========================

``deepseek_v3`` has glm4_moe's router, shared experts and dense layers, and MLA attention
(``model.attention_type=mla``; ``q_lora_rank`` null = plain ``q_proj``), RoPE on ``qk_rope_head_dim``
channels, interleaved when ``rope_interleave``; YaRN's ``mscale_all_dim`` also scales the softmax.
``glm4_moe_lite`` (GLM-4.7-Flash, transformers 5.23) is the same model with its dense layers listed in
``mlp_layer_types``; ``glm_moe_dsa`` (GLM-5) adds DeepSeek Sparse Attention's indexer to every layer
(``model.dsa``; :mod:`model.hf.dsa_fields`). A ``config.json`` written by transformers 5 (``rope_parameters``)
imports like one written by transformers 4 (:mod:`model.hf.rope_parameters`).
"""

import dataclasses
import math
from dataclasses import dataclass, field

from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.hf.arch_fields import (
    deepseek_v3_fields,
    glm4_moe_fields,
    glm4_moe_lite_fields,
    mixtral_fields,
    qwen3_moe_fields,
)
from mindmoe.model.hf.dsa_fields import dsa_override, glm_moe_dsa_fields
from mindmoe.model.hf.hf_defaults import HF_DEFAULTS
from mindmoe.model.hf.rope_parameters import with_transformers4_rope_keys
from mindmoe.model.rope_scaling import RopeScalingConfig

SUPPORTED_MODEL_TYPES = ("glm4_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe_lite", "glm_moe_dsa")
ARCHITECTURES = {
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
#: Architectures whose attention is MLA (``model.attention_type=mla``); the others are GQA.
MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", "glm_moe_dsa")

#: ModelConfig fields an import may change: the context length and the initialisation of what is new (adapters,
#: extra MTP depths), never the shape or meaning of a pretrained weight. Every other field comes from config.json.
OVERRIDABLE_FIELDS = (
    "initializer_range",
    "max_position_embeddings",
    "rope_scaling",
)


class HFCheckpointError(ValueError):
    """A HF checkpoint directory (or an export target) mindmoe cannot read or write faithfully."""


@dataclass
class ImportedConfig:
    """What ``config.json`` says, in mindmoe terms."""

    model_type: str
    model_config: ModelConfig
    #: Trailing ``model.layers.{num_hidden_layers + i}`` blocks that are multi-token-prediction
    #: heads (GLM-4.5), skipped when loading.
    mtp_layers: int = 0
    notes: list = field(default_factory=list)


class _Reader:
    """Typed access to one config.json dict with the architecture's defaults; collects problems."""

    def __init__(self, hf: dict, model_type: str, source: str):
        self.hf, self.defaults, self.source = hf, HF_DEFAULTS[model_type], source
        self.problems = []

    def raw(self, key):
        return self.hf[key] if key in self.hf else self.defaults.get(key)

    def _typed(self, key, kinds, what, optional=False):
        value = self.raw(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            self.problems.append(f"{key}={value!r}: must be {what}")
            return None
        return value

    def int(self, key, optional=False):
        return self._typed(key, (int,), "an integer", optional)

    def float(self, key, optional=False):
        value = self._typed(key, (int, float), "a number", optional)
        return None if value is None else float(value)

    def bool(self, key):
        return self._typed(key, (bool,), "true or false")

    def reject(self, key, why):
        self.problems.append(f"{key}={self.raw(key)!r}: {why}")


def read_hf_config(hf: dict, source: str = "config.json", max_seq_len: int = 0) -> ImportedConfig:
    """Map a parsed ``config.json`` to a validated :class:`ModelConfig` (MoE layers ``dropless``).

    ``max_seq_len`` is the longest sequence the caller will run (0 = ``max_position_embeddings``);
    a sliding attention window is accepted only if it is at least that long, because mindmoe
    attends over the whole causal context. Raises :class:`HFCheckpointError` listing every problem.
    """
    if not isinstance(hf, dict):
        raise HFCheckpointError(f"{source}: must hold a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"{source}: model_type={model_type!r} is not supported; mindmoe imports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    notes = []
    if hf.get("auto_map"):
        notes.append(
            f"{source} has auto_map (custom code for trust_remote_code); it is read as data "
            f"only and no shipped code runs; the weights are loaded as {model_type}"
        )
    hf, rope_problem = with_transformers4_rope_keys(hf)
    reader = _Reader(hf, model_type, source)
    if rope_problem:
        reader.reject("rope_parameters", rope_problem)
    if hf.get("quantization_config"):
        reader.reject("quantization_config", "quantized checkpoints are not supported; use the bf16/fp16/fp32 release")
    if reader.raw("hidden_act") != "silu":
        reader.reject("hidden_act", "mindmoe's FFNs are SwiGLU; only 'silu' is supported")
    if (reader.float("attention_dropout", optional=True) or 0.0) > 0:
        notes.append(
            f"attention_dropout={reader.raw('attention_dropout')} is not used: mindmoe has no attention dropout"
        )
    fields = _common_fields(reader, model_type)
    mtp_layers = 0
    if model_type == "glm4_moe":
        fields.update(glm4_moe_fields(reader))
        # HF ignores model.layers.{46,92}.* by pattern whatever num_nextn_predict_layers says.
        mtp_layers = max(reader.int("num_nextn_predict_layers", optional=True) or 0, 1)
    elif model_type == "deepseek_v3":
        fields.update(deepseek_v3_fields(reader))
        # DeepSeek-V3 stores its MTP module as model.layers.61.*, which HF ignores.
        mtp_layers = reader.int("num_nextn_predict_layers", optional=True) or 0
    elif model_type == "glm4_moe_lite":
        fields.update(glm4_moe_lite_fields(reader, notes))
        mtp_layers = reader.int("num_nextn_predict_layers", optional=True) or 0
    elif model_type == "glm_moe_dsa":
        fields.update(glm_moe_dsa_fields(reader, notes))
        # GLM-5 stores its MTP layer as model.layers.78.*, which transformers ignores; its config.json counts it.
        mtp_layers = reader.int("num_nextn_predict_layers", optional=True) or 0
    elif model_type == "qwen3_moe":
        fields.update(qwen3_moe_fields(reader, fields.get("num_layers")))
    else:
        fields.update(mixtral_fields(reader, notes))
    _check_sliding_window(reader, model_type, max_seq_len or fields.get("max_position_embeddings") or 0)
    if reader.problems:
        raise HFCheckpointError(
            f"{source} ({model_type}) describes a model mindmoe cannot reproduce:\n  " + "\n  ".join(reader.problems)
        )
    cfg = ModelConfig(**fields)
    try:
        validate_model_config(cfg)
    except ValueError as err:
        raise HFCheckpointError(f"{source} ({model_type}) maps to an invalid mindmoe config: {err}") from None
    return ImportedConfig(model_type, cfg, mtp_layers, notes)


def _common_fields(reader: _Reader, model_type: str) -> dict:
    hidden, heads = reader.int("hidden_size"), reader.int("num_attention_heads")
    fields = dict(
        vocab_size=reader.int("vocab_size"),
        hidden_size=hidden,
        num_layers=reader.int("num_hidden_layers"),
        num_heads=heads,
        rope_theta=reader.float("rope_theta"),
        max_position_embeddings=reader.int("max_position_embeddings"),
        rope_scaling=rope_scaling_from_hf(reader, mla=model_type in MLA_MODEL_TYPES),
        rms_norm_eps=reader.float("rms_norm_eps"),
        top_k=reader.int("num_experts_per_tok"),
        tie_word_embeddings=reader.bool("tie_word_embeddings"),
        initializer_range=reader.float("initializer_range"),
    )
    if model_type not in MLA_MODEL_TYPES:
        head_dim = reader.raw("head_dim")
        if head_dim is None and hidden and heads:
            head_dim = hidden // heads  # what HF's attention computes when the key is absent
        elif head_dim is not None:
            head_dim = reader.int("head_dim")
        fields.update(
            num_kv_heads=reader.int("num_key_value_heads"),
            head_dim=head_dim,
            partial_rotary_factor=reader.float("partial_rotary_factor"),
            rope_interleaved=False,
        )
    return fields


def _check_sliding_window(reader: _Reader, model_type: str, used_length: int):
    if model_type == "glm4_moe":
        return
    if model_type == "qwen3_moe" and not reader.raw("use_sliding_window"):
        return  # Qwen3MoeConfig sets sliding_window to None unless use_sliding_window
    window = reader.raw("sliding_window")
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool):
        reader.reject("sliding_window", "must be null or an integer")
    elif window < used_length:
        reader.reject(
            "sliding_window",
            f"is shorter than the {used_length} positions in use; mindmoe attends "
            f"over the whole causal context, which equals the window only for "
            f"sequences of at most {window} tokens (pass max_seq_len <= {window})",
        )


def rope_scaling_from_hf(reader: _Reader, mla: bool = False) -> RopeScalingConfig:
    """HF ``rope_scaling`` -> ours: default/None -> none, linear, dynamic -> dynamic_ntk, yarn.

    ``mla``: the architecture also scales its softmax by ``mscale_all_dim`` (HF ``deepseek_v3``, with any
    rope type that has a factor); mindmoe does so with yarn only."""
    scaling = reader.raw("rope_scaling")
    if scaling is None:
        return RopeScalingConfig()
    if not isinstance(scaling, dict):
        reader.reject("rope_scaling", "must be null or an object")
        return RopeScalingConfig()
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    mscale_all_dim = scaling.get("mscale_all_dim")
    if mla and mscale_all_dim and rope_type != "yarn":
        reader.reject(
            "rope_scaling",
            f"mscale_all_dim with rope_type {rope_type!r}: mindmoe scales MLA's softmax by it with yarn only",
        )
    if rope_type == "default":
        return RopeScalingConfig()
    if rope_type not in ("linear", "dynamic", "yarn"):
        reader.reject(
            "rope_scaling",
            f"rope_type {rope_type!r} is not supported; mindmoe imports default, linear, dynamic and yarn",
        )
        return RopeScalingConfig()
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        reader.reject("rope_scaling", f"rope_type {rope_type!r} needs a numeric factor")
        return RopeScalingConfig()
    if rope_type == "linear":
        return RopeScalingConfig(type="linear", factor=float(factor))
    if rope_type == "dynamic":
        # transformers 4.57.1 scales from max_position_embeddings (it ignores any original length).
        return RopeScalingConfig(
            type="dynamic_ntk", factor=float(factor), original_max_position=reader.int("max_position_embeddings") or 0
        )
    if scaling.get("truncate", True) is not True:
        reader.reject(
            "rope_scaling",
            "yarn with truncate=false is not supported (mindmoe floors/ceils the correction range like HF's default)",
        )
    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return RopeScalingConfig(
        type="yarn",
        factor=float(factor),
        original_max_position=int(scaling.get("original_max_position_embeddings") or 0),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        attention_factor=float(attention_factor or 0.0),
        mscale_all_dim=float(mscale_all_dim or 0.0) if mla else 0.0,
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def apply_overrides(imported: ImportedConfig, overrides: dict, source: str = "config.json") -> ModelConfig:
    """``model.*`` settings on top of an imported config.

    Fields in :data:`OVERRIDABLE_FIELDS` replace the imported value; any other field must equal
    what ``config.json`` says (a pretrained model's architecture is not negotiable). ``vocab_size``
    and ``head_dim`` 0 mean "unset" and always agree. Of ``dsa`` only the training keys may change
    (:func:`model.hf.dsa_fields.dsa_override`).
    """
    cfg = imported.model_config
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    changes, problems = {}, []
    for key, value in (overrides or {}).items():
        if key not in known:
            problems.append(f"model.{key}: unknown key")
        elif key in OVERRIDABLE_FIELDS:
            changes[key] = value
        elif key == "mtp_layers":  # how many of the checkpoint's MTP depths to load and train
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= imported.mtp_layers:
                changes[key] = value
            else:
                problems.append(
                    f"model.mtp_layers={value!r}: {source} ({imported.model_type}) stores {imported.mtp_layers} "
                    f"multi-token-prediction layer(s) (num_nextn_predict_layers); use 0..{imported.mtp_layers}"
                )
        elif key in ("vocab_size", "head_dim") and value == 0:
            continue
        elif key == "dsa":  # how the indexer trains may change, its shape and index_topk may not
            changes[key], dsa_problems = dsa_override(cfg.dsa, value, source, imported.model_type)
            problems += dsa_problems
        elif value != getattr(cfg, key):
            problems.append(
                f"model.{key}={value!r} conflicts with {source} ({imported.model_type}), which "
                f"gives {getattr(cfg, key)!r}; a pretrained model's architecture comes from its "
                "config, so drop the override"
            )
    if problems:
        raise HFCheckpointError("\n".join(problems))
    cfg = dataclasses.replace(cfg, **changes)
    validate_model_config(cfg)
    return cfg
