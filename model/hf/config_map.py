"""HF ``config.json`` -> :class:`ModelConfig`, per architecture (``glm4_moe``, ``qwen3_moe``, ``mixtral``).

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
"""

import dataclasses
import math
from dataclasses import dataclass, field

from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.hf.hf_defaults import HF_DEFAULTS
from mindmoe.model.rope_scaling import RopeScalingConfig

SUPPORTED_MODEL_TYPES = ("glm4_moe", "qwen3_moe", "mixtral")
ARCHITECTURES = {"glm4_moe": "Glm4MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}

#: ModelConfig fields an import may change: they alter training or the context length, never the
#: shape or meaning of a pretrained weight. Every other field comes from config.json.
OVERRIDABLE_FIELDS = (
    "dispatch",
    "capacity_factor",
    "aux_loss",
    "aux_loss_coeff",
    "z_loss_coeff",
    "bias_update_rate",
    "expert_lock",
    "lock_run_length",
    "lock_span",
    "isolation_decay",
    "isolation_mode",
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
    reader = _Reader(hf, model_type, source)
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
        fields.update(_glm4_moe_fields(reader))
        # HF ignores model.layers.{46,92}.* by pattern whatever num_nextn_predict_layers says.
        mtp_layers = max(reader.int("num_nextn_predict_layers", optional=True) or 0, 1)
    elif model_type == "qwen3_moe":
        fields.update(_qwen3_moe_fields(reader, fields.get("num_layers")))
    else:
        fields.update(_mixtral_fields(reader, notes))
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
    head_dim = reader.raw("head_dim")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads  # what HF's attention computes when the key is absent
    elif head_dim is not None:
        head_dim = reader.int("head_dim")
    return dict(
        vocab_size=reader.int("vocab_size"),
        hidden_size=hidden,
        num_layers=reader.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=reader.int("num_key_value_heads"),
        head_dim=head_dim,
        rope_theta=reader.float("rope_theta"),
        partial_rotary_factor=reader.float("partial_rotary_factor"),
        rope_interleaved=False,
        max_position_embeddings=reader.int("max_position_embeddings"),
        rope_scaling=rope_scaling_from_hf(reader),
        rms_norm_eps=reader.float("rms_norm_eps"),
        top_k=reader.int("num_experts_per_tok"),
        tie_word_embeddings=reader.bool("tie_word_embeddings"),
        initializer_range=reader.float("initializer_range"),
        dispatch="dropless",
    )


def _glm4_moe_fields(reader: _Reader) -> dict:
    num_layers = reader.int("num_hidden_layers") or 0
    shared = reader.int("n_shared_experts")
    if shared is not None and shared < 1:
        reader.reject("n_shared_experts", "glm4_moe always builds a shared expert; 0 is not supported")
    return dict(
        qkv_bias=reader.bool("attention_bias"),
        qk_norm=reader.bool("use_qk_norm"),
        intermediate_size=reader.int("intermediate_size"),
        # HF: layer i is MoE iff i >= first_k_dense_replace, so a larger value means all dense.
        first_k_dense=min(reader.int("first_k_dense_replace") or 0, num_layers),
        num_experts=reader.int("n_routed_experts"),
        moe_intermediate_size=reader.int("moe_intermediate_size"),
        num_shared_experts=shared,
        score_func="sigmoid",
        expert_bias=True,
        bias_update_rate=0.0,
        n_group=reader.int("n_group"),
        topk_group=reader.int("topk_group"),
        norm_topk_prob=reader.bool("norm_topk_prob"),
        routed_scaling_factor=reader.float("routed_scaling_factor"),
    )


def _softmax_router_fields(reader: _Reader) -> dict:
    if reader.raw("partial_rotary_factor") != 1.0:
        reader.reject("partial_rotary_factor", "this architecture rotates the whole head in HF; only 1.0 is supported")
    return dict(
        score_func="softmax",
        expert_bias=False,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        num_shared_experts=0,
    )


def _qwen3_moe_fields(reader: _Reader, num_layers) -> dict:
    fields = _softmax_router_fields(reader)
    if reader.bool("attention_bias"):
        reader.reject("attention_bias", "qwen3_moe puts a bias on o_proj as well, which mindmoe does not have")
    num_experts = reader.int("num_experts")
    step = reader.int("decoder_sparse_step")
    dense_only = reader.raw("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) for i in dense_only):
        reader.reject("mlp_only_layers", "must be a list of layer indices")
        dense_only = []
    first_k_dense = 0
    if num_layers and step and num_experts:
        # HF: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        moe = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
        first_k_dense = moe[0] if moe else num_layers
        if moe != list(range(first_k_dense, num_layers)):
            dense = sorted(set(range(num_layers)) - set(moe))
            reader.reject(
                "decoder_sparse_step",
                f"with mlp_only_layers={dense_only} makes layers {dense} "
                "dense; mindmoe supports dense layers only at the start "
                "(model.first_k_dense)",
            )
    if not num_experts:
        reader.reject("num_experts", "a qwen3_moe without experts is a dense model; not supported")
    fields.update(
        qkv_bias=False,
        qk_norm=True,
        intermediate_size=reader.int("intermediate_size"),
        first_k_dense=first_k_dense,
        num_experts=num_experts,
        moe_intermediate_size=reader.int("moe_intermediate_size"),
        norm_topk_prob=reader.bool("norm_topk_prob"),
    )
    return fields


def _mixtral_fields(reader: _Reader, notes: list) -> dict:
    fields = _softmax_router_fields(reader)
    if (reader.float("router_jitter_noise", optional=True) or 0.0) > 0:
        notes.append(
            f"router_jitter_noise={reader.raw('router_jitter_noise')} is not used: mindmoe's "
            "router adds no training noise"
        )
    width = reader.int("intermediate_size")
    # Mixtral's experts are as wide as its intermediate_size and it has no dense layer.
    fields.update(
        qkv_bias=False,
        qk_norm=False,
        intermediate_size=width,
        first_k_dense=0,
        num_experts=reader.int("num_local_experts"),
        moe_intermediate_size=width,
        norm_topk_prob=True,
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


def rope_scaling_from_hf(reader: _Reader) -> RopeScalingConfig:
    """HF ``rope_scaling`` -> ours: default/None -> none, linear, dynamic -> dynamic_ntk, yarn."""
    scaling = reader.raw("rope_scaling")
    if scaling is None:
        return RopeScalingConfig()
    if not isinstance(scaling, dict):
        reader.reject("rope_scaling", "must be null or an object")
        return RopeScalingConfig()
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
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
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return RopeScalingConfig(
        type="yarn",
        factor=float(factor),
        original_max_position=int(scaling.get("original_max_position_embeddings") or 0),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        attention_factor=float(attention_factor or 0.0),
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def apply_overrides(imported: ImportedConfig, overrides: dict, source: str = "config.json") -> ModelConfig:
    """``model.*`` settings on top of an imported config.

    Fields in :data:`OVERRIDABLE_FIELDS` replace the imported value; any other field must equal
    what ``config.json`` says (a pretrained model's architecture is not negotiable). ``vocab_size``
    and ``head_dim`` 0 mean "unset" and always agree.
    """
    cfg = imported.model_config
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    changes, problems = {}, []
    for key, value in (overrides or {}).items():
        if key not in known:
            problems.append(f"model.{key}: unknown key")
        elif key in OVERRIDABLE_FIELDS:
            changes[key] = value
        elif key in ("vocab_size", "head_dim") and value == 0:
            continue
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
