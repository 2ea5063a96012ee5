"""Model section of the run config (``model.*`` keys).

The field names follow GLM-4.5 / HF ``glm4_moe`` where one exists, so an imported
config maps one to one. Every field is read by the model; :func:`validate_model_config`
rejects values the model cannot honour before anything is built.
"""

from dataclasses import dataclass, field
from typing import Optional

from mindmoe.conf.ranges import Range, above, at_least, bounded, field_ranges
from mindmoe.model.dsa_config import DSA_TRAINING_KEYS, DSAConfig, dsa_config, validate_dsa
from mindmoe.model.moe_config import MOE_KEYS
from mindmoe.model.records import from_record
from mindmoe.model.rope_scaling import RopeScalingConfig, rope_scaling_config, validate_rope_scaling

SCORE_FUNCS = ("softmax", "sigmoid")
ATTENTION_TYPES = ("gqa", "mla")
#: GQA keys an MLA model does not read (its widths are the ``qk_*`` / ``v_head_dim`` / ``*_lora_rank`` keys).
GQA_ONLY_KEYS = ("num_kv_heads", "head_dim", "qkv_bias", "qk_norm", "partial_rotary_factor")


@dataclass
class ModelConfig:
    """Architecture of the decoder-only MoE transformer."""

    #: A local HF checkpoint directory (config.json, *.safetensors, tokenizer files) to start from:
    #: its config.json gives the architecture, its weights the initial parameters and its tokenizer the
    #: data's. Other ``model.*`` keys set explicitly must agree with config.json, except the context keys
    #: (``max_position_embeddings``, ``rope_scaling``), ``initializer_range`` and how many of its MTP depths
    #: to train (``mtp_layers``); how it trains is ``moe.*`` and ``dsa.*``.
    pretrained: Optional[str] = None

    #: Vocabulary size; 0 = take it from the tokenizer.
    vocab_size: int = bounded(0, at_least(0, "0 = the tokenizer's"))
    #: Width of the residual stream.
    hidden_size: int = bounded(192, at_least(1))
    #: Number of decoder blocks (dense and MoE together).
    num_layers: int = bounded(4, at_least(1))
    #: Query heads.
    num_heads: int = bounded(6, at_least(1))
    #: gqa (grouped-query attention, GLM-4.5) or mla (multi-head latent attention, DeepSeek-V2/V3: queries
    #: and keys/values through low-rank latents, one RoPE key shared by all heads; model/mla.py). MLA reads
    #: the ``q_lora_rank`` .. ``v_head_dim`` keys below and none of ``num_kv_heads``, ``head_dim``,
    #: ``qkv_bias``, ``qk_norm``, ``partial_rotary_factor``.
    attention_type: str = "gqa"
    #: MLA: rank of the query compression (``q_a_proj`` -> RMSNorm -> ``q_b_proj``); null = one ``q_proj``
    #: (DeepSeek-V2-Lite).
    q_lora_rank: Optional[int] = None
    #: MLA: width of the compressed key/value latent (``kv_a_proj_with_mqa`` -> RMSNorm -> ``kv_b_proj``).
    kv_lora_rank: int = bounded(64, at_least(1))
    #: MLA: per-head query/key channels without RoPE (from ``kv_b_proj`` for the keys).
    qk_nope_head_dim: int = bounded(32, at_least(1))
    #: MLA: per-head query/key channels with RoPE; the key part is one head shared by all query heads.
    qk_rope_head_dim: int = bounded(16, at_least(1))
    #: MLA: per-head value width.
    v_head_dim: int = bounded(32, at_least(1))
    #: Key/value heads (GQA); must divide ``num_heads``.
    num_kv_heads: int = bounded(2, at_least(1))
    #: Per-head width; 0 = ``hidden_size // num_heads``.
    head_dim: int = 0
    #: Add a bias to the q/k/v projections (GLM-4.5 does).
    qkv_bias: bool = True
    #: RMSNorm over head_dim on q and k before RoPE (GLM-4.5 does).
    qk_norm: bool = True
    #: RoPE base.
    rope_theta: float = bounded(10000.0, at_least(0))
    #: Share of head_dim that is rotated (GLM uses 0.5: the first half rotates).
    partial_rotary_factor: float = bounded(0.5, Range(0, 1, low_open=True))
    #: Rotate pairs (2i, 2i+1) instead of (i, i + d/2) (GLM-4.5 uses rotate_half = false).
    rope_interleaved: bool = False
    #: Longest position the RoPE tables cover.
    max_position_embeddings: int = bounded(4096, at_least(1))
    #: RoPE scaling beyond the trained context: type none|linear|ntk|dynamic_ntk|yarn, factor,
    #: original_max_position, beta_fast, beta_slow, attention_factor (documented in model/rope_scaling.py).
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    #: Epsilon of every RMSNorm.
    rms_norm_eps: float = bounded(1e-5, at_least(0))
    #: Hidden width of the dense SwiGLU FFN of the first ``first_k_dense`` layers.
    intermediate_size: int = bounded(512, at_least(1))
    #: Leading layers with a dense FFN; the rest are MoE layers.
    first_k_dense: int = 1
    #: Routed experts per MoE layer.
    num_experts: int = bounded(8, at_least(1))
    #: Experts chosen per token.
    top_k: int = bounded(2, at_least(1))
    #: Hidden width of one routed (and one shared) expert.
    moe_intermediate_size: int = bounded(128, at_least(1))
    #: Shared experts applied to every token (fused into one SwiGLU of width n * moe_intermediate_size).
    num_shared_experts: int = bounded(1, at_least(0))
    #: Router score function: softmax or sigmoid (GLM-4.5: sigmoid).
    score_func: str = "softmax"
    #: Aux-loss-free balancing (DeepSeek-V3 / GLM-4.5 ``e_score_correction_bias``): a per-expert bias
    #: added to the scores for selection only; the combine weights use the unbiased scores. How fast it
    #: moves is training policy (``moe.bias_update_rate``).
    expert_bias: bool = False
    #: Expert groups for group-limited routing; 1 = no grouping.
    n_group: int = 1
    #: Groups a token may route into (group score = sum of its top-2 scores).
    topk_group: int = 1
    #: Renormalise the k chosen weights to sum to one.
    norm_topk_prob: bool = True
    #: Multiplier on the routed output (GLM-4.5: 2.5).
    routed_scaling_factor: float = bounded(1.0, above(0))
    #: Share the input embedding with the LM head.
    tie_word_embeddings: bool = False
    #: Standard deviation of the normal initialisation of every matrix.
    initializer_range: float = bounded(0.02, at_least(0))
    #: Multi-token-prediction depths D (DeepSeek-V3 §2.2; model/mtp.py): depth k predicts token t+k+1 from the
    #: previous depth's hidden state and the embedding of token t+k, through one extra MoE decoder layer that
    #: shares the embedding and the LM head. Training only (``train.mtp_loss_coeff``); evaluation, generation
    #: and MindIR export ignore it. HF checkpoints store depth k as ``model.layers.{num_layers + k}.*``.
    mtp_layers: int = 0
    #: DeepSeek Sparse Attention (GLM-5; model/dsa.py, keys in model/dsa_config.py): the lightning indexer of
    #: every MLA layer (``index_n_heads``, ``index_head_dim``, ``index_topk``; 0 heads = none). How it trains is
    #: the ``dsa.*`` section.
    dsa: DSAConfig = field(default_factory=DSAConfig)

    def __post_init__(self):
        # A config read back from JSON (checkpoint state, HF import) carries the sections as dicts.
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = rope_scaling_config(self.rope_scaling)
        if isinstance(self.dsa, dict):
            self.dsa = dsa_config(self.dsa)

    @classmethod
    def from_dict(cls, values: dict, source: str) -> "ModelConfig":
        """The config ``dataclasses.asdict`` wrote (a checkpoint's ``state.json``, an export manifest);
        ValueError naming ``source`` for a key this version does not have."""
        if isinstance(values, dict):
            # state.json of a run from before the moe.* section recorded the MoE policy here
            # (:func:`model.checkpoints.files.checkpoint_moe_config` reads it from there).
            values = {key: value for key, value in values.items() if key not in MOE_KEYS}
            if isinstance(values.get("dsa"), dict):  # and DSA's training keys (checkpoint_dsa_training reads them)
                values["dsa"] = {key: value for key, value in values["dsa"].items() if key not in DSA_TRAINING_KEYS}
        return from_record(cls, values, source, "model")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Channels RoPE rotates per head: MLA's ``qk_rope_head_dim``, else ``head_dim * partial_rotary_factor``."""
        if self.attention_type == "mla":
            return self.qk_rope_head_dim
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    @property
    def qk_head_dim(self) -> int:
        """MLA: query/key width per head, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense


#: MLA widths: their domains are checked only for ``attention_type=mla`` (GQA does not read them, nor MLA the
#: ``GQA_ONLY_KEYS``).
MLA_SIZE_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
CHOICES = {
    "score_func": SCORE_FUNCS,
    "attention_type": ATTENTION_TYPES,
}


def validate_model_config(cfg: ModelConfig) -> None:
    """Raise ValueError naming the ``model.*`` key whose value cannot work."""

    def fail(key: str, why: str):
        raise ValueError(f"model.{key}={getattr(cfg, key)!r}: {why}")

    for key, domain in field_ranges(ModelConfig).items():
        unread = GQA_ONLY_KEYS if cfg.attention_type == "mla" else MLA_SIZE_KEYS
        if key not in unread and not domain.contains(getattr(cfg, key)):
            fail(key, f"must be {domain.text()}")
    _check_attention(cfg, fail)
    _check_routing(cfg, fail)
    if isinstance(cfg.mtp_layers, bool) or not isinstance(cfg.mtp_layers, int) or cfg.mtp_layers < 0:
        fail("mtp_layers", "must be an integer >= 0 (0 = no multi-token prediction; DeepSeek-V3 and GLM-4.5 use 1)")
    validate_rope_scaling(cfg.rope_scaling, cfg.max_position_embeddings, cfg.rotary_dim)
    validate_dsa(cfg.dsa, cfg.attention_type, cfg.q_lora_rank, cfg.qk_rope_head_dim)
    if cfg.dsa.enabled and not cfg.rope_interleaved:
        fail("rope_interleaved", "the DSA indexer rotates interleaved channel pairs (GLM-5); set it to true")


def _check_attention(cfg: ModelConfig, fail) -> None:
    if cfg.attention_type not in ATTENTION_TYPES:
        fail("attention_type", f"must be one of {ATTENTION_TYPES}")
    if cfg.attention_type == "mla":
        _check_mla(cfg, fail)
    elif cfg.rope_scaling.mscale_all_dim:
        fail(
            "rope_scaling",
            "mscale_all_dim scales MLA's softmax (DeepSeek-V3); GQA does not read it, "
            "so leave it at 0 with model.attention_type='gqa'",
        )
    if not 0 <= cfg.first_k_dense <= cfg.num_layers:
        fail("first_k_dense", f"must be between 0 and model.num_layers={cfg.num_layers}")
    if cfg.attention_type == "mla":
        return
    if cfg.num_heads % cfg.num_kv_heads:
        fail("num_kv_heads", f"must divide model.num_heads={cfg.num_heads}")
    if not cfg.head_dim and cfg.hidden_size % cfg.num_heads:
        fail(
            "head_dim",
            f"is 0 but model.hidden_size={cfg.hidden_size} is not a multiple of "
            f"model.num_heads={cfg.num_heads}; set head_dim explicitly",
        )
    if cfg.rotary_dim % 2:
        fail("partial_rotary_factor", f"gives an odd rotary dim {cfg.rotary_dim}; it must be even")


def _check_mla(cfg: ModelConfig, fail) -> None:
    if cfg.q_lora_rank is not None and (
        isinstance(cfg.q_lora_rank, bool) or not isinstance(cfg.q_lora_rank, int) or cfg.q_lora_rank < 1
    ):
        fail("q_lora_rank", "must be a positive integer, or null for a plain q_proj")
    if cfg.qk_rope_head_dim % 2:
        fail("qk_rope_head_dim", "must be even (RoPE rotates channel pairs)")


def _check_routing(cfg: ModelConfig, fail) -> None:
    if cfg.top_k > cfg.num_experts:
        fail("top_k", f"cannot exceed model.num_experts={cfg.num_experts}")
    for key, choices in CHOICES.items():
        if getattr(cfg, key) not in choices:
            fail(key, f"must be one of {choices}")
    if cfg.n_group < 1 or cfg.num_experts % cfg.n_group:
        fail("n_group", f"must divide model.num_experts={cfg.num_experts}")
    if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
        fail("n_group", "leaves fewer than 2 experts per group (the group score sums the top 2)")
    if not 1 <= cfg.topk_group <= cfg.n_group:
        fail("topk_group", f"must be between 1 and model.n_group={cfg.n_group}")
    if cfg.n_group > 1 and cfg.top_k > cfg.topk_group * (cfg.num_experts // cfg.n_group):
        fail("top_k", f"exceeds the experts in model.topk_group={cfg.topk_group} groups")
