"""The ``config.json`` fields of each architecture's attention and MoE, in mindmoe terms (:mod:`model.hf.config_map`
reads the fields every architecture shares and picks one of these).

Each function takes the config reader (typed access with the transformers 4.57.1 defaults; ``reader.reject``
records a setting mindmoe cannot reproduce, naming its key) and returns ``ModelConfig`` fields.
"""


def glm4_moe_fields(reader) -> dict:
    fields = _grouped_sigmoid_moe_fields(reader, "glm4_moe")
    fields.update(qkv_bias=reader.bool("attention_bias"), qk_norm=reader.bool("use_qk_norm"))
    return fields


def deepseek_v3_fields(reader, model_type: str = "deepseek_v3", first_k_dense=None) -> dict:
    """MLA attention (:mod:`model.mla`) and glm4_moe's MoE. The GQA keys MLA does not read are set to what
    describes it: one key/value head per query head, no bias, no QK-norm, the whole RoPE slice rotating."""
    heads = reader.int("num_attention_heads")
    if reader.raw("num_key_value_heads") != heads:
        reader.reject(
            "num_key_value_heads",
            f"must equal num_attention_heads={heads}: MLA gives every head its own key and value",
        )
    if reader.bool("attention_bias"):
        reader.reject(
            "attention_bias", "MLA projections with biases are not supported (no released checkpoint has them)"
        )
    rope_dim = reader.int("qk_rope_head_dim")
    # GlmMoeDsaConfig sets head_dim to qk_rope_head_dim itself and always interleaves (model.hf.dsa_fields notes).
    dsa = model_type == "glm_moe_dsa"
    if not dsa and reader.raw("head_dim") not in (None, rope_dim):
        # HF sizes its RoPE tables from head_dim, which DeepseekV3Config sets to qk_rope_head_dim;
        # Glm4MoeLiteConfig maps a head_dim key onto qk_rope_head_dim itself (attribute_map).
        why = "HF rotates head_dim channels" if model_type == "deepseek_v3" else "HF reads it as qk_rope_head_dim"
        reader.reject("head_dim", f"must equal qk_rope_head_dim={rope_dim} ({why})")
    if reader.raw("partial_rotary_factor") not in (None, 1.0):
        reader.reject("partial_rotary_factor", "MLA rotates the whole qk_rope_head_dim slice; only 1.0 is supported")
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if reader.raw(key) not in (None, value):
            reader.reject(key, f"transformers' {model_type} (and mindmoe) route with {value!r} only")
    fields = _grouped_sigmoid_moe_fields(reader, model_type, first_k_dense)
    fields.update(
        attention_type="mla",
        num_kv_heads=heads,
        head_dim=0,
        qkv_bias=False,
        qk_norm=False,
        partial_rotary_factor=1.0,
        rope_interleaved=True if dsa else reader.bool("rope_interleave"),
        q_lora_rank=reader.int("q_lora_rank", optional=True),
        kv_lora_rank=reader.int("kv_lora_rank"),
        qk_nope_head_dim=reader.int("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=reader.int("v_head_dim"),
    )
    return fields


def glm4_moe_lite_fields(reader, notes: list) -> dict:
    """GLM-4.7-Flash (transformers 5.23 ``Glm4MoeLite``): deepseek_v3's MLA (interleaved RoPE by default) and
    glm4_moe's MoE, with dense layers given per layer by ``mlp_layer_types`` (``first_k_dense_replace`` is
    not read by transformers)."""
    fields = deepseek_v3_fields(reader, "glm4_moe_lite", _leading_dense_layers(reader))
    stated = reader.raw("first_k_dense_replace")
    if stated is not None and stated != fields["first_k_dense"]:
        notes.append(
            f"first_k_dense_replace={stated!r} is not used: transformers' glm4_moe_lite takes its dense layers "
            f"from mlp_layer_types, which gives {fields['first_k_dense']}"
        )
    return fields


def _leading_dense_layers(reader, when_unset: int = 1) -> int:
    """How many leading layers ``mlp_layer_types`` makes dense (null: the first ``when_unset``, as transformers)."""
    num_layers = reader.int("num_hidden_layers") or 0
    types = reader.raw("mlp_layer_types")
    if types is None:
        return min(when_unset, num_layers)
    if not isinstance(types, list) or not all(t in ("dense", "sparse") for t in types):
        reader.reject("mlp_layer_types", "must be a list of 'dense' / 'sparse', one per layer")
        return 0
    if len(types) != num_layers:
        reader.reject("mlp_layer_types", f"has {len(types)} entries for num_hidden_layers={num_layers}")
        return 0
    dense = types.index("sparse") if "sparse" in types else num_layers
    if "dense" in types[dense:]:
        reader.reject(
            "mlp_layer_types", "has a dense layer after a MoE layer; mindmoe supports dense layers only at the start"
        )
    return dense


def _grouped_sigmoid_moe_fields(reader, model_type: str, first_k_dense=None) -> dict:
    """The MoE of glm4_moe and deepseek_v3: sigmoid scores, correction bias for selection, group-limited
    top-k (group score = sum of its two best biased scores), renormalised and scaled weights, shared experts.
    ``first_k_dense``: given by the caller, else from ``first_k_dense_replace``."""
    num_layers = reader.int("num_hidden_layers") or 0
    if first_k_dense is None:
        # HF: layer i is MoE iff i >= first_k_dense_replace, so a larger value means all dense.
        first_k_dense = min(reader.int("first_k_dense_replace") or 0, num_layers)
    shared = reader.int("n_shared_experts")
    if shared is not None and shared < 1:
        reader.reject("n_shared_experts", f"{model_type} always builds a shared expert; 0 is not supported")
    return dict(
        intermediate_size=reader.int("intermediate_size"),
        first_k_dense=first_k_dense,
        num_experts=reader.int("n_routed_experts"),
        moe_intermediate_size=reader.int("moe_intermediate_size"),
        num_shared_experts=shared,
        score_func="sigmoid",
        expert_bias=True,
        n_group=reader.int("n_group"),
        topk_group=reader.int("topk_group"),
        norm_topk_prob=reader.bool("norm_topk_prob"),
        routed_scaling_factor=reader.float("routed_scaling_factor"),
    )


def _softmax_router_fields(reader) -> dict:
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


def qwen3_moe_fields(reader, num_layers) -> dict:
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


def mixtral_fields(reader, notes: list) -> dict:
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
