"""Parameter names, shapes and counts of a :class:`~model.config.ModelConfig`, without building the model.

:func:`parameter_shapes` lists exactly the parameters ``MoETransformer`` creates, in the same order
and under the same names; ``tests/unit/test_plan.py`` asserts this against an instantiated model, so
the planner's counts, the HF import's checks (:mod:`model.hf.load`) and the HF export cannot drift
from the network. Pure Python: nothing is allocated.

Conventions (docs/planning.md, "Counting convention", states them for users):

- **total** = every trained parameter, input embedding and LM head included (counted once when
  tied). This equals HF ``Glm4MoeForCausalLM(config).num_parameters()``.
- The router's ``e_score_correction_bias`` is **state, not a parameter**: HF registers it as a
  buffer; mindmoe stores it as a ``Parameter(requires_grad=False)`` so checkpoints carry it. It is
  left out of every count (``include_buffers=True`` lists it, to compare with the model's cells).
- The **MTP layers** (``model.mtp_layers``, HF ``num_nextn_predict_layers``; model/mtp.py) are listed by
  :func:`parameter_shapes` (``mtp_layers.{k}.*``) but left out of ``total``, ``active`` and the categories, as HF
  leaves them out of ``num_parameters()``; ``ParameterCount.mtp`` counts them and :func:`mtp_layer_parameters`
  gives one depth's size (also for a config without them, e.g. GLM-4.5's layer 92).
- **active** = parameters one token passes through: everything except the input embedding and the
  LM head, with only ``top_k`` of the ``num_experts`` routed experts of each MoE layer.
  ``active_with_lm_head`` adds the output matrix (the convention some model cards use).
"""

from dataclasses import dataclass
from math import prod
from typing import Dict, Tuple

from mindmoe.model.config import ModelConfig

Shape = Tuple[int, ...]

#: Breakdown categories, in print order.
CATEGORIES = ("embeddings", "attention", "dense_ffn", "experts", "shared_experts", "router", "norms")
#: Non-trained state that the model stores as a ``Parameter(requires_grad=False)``.
BUFFER_SUFFIXES = (".e_score_correction_bias",)


def _swiglu(prefix: str, hidden: int, width: int) -> Dict[str, Shape]:
    return {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }


def _mla_attention(prefix: str, cfg: ModelConfig) -> Dict[str, Shape]:
    """The projections of :class:`model.mla.MLAttention`, in its creation order."""
    hidden, heads = cfg.hidden_size, cfg.num_heads
    if cfg.q_lora_rank is None:
        shapes = {f"{prefix}.q_proj.weight": (heads * cfg.qk_head_dim, hidden)}
    else:
        shapes = {
            f"{prefix}.q_a_proj.weight": (cfg.q_lora_rank, hidden),
            f"{prefix}.q_a_layernorm.weight": (cfg.q_lora_rank,),
            f"{prefix}.q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
        }
    shapes[f"{prefix}.kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden)
    shapes[f"{prefix}.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes[f"{prefix}.kv_b_proj.weight"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    shapes[f"{prefix}.o_proj.weight"] = (hidden, heads * cfg.v_head_dim)
    if cfg.dsa.enabled:
        shapes.update(_dsa_indexer(f"{prefix}.indexer", cfg))
    return shapes


def _dsa_indexer(prefix: str, cfg: ModelConfig) -> Dict[str, Shape]:
    """The lightning indexer of :class:`model.dsa.LightningIndexer` (HF ``GlmMoeDsaIndexer`` names)."""
    dsa = cfg.dsa
    return {
        f"{prefix}.wq_b.weight": (dsa.index_n_heads * dsa.index_head_dim, cfg.q_lora_rank),
        f"{prefix}.wk.weight": (dsa.index_head_dim, cfg.hidden_size),
        f"{prefix}.k_norm.weight": (dsa.index_head_dim,),
        f"{prefix}.k_norm.bias": (dsa.index_head_dim,),
        f"{prefix}.weights_proj.weight": (dsa.index_n_heads, cfg.hidden_size),
    }


def _attention(prefix: str, cfg: ModelConfig) -> Dict[str, Shape]:
    if cfg.attention_type == "mla":
        return _mla_attention(prefix, cfg)
    head_dim = cfg.resolved_head_dim
    shapes = {}
    for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads), ("v_proj", cfg.num_kv_heads)):
        shapes[f"{prefix}.{proj}.weight"] = (heads * head_dim, cfg.hidden_size)
        if cfg.qkv_bias:
            shapes[f"{prefix}.{proj}.bias"] = (heads * head_dim,)
    shapes[f"{prefix}.o_proj.weight"] = (cfg.hidden_size, cfg.num_heads * head_dim)
    if cfg.qk_norm:
        shapes[f"{prefix}.q_norm.weight"] = (head_dim,)
        shapes[f"{prefix}.k_norm.weight"] = (head_dim,)
    return shapes


def _moe(prefix: str, cfg: ModelConfig) -> Dict[str, Shape]:
    hidden, width, experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    shapes = {f"{prefix}.router.weight": (experts, hidden)}
    if cfg.expert_bias:
        shapes[f"{prefix}.router.e_score_correction_bias"] = (experts,)
    shapes[f"{prefix}.experts.gate_proj"] = (experts, width, hidden)
    shapes[f"{prefix}.experts.up_proj"] = (experts, width, hidden)
    shapes[f"{prefix}.experts.down_proj"] = (experts, hidden, width)
    if cfg.num_shared_experts > 0:
        shapes.update(_swiglu(f"{prefix}.shared_experts", hidden, width * cfg.num_shared_experts))
    return shapes


def parameter_shapes(cfg: ModelConfig, include_buffers: bool = False) -> Dict[str, Shape]:
    """``{name: shape}`` of the parameters ``MoETransformer(cfg)`` creates, in creation order.

    Without ``include_buffers`` the router correction bias (state, not trained) is left out.
    """
    if cfg.vocab_size <= 0:
        raise ValueError("model.vocab_size must be set to count parameters (0 means 'from the tokenizer')")
    hidden = cfg.hidden_size
    shapes = {"embed_tokens.weight": (cfg.vocab_size, hidden)}
    for layer_idx in range(cfg.num_layers):
        prefix = f"layers.{layer_idx}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes.update(_attention(f"{prefix}.self_attn", cfg))
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        if layer_idx < cfg.first_k_dense:
            shapes.update(_swiglu(f"{prefix}.mlp", hidden, cfg.intermediate_size))
        else:
            shapes.update(_moe(f"{prefix}.mlp", cfg))
    shapes["norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    for depth in range(cfg.mtp_layers):
        shapes.update(_mtp_layer(f"mtp_layers.{depth}", cfg))
    if not include_buffers:
        shapes = {name: shape for name, shape in shapes.items() if not name.endswith(BUFFER_SUFFIXES)}
    return shapes


def _mtp_layer(prefix: str, cfg: ModelConfig) -> Dict[str, Shape]:
    """One MTP depth (model/mtp.py) in creation order: its MoE decoder block, then the MTP parts."""
    hidden = cfg.hidden_size
    shapes = {f"{prefix}.input_layernorm.weight": (hidden,)}
    shapes.update(_attention(f"{prefix}.self_attn", cfg))
    shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    shapes.update(_moe(f"{prefix}.mlp", cfg))
    shapes[f"{prefix}.enorm.weight"] = (hidden,)
    shapes[f"{prefix}.hnorm.weight"] = (hidden,)
    shapes[f"{prefix}.eh_proj.weight"] = (hidden, 2 * hidden)
    shapes[f"{prefix}.shared_head.norm.weight"] = (hidden,)
    return shapes


def is_mtp(name: str) -> bool:
    """A parameter of an MTP depth (``mtp_layers.{k}.*``)."""
    return name.startswith("mtp_layers.")


def parameter_category(name: str) -> str:
    """Which line of the breakdown a parameter belongs to (one of :data:`CATEGORIES`); an MTP depth's parameter gets
    its block part's category (``eh_proj`` counts as attention-side projection: ``attention``)."""
    if is_mtp(name) and name.endswith(".eh_proj.weight"):
        return "attention"
    if name.startswith(("embed_tokens.", "lm_head.")):
        return "embeddings"
    if name.endswith("norm.weight"):
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.router." in name:
        return "router"
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp." in name:
        return "dense_ffn"
    raise ValueError(f"parameter {name!r} has no breakdown category")


def layer_index(name: str) -> int:
    """Decoder layer of a parameter; -1 for the embedding, final norm and LM head."""
    return int(name.split(".")[1]) if name.startswith("layers.") else -1


@dataclass(frozen=True)
class ParameterCount:
    """Exact counts of one config (see the module docstring for the conventions)."""

    #: Parameters per :data:`CATEGORIES` entry; they sum to ``total``.
    categories: Dict[str, int]
    #: All trained parameters incl. input embedding and LM head; MTP layer and correction bias excluded.
    total: int
    #: Per token, excluding the input embedding and the LM head; top_k of num_experts routed experts.
    active: int
    #: ``active`` plus the LM head (the embedding matrix when tied).
    active_with_lm_head: int
    #: Input embedding matrix.
    input_embedding: int
    #: Output matrix (also counted in ``input_embedding`` and once in ``total`` when tied).
    lm_head: int
    #: Elements of non-trained state stored beside the parameters (router correction biases).
    buffers: int
    #: Trained parameters of the ``model.mtp_layers`` MTP depths, not in ``total`` (nor in any other field).
    mtp: int = 0


def count_parameters(cfg: ModelConfig) -> ParameterCount:
    """Count the parameters of ``cfg`` from :func:`parameter_shapes` (exact integers)."""
    all_shapes = parameter_shapes(cfg)
    shapes = {name: shape for name, shape in all_shapes.items() if not is_mtp(name)}
    categories = dict.fromkeys(CATEGORIES, 0)
    for name, shape in shapes.items():
        categories[parameter_category(name)] += prod(shape)
    total = sum(categories.values())
    input_embedding = prod(shapes["embed_tokens.weight"])
    lm_head = prod(shapes.get("lm_head.weight", shapes["embed_tokens.weight"]))
    # Expert tensors lead with E, so top_k / num_experts of them is an exact integer.
    active_experts = categories["experts"] // cfg.num_experts * cfg.top_k
    active = total - categories["embeddings"] - categories["experts"] + active_experts
    buffers = sum(
        prod(shape)
        for name, shape in parameter_shapes(cfg, include_buffers=True).items()
        if name.endswith(BUFFER_SUFFIXES) and not is_mtp(name)
    )
    return ParameterCount(
        categories=categories,
        total=total,
        active=active,
        active_with_lm_head=active + lm_head,
        input_embedding=input_embedding,
        lm_head=lm_head,
        buffers=buffers,
        mtp=sum(prod(shape) for name, shape in all_shapes.items() if is_mtp(name)),
    )


def mtp_layer_parameters(cfg: ModelConfig) -> int:
    """Trained parameters of one MTP depth of ``cfg`` (model/mtp.py), whether or not ``cfg`` has any.

    ``enorm``, ``hnorm`` and ``shared_head.norm`` [H], ``eh_proj`` [H, 2H] and one MoE decoder layer; the embedding
    and LM head are the main model's (DeepSeek-V3 report §2.2), so they are not counted again.
    """
    shapes = _mtp_layer("mtp_layers.0", cfg)
    return sum(prod(shape) for name, shape in shapes.items() if not name.endswith(BUFFER_SUFFIXES))
