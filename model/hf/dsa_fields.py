"""HF ``glm_moe_dsa`` (GLM-5; transformers >= 5.2, reference 5.23 ``GlmMoeDsaConfig``) ``config.json`` -> mindmoe:
deepseek_v3's MLA and MoE (:func:`model.hf.arch_fields.deepseek_v3_fields`) plus DeepSeek Sparse Attention's
lightning indexer in every layer (``model.dsa``, :mod:`model.dsa_config`); how it trains is the run's ``dsa.*``.

What transformers 5.23 runs for such a config, and so what the import reproduces:

- MLA with query compression (``q_lora_rank`` may not be null: the indexer reads the compressed query) and RoPE on
  interleaved pairs in the main attention and in the indexer alike. The config class has no ``rope_interleave``
  (nor ``indexer_rope_interleave``): such keys are never read, and a value other than true is noted;
- ``indexer_types`` per layer: ``"full"`` runs the layer's own indexer, ``"shared"`` (GLM-5.2's IndexShare) reuses
  the previous full layer's top-k keys, which mindmoe does not do, so any shared layer is refused. Without the key
  transformers derives it from ``index_topk_pattern`` or ``index_topk_freq`` / ``index_skip_topk_offset``, and so
  does the import;
- dense layers from ``mlp_layer_types``, else the first ``first_k_dense_replace`` (3 by default);
- ``head_dim`` and ``qk_head_dim`` are recomputed (``qk_rope_head_dim``; ``qk_nope_head_dim + qk_rope_head_dim``):
  a different value in ``config.json`` is noted, not used. ``mlp_bias`` builds no bias in transformers (noted);
- the routed expert count is ``num_local_experts`` if given, else ``num_experts``, else ``n_routed_experts``.

Keys for outputs and generation (``use_cache``, ``output_router_logits``, token ids) do not change the logits.
"""

from collections.abc import Mapping
from dataclasses import fields as dataclass_fields
from dataclasses import replace

from mindmoe.model.dsa_config import DSA_TRAINING_KEYS, DSAConfig
from mindmoe.model.hf.arch_fields import _leading_dense_layers, deepseek_v3_fields

#: Keys of some glm_moe_dsa ``config.json`` files that transformers' GlmMoeDsa never reads, with the value that
#: describes what it runs anyway.
UNREAD_KEYS = {"rope_interleave": True, "indexer_rope_interleave": True, "moe_layer_freq": 1}


def glm_moe_dsa_fields(reader, notes: list) -> dict:
    """``ModelConfig`` fields (``dsa`` included) of a glm_moe_dsa ``config.json``; problems go to ``reader``."""
    if reader.raw("q_lora_rank") is None:
        reader.reject(
            "q_lora_rank",
            "must be set: glm_moe_dsa compresses its queries (q_a_proj) and its indexer reads the compressed query",
        )
    num_layers = reader.int("num_hidden_layers") or 0
    first_k = reader.int("first_k_dense_replace") or 0
    fields = deepseek_v3_fields(reader, "glm_moe_dsa", _leading_dense_layers(reader, first_k))
    if reader.raw("mlp_layer_types") is not None and "first_k_dense_replace" in reader.hf:
        if first_k != fields["first_k_dense"]:
            notes.append(
                f"first_k_dense_replace={first_k!r} is not used: transformers' glm_moe_dsa takes its dense layers "
                f"from mlp_layer_types, which gives {fields['first_k_dense']}"
            )
    for alias in ("num_local_experts", "num_experts"):  # transformers' order of precedence
        if reader.hf.get(alias) is not None:
            fields["num_experts"] = reader.int(alias)
            break
    _note_recomputed_and_unread(reader, fields, notes)
    layer_types = reader.raw("layer_types")
    if layer_types is not None and layer_types != ["indexed_attention"] * num_layers:
        reader.reject(
            "layer_types",
            f"must be null or {num_layers} 'indexed_attention' entries: transformers' glm_moe_dsa masks and caches "
            "every layer as one",
        )
    _check_indexer_types(reader, num_layers)
    fields["dsa"] = _indexer(reader, fields["qk_rope_head_dim"])
    return fields


def _note_recomputed_and_unread(reader, fields: dict, notes: list) -> None:
    rope, nope = fields["qk_rope_head_dim"], fields["qk_nope_head_dim"]
    recomputed = {"head_dim": rope, "qk_head_dim": None if rope is None or nope is None else rope + nope}
    for key, used in recomputed.items():
        stated = reader.hf.get(key)
        if stated is not None and used is not None and stated != used:
            notes.append(f"{key}={stated!r} is not used: transformers' glm_moe_dsa sets it to {used} (MLA widths)")
    for key, value in UNREAD_KEYS.items():
        if key in reader.hf and reader.hf[key] != value:
            notes.append(
                f"{key}={reader.hf[key]!r} is not used: transformers' glm_moe_dsa does not read it and runs as "
                f"{key}={value!r} would (RoPE on interleaved pairs in the attention and the indexer, every layer "
                "from first_k_dense_replace on MoE)"
            )
    if reader.hf.get("mlp_bias"):
        notes.append("mlp_bias=True is not used: transformers' glm_moe_dsa builds its MLPs without biases")


def _check_indexer_types(reader, num_layers: int) -> None:
    """Every layer runs its own indexer (``"full"``); the list transformers derives when the key is absent."""
    types, source = reader.raw("indexer_types"), "indexer_types"
    if types is None:
        pattern = reader.hf.get("index_topk_pattern")
        if pattern is not None:
            source = f"indexer_types (from index_topk_pattern={pattern!r})"
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
        else:
            freq, offset = reader.hf.get("index_topk_freq", 1), reader.hf.get("index_skip_topk_offset", 2)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (freq, offset)):
                reader.reject("index_topk_freq", "index_topk_freq and index_skip_topk_offset must be integers")
                return
            source = f"indexer_types (from index_topk_freq={freq}, index_skip_topk_offset={offset})"
            types = ["full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(num_layers)]
    if not isinstance(types, list) or not all(t in ("full", "shared") for t in types):
        reader.problems.append(f"{source}={types!r}: must be a list of 'full' / 'shared', one per layer")
    elif len(types) != num_layers:
        reader.problems.append(f"{source}: has {len(types)} entries for num_hidden_layers={num_layers}")
    elif "shared" in types:
        shared = [i for i, t in enumerate(types) if t == "shared"]
        reader.problems.append(
            f"{source}: layers {shared} are 'shared' (IndexShare, GLM-5.2: the layer reuses the previous full "
            "layer's top-k keys); mindmoe supports only 'full' entries, every layer running its own indexer"
        )


def _indexer(reader, rope_dim) -> DSAConfig:
    heads, width, topk = reader.int("index_n_heads"), reader.int("index_head_dim"), reader.int("index_topk")
    if heads is not None and heads < 1:
        reader.reject("index_n_heads", "must be >= 1: every glm_moe_dsa layer runs its indexer")
    if width is not None and rope_dim is not None and (width < rope_dim or width % 2):
        reader.reject("index_head_dim", f"must be even and at least qk_rope_head_dim={rope_dim} (rotated channels)")
    if topk is not None and topk < 1:
        reader.reject("index_topk", "must be >= 1 (keys each query keeps)")
    return DSAConfig(index_n_heads=heads or 0, index_head_dim=width or 0, index_topk=topk or 0)


def dsa_override(imported: DSAConfig, value, source: str, model_type: str) -> tuple:
    """``(DSAConfig, problems)``: a ``model.dsa`` override on top of an import: the indexer's keys must agree with
    ``config.json`` (how it trains is ``dsa.*``). A mapping sets the keys it holds; a whole :class:`DSAConfig` (a
    run's ``model.dsa``) sets those that differ from its defaults."""
    known = [f.name for f in dataclass_fields(DSAConfig)]
    if isinstance(value, DSAConfig):
        given = {key: getattr(value, key) for key in known if getattr(value, key) != getattr(DSAConfig(), key)}
    elif isinstance(value, Mapping):
        given = dict(value)
    else:
        return imported, [f"model.dsa={value!r}: must be a mapping of {known}"]
    changes, problems = {}, []
    for key, setting in given.items():
        if key in DSA_TRAINING_KEYS:
            problems.append(f"model.dsa.{key} is now dsa.{key}: how the indexer trains is the dsa.* section")
        elif key not in known:
            problems.append(f"model.dsa.{key}: unknown key; known keys are {sorted(known)}")
        elif setting != getattr(imported, key):
            problems.append(
                f"model.dsa.{key}={setting!r} conflicts with {source} ({model_type}), which gives "
                f"{getattr(imported, key)!r}; a pretrained model's indexer comes from its config, so drop the override"
            )
    return replace(imported, **changes), problems
