"""Model section of the run config (``model.*`` keys).

The field names follow GLM-4.5 / HF ``glm4_moe`` where one exists, so an imported
config maps one to one. Every field is read by the model; :func:`validate_model_config`
rejects values the model cannot honour before anything is built.
"""
from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("switch", "none")
DISPATCH_MODES = ("capacity", "dropless")


@dataclass
class ModelConfig:
    """Architecture of the decoder-only MoE transformer."""

    #: Vocabulary size; 0 = take it from the tokenizer.
    vocab_size: int = 0
    #: Width of the residual stream.
    hidden_size: int = 192
    #: Number of decoder blocks (dense and MoE together).
    num_layers: int = 4
    #: Query heads.
    num_heads: int = 6
    #: Key/value heads (GQA); must divide ``num_heads``.
    num_kv_heads: int = 2
    #: Per-head width; 0 = ``hidden_size // num_heads``.
    head_dim: int = 0
    #: Add a bias to the q/k/v projections (GLM-4.5 does).
    qkv_bias: bool = True
    #: RMSNorm over head_dim on q and k before RoPE (GLM-4.5 does).
    qk_norm: bool = True
    #: RoPE base.
    rope_theta: float = 10000.0
    #: Share of head_dim that is rotated (GLM uses 0.5: the first half rotates).
    partial_rotary_factor: float = 0.5
    #: Rotate pairs (2i, 2i+1) instead of (i, i + d/2) (GLM-4.5 uses rotate_half = false).
    rope_interleaved: bool = False
    #: Longest position the RoPE tables cover.
    max_position_embeddings: int = 4096
    #: Epsilon of every RMSNorm.
    rms_norm_eps: float = 1e-5
    #: Hidden width of the dense SwiGLU FFN of the first ``first_k_dense`` layers.
    intermediate_size: int = 512
    #: Leading layers with a dense FFN; the rest are MoE layers.
    first_k_dense: int = 1
    #: Routed experts per MoE layer.
    num_experts: int = 8
    #: Experts chosen per token.
    top_k: int = 2
    #: Hidden width of one routed (and one shared) expert.
    moe_intermediate_size: int = 128
    #: Shared experts applied to every token (fused into one SwiGLU of width n * moe_intermediate_size).
    num_shared_experts: int = 1
    #: Router score function: softmax or sigmoid (GLM-4.5: sigmoid).
    score_func: str = "softmax"
    #: Renormalise the k chosen weights to sum to one.
    norm_topk_prob: bool = True
    #: Multiplier on the routed output (GLM-4.5: 2.5).
    routed_scaling_factor: float = 1.0
    #: Load-balancing loss: switch (coeff * E * sum_e f_e P_e, f_e = c_e / (k T)) or none.
    aux_loss: str = "switch"
    #: Coefficient of the aux loss; perfectly balanced routing gives exactly this value per layer.
    aux_loss_coeff: float = 1e-2
    #: Coefficient of the router z-loss, coeff * mean(logsumexp(logits)^2); 0 disables it.
    z_loss_coeff: float = 1e-3
    #: capacity (static buffers, overflow dropped by position) or dropless (exact, no token dropped).
    dispatch: str = "capacity"
    #: Expert capacity = ceil(capacity_factor * tokens * top_k / num_experts) per micro-batch.
    capacity_factor: float = 1.25
    #: Share the input embedding with the LM head.
    tie_word_embeddings: bool = False
    #: Standard deviation of the normal initialisation of every matrix.
    initializer_range: float = 0.02

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense


def validate_model_config(cfg: ModelConfig) -> None:
    """Raise ValueError naming the ``model.*`` key whose value cannot work."""
    def fail(key: str, why: str):
        raise ValueError(f"model.{key}={getattr(cfg, key)!r}: {why}")

    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "intermediate_size", "moe_intermediate_size", "num_experts", "top_k",
                "max_position_embeddings"):
        if getattr(cfg, key) < (0 if key == "vocab_size" else 1):
            fail(key, "must be positive")
    if cfg.num_heads % cfg.num_kv_heads:
        fail("num_kv_heads", f"must divide model.num_heads={cfg.num_heads}")
    if not cfg.head_dim and cfg.hidden_size % cfg.num_heads:
        fail("head_dim", f"is 0 but model.hidden_size={cfg.hidden_size} is not a multiple of "
                         f"model.num_heads={cfg.num_heads}; set head_dim explicitly")
    if not 0.0 < cfg.partial_rotary_factor <= 1.0:
        fail("partial_rotary_factor", "must be in (0, 1]")
    if cfg.rotary_dim % 2:
        fail("partial_rotary_factor", f"gives an odd rotary dim {cfg.rotary_dim}; it must be even")
    if not 0 <= cfg.first_k_dense <= cfg.num_layers:
        fail("first_k_dense", f"must be between 0 and model.num_layers={cfg.num_layers}")
    if cfg.top_k > cfg.num_experts:
        fail("top_k", f"cannot exceed model.num_experts={cfg.num_experts}")
    if cfg.num_shared_experts < 0:
        fail("num_shared_experts", "must be >= 0")
    if cfg.score_func not in SCORE_FUNCS:
        fail("score_func", f"must be one of {SCORE_FUNCS}")
    if cfg.aux_loss not in AUX_LOSS_TYPES:
        fail("aux_loss", f"must be one of {AUX_LOSS_TYPES}")
    if cfg.dispatch not in DISPATCH_MODES:
        fail("dispatch", f"must be one of {DISPATCH_MODES}")
    if cfg.capacity_factor <= 0:
        fail("capacity_factor", "must be > 0")
    for key in ("aux_loss_coeff", "z_loss_coeff", "rms_norm_eps", "initializer_range", "rope_theta"):
        if getattr(cfg, key) < 0:
            fail(key, "must be >= 0")
