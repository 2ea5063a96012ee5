"""RoPE scaling (``model.rope_scaling.*``): the config, its validation and the inverse frequencies.

Pure NumPy float64, no MindSpore: the model turns these frequencies into fp32 tables
(:mod:`model.rope`). Formulas follow HF transformers 4.57.1 ``ROPE_INIT_FUNCTIONS`` where HF
has the type; d is the rotary dim ``int(head_dim * partial_rotary_factor)``.

=============  =====================================================================  ==========
type           inverse frequency ``theta_i``, i in [0, d/2)                            HF type
=============  =====================================================================  ==========
none           ``base^(-2i/d)``                                                        default
linear         ``base^(-2i/d) / factor`` (position interpolation)                      linear
ntk            static NTK-aware: ``base' = base * factor^(d/(d-2))``                   (none)
dynamic_ntk    ``base' = base * (factor*L/L_orig - (factor-1))^(d/(d-2))`` for the     dynamic
               current length L > L_orig, plain RoPE for L <= L_orig
yarn           per-frequency ramp between ``theta_i`` and ``theta_i / factor``;       yarn
               cos and sin are multiplied by ``attention_factor``
=============  =====================================================================  ==========
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

ROPE_SCALING_TYPES = ("none", "linear", "ntk", "dynamic_ntk", "yarn")
# HF names that differ from ours, so an error can point from one to the other.
HF_TYPE_NAMES = {"default": "none", "dynamic": "dynamic_ntk"}
YARN_ONLY_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.0, "mscale_all_dim": 0.0}


@dataclass
class RopeScalingConfig:
    """How RoPE frequencies are stretched beyond the context the model was trained on."""

    #: none | linear | ntk (static NTK-aware) | dynamic_ntk (HF "dynamic") | yarn.
    type: str = "none"
    #: Context-extension factor, >= 1 (1 with type none).
    factor: float = 1.0
    #: Pre-scaling context length L_orig used by dynamic_ntk and yarn; 0 = model.max_position_embeddings
    #: (HF: yarn's ``original_max_position_embeddings``, dynamic's ``max_position_embeddings``).
    original_max_position: int = 0
    #: yarn: frequencies turning more than beta_fast times over L_orig are kept (extrapolated).
    beta_fast: float = 32.0
    #: yarn: frequencies turning fewer than beta_slow times over L_orig are divided by factor.
    beta_slow: float = 1.0
    #: yarn: multiplier on cos and sin; 0 = the YaRN default 0.1*ln(factor)+1.
    attention_factor: float = 0.0
    #: yarn with MLA (DeepSeek-V3's ``mscale_all_dim``): the softmax scale is multiplied by
    #: ``(0.1*mscale_all_dim*ln(factor)+1)^2`` (:func:`yarn_softmax_scale`); 0 = not scaled.
    mscale_all_dim: float = 0.0


def rope_scaling_config(value) -> RopeScalingConfig:
    """Accept the dataclass or a mapping of its fields (a config read back with ``dataclasses.asdict``)."""
    if isinstance(value, RopeScalingConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"model.rope_scaling={value!r}: must be a mapping of {[f.name for f in fields(RopeScalingConfig)]}"
        )
    known = {f.name for f in fields(RopeScalingConfig)}
    for key in value:
        if key not in known:
            raise ValueError(f"model.rope_scaling.{key}: unknown key; known keys are {sorted(known)}")
    return RopeScalingConfig(**dict(value))


def original_max_position(cfg, max_position_embeddings: int) -> int:
    """L_orig of dynamic_ntk and yarn."""
    return rope_scaling_config(cfg).original_max_position or max_position_embeddings


def validate_rope_scaling(cfg, max_position_embeddings: int, rotary_dim: int = 0) -> None:
    """Raise ValueError naming the ``model.rope_scaling.*`` key whose value cannot work.

    ``rotary_dim`` (0 = unknown) lets the NTK types reject d = 2, where d/(d-2) is undefined.
    """
    cfg = rope_scaling_config(cfg)

    def fail(key: str, why: str):
        raise ValueError(f"model.rope_scaling.{key}={getattr(cfg, key)!r}: {why}")

    if cfg.type not in ROPE_SCALING_TYPES:
        hint = f" (HF {cfg.type!r} is {HF_TYPE_NAMES[cfg.type]!r} here)" if cfg.type in HF_TYPE_NAMES else ""
        fail("type", f"must be one of {ROPE_SCALING_TYPES}{hint}")
    if cfg.factor < 1.0:
        fail("factor", "must be >= 1 (it extends the context; 1 = no scaling)")
    if cfg.type == "none" and cfg.factor != 1.0:
        fail(
            "factor", "has no effect with model.rope_scaling.type='none'; choose a scaling type or leave factor at 1.0"
        )
    if cfg.original_max_position < 0:
        fail("original_max_position", "must be >= 0 (0 = model.max_position_embeddings)")
    if cfg.original_max_position and cfg.type not in ("dynamic_ntk", "yarn"):
        fail("original_max_position", f"is only used by dynamic_ntk and yarn; leave it at 0 for type {cfg.type!r}")
    if cfg.type == "yarn" and cfg.original_max_position > max_position_embeddings:
        fail(
            "original_max_position",
            f"exceeds model.max_position_embeddings={max_position_embeddings}; "
            "yarn's tables cover max_position_embeddings, the extended context, "
            "so the original context must not be longer",
        )
    if cfg.type != "yarn":
        for key, default in YARN_ONLY_DEFAULTS.items():
            if getattr(cfg, key) != default:
                fail(key, f"is only used by type 'yarn'; leave it at {default} for type {cfg.type!r}")
    else:
        if cfg.beta_slow <= 0:
            fail("beta_slow", "must be > 0 (a number of rotations over the original context)")
        if cfg.beta_fast <= cfg.beta_slow:
            fail(
                "beta_fast",
                f"must be greater than model.rope_scaling.beta_slow={cfg.beta_slow} "
                "(YaRN defaults: beta_fast 32, beta_slow 1)",
            )
        if cfg.attention_factor < 0:
            fail("attention_factor", "must be > 0, or 0 for the YaRN default 0.1*ln(factor)+1")
        if cfg.mscale_all_dim < 0:
            fail("mscale_all_dim", "must be >= 0 (0 = the softmax scale is not changed)")
    if cfg.type in ("ntk", "dynamic_ntk") and 0 < rotary_dim <= 2:
        fail(
            "type",
            f"needs a rotary dim > 2 (the base exponent is d/(d-2)); the model rotates "
            f"{rotary_dim} channels per head (head_dim * model.partial_rotary_factor)",
        )


def default_inv_freq(rotary_dim: int, base: float) -> np.ndarray:
    """``theta_i = base^(-2i/d)`` for i in [0, d/2), float64."""
    return 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def linear_inv_freq(rotary_dim: int, base: float, factor: float) -> np.ndarray:
    """Position interpolation: every frequency divided by ``factor``."""
    return default_inv_freq(rotary_dim, base) / factor


def ntk_base(rotary_dim: int, base: float, alpha: float) -> float:
    """NTK-aware base change ``base * alpha^(d/(d-2))``: the highest frequency stays 1, the lowest
    is divided by alpha, exactly as linear interpolation divides it."""
    return base * alpha ** (rotary_dim / (rotary_dim - 2))


def ntk_inv_freq(rotary_dim: int, base: float, factor: float) -> np.ndarray:
    """Static NTK-aware scaling (bloc97): the base change with ``alpha = factor``."""
    return default_inv_freq(rotary_dim, ntk_base(rotary_dim, base, factor))


def dynamic_ntk_alpha(factor: float, seq_len: int, original: int) -> float:
    """HF "dynamic": ``factor*L/L_orig - (factor-1)`` with ``L = max(seq_len, L_orig)`` (1 up to L_orig)."""
    seq_len = max(seq_len, original)
    return factor * seq_len / original - (factor - 1.0)


def dynamic_ntk_inv_freq(rotary_dim: int, base: float, factor: float, seq_len: int, original: int) -> np.ndarray:
    """The frequencies dynamic NTK uses for a sequence of ``seq_len`` positions."""
    alpha = dynamic_ntk_alpha(factor, seq_len, original)
    return default_inv_freq(rotary_dim, ntk_base(rotary_dim, base, alpha))


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default multiplier on cos/sin, ``0.1*ln(factor)+1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude ``0.1*mscale*ln(factor)+1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(cfg) -> float:
    """Multiplier on MLA's softmax scale: ``yarn_mscale(factor, mscale_all_dim)^2`` when ``mscale_all_dim``
    is set, else 1 (HF 4.57.1 ``DeepseekV3Attention``). YaRN's temperature multiplies q and k by the
    magnitude; under MLA only the RoPE channels see cos and sin, so DeepSeek applies it to every channel
    through the scale (squared: it acts on both q and k) and leaves cos/sin the ratio
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` (``attention_factor``)."""
    cfg = rope_scaling_config(cfg)
    if not cfg.mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.factor, cfg.mscale_all_dim) ** 2


def yarn_correction_range(rotary_dim: int, base: float, original: int, beta_fast: float, beta_slow: float) -> tuple:
    """Frequency indices (low, high) between which YaRN ramps from extrapolation to interpolation.

    Index of the frequency that turns ``num_rotations`` times over ``original`` positions, floored
    and ceiled (HF 4.57.1 ``truncate=True``, the default) and clipped to [0, d-1].
    """

    def correction_dim(num_rotations):
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, rotary_dim - 1)


def yarn_extrapolation_weight(
    rotary_dim: int, base: float, original: int, beta_fast: float, beta_slow: float
) -> np.ndarray:
    """Per frequency: 1 keeps ``theta_i`` (fast, high frequencies), 0 takes ``theta_i / factor``."""
    low, high = yarn_correction_range(rotary_dim, base, original, beta_fast, beta_slow)
    if low == high:
        high += 0.001  # HF: avoid a zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return 1.0 - ramp


def yarn_inv_freq(
    rotary_dim: int, base: float, factor: float, original: int, beta_fast: float, beta_slow: float
) -> np.ndarray:
    """YaRN ("NTK-by-parts") frequencies, HF 4.57.1 ``_compute_yarn_parameters``."""
    extrapolated = default_inv_freq(rotary_dim, base)
    interpolated = extrapolated / factor
    weight = yarn_extrapolation_weight(rotary_dim, base, original, beta_fast, beta_slow)
    return interpolated * (1.0 - weight) + extrapolated * weight


def scaled_inv_freq(cfg, rotary_dim: int, base: float, max_position_embeddings: int, seq_len: int = 0) -> tuple:
    """``(inv_freq [d/2] float64, attention_factor)`` for any type, like HF's ``ROPE_INIT_FUNCTIONS``.

    ``seq_len`` is the current length for dynamic_ntk (0 = L_orig, i.e. plain RoPE); static types ignore it.
    """
    cfg = rope_scaling_config(cfg)
    original = original_max_position(cfg, max_position_embeddings)
    if cfg.type == "none":
        return default_inv_freq(rotary_dim, base), 1.0
    if cfg.type == "linear":
        return linear_inv_freq(rotary_dim, base, cfg.factor), 1.0
    if cfg.type == "ntk":
        return ntk_inv_freq(rotary_dim, base, cfg.factor), 1.0
    if cfg.type == "dynamic_ntk":
        return dynamic_ntk_inv_freq(rotary_dim, base, cfg.factor, seq_len, original), 1.0
    if cfg.type == "yarn":
        attention_factor = cfg.attention_factor or yarn_attention_factor(cfg.factor)
        return yarn_inv_freq(rotary_dim, base, cfg.factor, original, cfg.beta_fast, cfg.beta_slow), attention_factor
    raise ValueError(f"model.rope_scaling.type={cfg.type!r}: must be one of {ROPE_SCALING_TYPES}")
