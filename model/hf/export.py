"""Write a mindmoe model or checkpoint as a HF checkpoint directory (``mindmoe-export export.format=hf``).

The directory holds ``config.json`` (``glm4_moe`` when the model is one, else ``qwen3_moe`` or
``mixtral`` if it fits, ``deepseek_v3`` for MLA, ``glm_moe_dsa`` for MLA with DSA's indexer (the only
architecture that keeps it), ``glm4_moe_lite`` when asked; see
:func:`hf_config_from_model`), fp32 safetensors with HF names (sharded with an index above ``max_shard_bytes``), so that
``AutoModelForCausalLM.from_pretrained(out_dir)`` gives the same logits. The tokenizer files are the
caller's to copy (``train/export/exporter.py`` does, and passes its special token ids for ``config.json``).
A ``glm4_moe`` / ``deepseek_v3`` router always has ``e_score_correction_bias``; a model trained without a
correction bias gets zeros, which select exactly as no bias does.
"""

import json
from pathlib import Path
from typing import Optional

import numpy as np

from mindmoe.model.checkpoints.files import (
    MODEL_FILE,
    checkpoint_dsa_training,
    checkpoint_model_config,
    checkpoint_moe_config,
)
from mindmoe.model.checkpoints.shards import read_tensors
from mindmoe.model.config import ModelConfig
from mindmoe.model.hf.config_map import ARCHITECTURES, MLA_MODEL_TYPES, SUPPORTED_MODEL_TYPES, HFCheckpointError
from mindmoe.model.hf.safetensors_io import ShardedWriter
from mindmoe.model.hf.weights import MTP_SHARED_COPIES, NameMap, is_stacked_expert
from mindmoe.model.moe_config import MoEConfig, moe_policy
from mindmoe.model.param_count import parameter_shapes

DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
#: Architectures whose router always has the correction bias buffer.
SIGMOID_ROUTER_TYPES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "glm_moe_dsa")


def export_hf(
    source,
    model_config: ModelConfig = None,
    out_dir=None,
    special_token_ids: Optional[dict] = None,
    model_type: str = "",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    moe: MoEConfig = None,
) -> list:
    """Write ``source`` (a ``MoETransformer`` or a mindmoe checkpoint directory) to ``out_dir``.

    ``model_config`` defaults to the model's own, or the ``model_config`` in the checkpoint's
    ``state.json``. ``special_token_ids``: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of
    the tokenizer that ships with the model, written into ``config.json``. Returns notes (what HF will
    do differently, e.g. expert locking). Tensors are written one shard at a time, so memory holds the
    source plus one shard. ``moe``: the policy the model was trained with, for the notes (default: the model's
    own, or the checkpoint's ``state.json``).
    """
    if out_dir is None:
        raise ValueError("export_hf: out_dir is required")
    cfg, tensors = _source(source, model_config)
    if hasattr(source, "moe_config"):  # a model
        recorded_moe, stage = source.moe_config, source.dsa_training.stage
    else:
        recorded_moe, stage = _checkpoint_policy(source)
    moe = recorded_moe if moe is None else moe
    model_type, hf_config, notes = hf_config_from_model(cfg, model_type, moe, stage)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(
        p.name
        for p in out.iterdir()
        if p.name == "config.json" or p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json")
    )
    if stale:
        # Shards of an earlier export would sit beside the new ones and confuse from_pretrained.
        raise HFCheckpointError(
            f"{out} already holds a checkpoint ({', '.join(stale[:3])}); export into an empty directory"
        )
    writer = ShardedWriter(out, max_shard_bytes)
    try:
        for hf_name, array in hf_named_tensors(cfg, model_type, tensors):
            writer.add(hf_name, array)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    hf_config.update(special_token_ids or {})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    return notes


def hf_named_tensors(cfg: ModelConfig, model_type: str, named_arrays):
    """``(HF name, fp32 array)`` for every tensor of the HF checkpoint, from ``(our name, array)``
    pairs covering the model; stacked experts are split into rows (views, no copies)."""
    names = NameMap(model_type, cfg.num_layers if cfg.mtp_layers else None)
    shapes = parameter_shapes(cfg, include_buffers=True)
    seen = set()
    shared = {}  # embedding and head, written again as every MTP depth's copy (as DeepSeek-V3 / GLM-4.5 store them)
    for our_name, array in named_arrays:
        if our_name not in shapes:
            raise HFCheckpointError(
                f"{our_name}: not a parameter of a mindmoe model with this config "
                "(merge LoRA adapters into the base weights before exporting)"
            )
        if tuple(array.shape) != tuple(shapes[our_name]):
            raise HFCheckpointError(
                f"{our_name}: shape {list(array.shape)} vs {list(shapes[our_name])} from the model config"
            )
        seen.add(our_name)
        array = array.astype(np.float32, copy=False)
        if cfg.mtp_layers and our_name in ("embed_tokens.weight", "lm_head.weight"):
            shared[our_name] = array
        for hf_name, row in names.to_hf(our_name, array.shape[0] if is_stacked_expert(our_name) else 0):
            yield hf_name, array if row is None else array[row]
        if model_type in SIGMOID_ROUTER_TYPES and our_name.endswith("mlp.router.weight") and not cfg.expert_bias:
            # HF's glm4_moe router always has the buffer; zeros select exactly as no bias does.
            bias_name = our_name[: -len("weight")] + "e_score_correction_bias"
            yield names.to_hf(bias_name)[0][0], np.zeros(cfg.num_experts, np.float32)
    missing = sorted(set(shapes) - seen)
    if missing:
        raise HFCheckpointError(f"the source lacks parameters the config needs: {', '.join(missing[:10])}")
    head = shared.get("lm_head.weight", shared.get("embed_tokens.weight"))
    for depth in range(cfg.mtp_layers):
        for suffix, which in MTP_SHARED_COPIES.items():
            copy = shared["embed_tokens.weight"] if which == "embed_tokens.weight" else head
            yield f"model.layers.{cfg.num_layers + depth}.{suffix}", copy


def hf_config_from_model(
    cfg: ModelConfig, model_type: str = "", moe: MoEConfig = None, dsa_stage: str = "sparse"
) -> tuple:
    """``(model_type, config.json dict, notes)`` for the first architecture that reproduces ``cfg``
    (``model_type`` forces one); the notes say where HF differs from a model trained with policy ``moe`` whose
    DSA layers run ``dsa_stage``.
    Raises :class:`HFCheckpointError` with every architecture's reasons."""
    candidates = [model_type] if model_type else list(SUPPORTED_MODEL_TYPES)
    reasons = {}
    for candidate in candidates:
        if candidate not in SUPPORTED_MODEL_TYPES:
            raise HFCheckpointError(f"export model_type={candidate!r}: must be one of {SUPPORTED_MODEL_TYPES}")
        problems = _export_problems(cfg, candidate)
        if not problems:
            return candidate, _export_dict(cfg, candidate), _export_notes(cfg, candidate, moe_policy(moe), dsa_stage)
        reasons[candidate] = problems
    lines = [f"  {name}: " + "; ".join(problems) for name, problems in reasons.items()]
    raise HFCheckpointError(
        "the model cannot be written as a HF checkpoint that gives the same logits:\n" + "\n".join(lines)
    )


def _export_problems(cfg: ModelConfig, model_type: str) -> list:
    problems = []
    if model_type in MLA_MODEL_TYPES:
        need = {"attention_type": "mla"}
    else:
        need = {"attention_type": "gqa", "rope_interleaved": False}
    if model_type in SIGMOID_ROUTER_TYPES:
        need.update(score_func="sigmoid")
        if cfg.num_shared_experts < 1:
            problems.append("needs num_shared_experts >= 1")
    else:
        need.update(
            score_func="softmax",
            expert_bias=False,
            n_group=1,
            routed_scaling_factor=1.0,
            num_shared_experts=0,
            qkv_bias=False,
            partial_rotary_factor=1.0,
        )
        if model_type == "qwen3_moe":
            need.update(qk_norm=True)
        else:
            need.update(qk_norm=False, norm_topk_prob=True, first_k_dense=0)
    if model_type == "glm_moe_dsa":
        need.update(rope_interleaved=True)
        if not cfg.dsa.enabled:
            problems.append("needs model.dsa.index_n_heads > 0 (every glm_moe_dsa layer runs a DSA indexer)")
        if cfg.q_lora_rank is None:
            problems.append("needs model.q_lora_rank (glm_moe_dsa compresses its queries)")
    elif cfg.dsa.enabled:
        problems.append(
            f"has a DSA indexer (model.dsa.index_n_heads={cfg.dsa.index_n_heads}), which only glm_moe_dsa keeps"
        )
    problems += [
        f"needs {key}={value!r} (has {getattr(cfg, key)!r})"
        for key, value in need.items()
        if getattr(cfg, key) != value
    ]
    scaling = cfg.rope_scaling
    if scaling.type == "ntk":
        problems.append("rope_scaling.type='ntk' (static NTK) has no HF equivalent")
    if scaling.type == "dynamic_ntk" and scaling.original_max_position not in (0, cfg.max_position_embeddings):
        problems.append(
            "HF dynamic RoPE scales from max_position_embeddings; rope_scaling.original_max_position "
            "must be 0 or equal to it"
        )
    return problems


def _export_notes(cfg: ModelConfig, model_type: str, moe: MoEConfig, dsa_stage: str) -> list:
    notes = []
    if model_type == "glm_moe_dsa" and dsa_stage != "sparse":
        notes.append(
            f"dsa.stage={dsa_stage!r}: transformers' glm_moe_dsa always keeps each query's index_topk="
            f"{cfg.dsa.index_topk} best keys (stage sparse), so logits of longer sequences differ"
        )
    if moe.expert_lock:
        notes.append(
            "expert locking (moe.expert_lock) is a mindmoe routing rule; HF routes without it, so "
            "logits of sequences that would lock differ"
        )
    if moe.dispatch == "capacity":
        notes.append("HF MoE layers are dropless; logits match mindmoe with moe.dispatch=dropless")
    return notes


def _hf_rope_scaling(cfg: ModelConfig):
    scaling = cfg.rope_scaling
    if scaling.type == "none":
        return None
    if scaling.type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.type == "dynamic_ntk":
        return {"rope_type": "dynamic", "factor": scaling.factor}
    out = {
        "rope_type": "yarn",
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position or cfg.max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
    }
    if scaling.attention_factor:
        out["attention_factor"] = scaling.attention_factor
    if scaling.mscale_all_dim:
        out["mscale_all_dim"] = scaling.mscale_all_dim
    return out


def _export_dict(cfg: ModelConfig, model_type: str) -> dict:
    out = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "torch_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _hf_rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "attention_dropout": 0.0,
        "num_experts_per_tok": cfg.top_k,
        "use_cache": True,
    }
    if model_type in MLA_MODEL_TYPES:
        out.update(
            num_key_value_heads=cfg.num_heads,
            head_dim=cfg.qk_rope_head_dim,  # what DeepseekV3Config sets; HF sizes RoPE from it
            attention_bias=False,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_interleave=cfg.rope_interleaved,
        )
    else:
        out.update(num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.resolved_head_dim)
    if model_type in SIGMOID_ROUTER_TYPES:
        out.update(
            intermediate_size=cfg.intermediate_size,
            first_k_dense_replace=cfg.first_k_dense,
            n_routed_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            n_shared_experts=cfg.num_shared_experts,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            num_nextn_predict_layers=cfg.mtp_layers,
        )
    if model_type == "glm4_moe_lite":
        _transformers5_keys(out)
    elif model_type == "glm_moe_dsa":
        _glm_moe_dsa_keys(out, cfg)
    if model_type == "glm4_moe":
        out.update(
            partial_rotary_factor=cfg.partial_rotary_factor,
            attention_bias=cfg.qkv_bias,
            use_qk_norm=cfg.qk_norm,
        )
    elif model_type == "qwen3_moe":
        out.update(
            attention_bias=False,
            intermediate_size=cfg.intermediate_size,
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(cfg.first_k_dense)),
            norm_topk_prob=cfg.norm_topk_prob,
            use_sliding_window=False,
            sliding_window=None,
        )
    elif model_type == "mixtral":
        out.update(
            intermediate_size=cfg.moe_intermediate_size,
            num_local_experts=cfg.num_experts,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
    return out


def _transformers5_keys(out: dict) -> None:
    """Rewrite ``out`` as transformers 5 writes a ``glm4_moe_lite`` config (the only version that has the
    architecture): RoPE in ``rope_parameters``, dense layers as ``mlp_layer_types``, no ``head_dim`` (an alias
    of ``qk_rope_head_dim`` there) and no MTP layer count (its class has none)."""
    scaling = out.pop("rope_scaling") or {"rope_type": "default"}
    out["rope_parameters"] = {"rope_theta": out.pop("rope_theta"), **scaling}
    dense = out.pop("first_k_dense_replace")
    out["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (out["num_hidden_layers"] - dense)
    del out["head_dim"], out["num_nextn_predict_layers"]


def _glm_moe_dsa_keys(out: dict, cfg: ModelConfig) -> None:
    """Rewrite ``out`` as transformers 5.23 writes a ``glm_moe_dsa`` config (model.hf.dsa_fields): transformers 5's
    RoPE and dense-layer keys (``first_k_dense_replace`` kept, equal), no ``rope_interleave`` (always interleaved),
    the indexer's keys with every layer ``"full"``, and the MTP layer count, as GLM-5's config.json has it."""
    num_nextn = out["num_nextn_predict_layers"]
    _transformers5_keys(out)
    del out["rope_interleave"]
    out.update(
        head_dim=cfg.qk_rope_head_dim,
        first_k_dense_replace=cfg.first_k_dense,
        index_n_heads=cfg.dsa.index_n_heads,
        index_head_dim=cfg.dsa.index_head_dim,
        index_topk=cfg.dsa.index_topk,
        indexer_types=["full"] * cfg.num_layers,
        num_nextn_predict_layers=num_nextn,
    )


def _checkpoint_policy(source) -> tuple:
    """``(MoEConfig, DSA stage)`` a checkpoint directory records (the defaults when it cannot be read: the notes
    only)."""
    try:
        directory = Path(source).expanduser()
        return checkpoint_moe_config(directory), checkpoint_dsa_training(directory).stage
    except (ValueError, TypeError):
        return MoEConfig(), "sparse"


def _source(source, model_config):
    """``(ModelConfig, iterator of (our name, numpy array))`` for a model or a checkpoint directory."""
    if isinstance(source, (str, Path)):
        directory = Path(source).expanduser()
        if directory.is_file() and directory.suffix == ".safetensors":
            directory = directory.parent
        weights = directory / MODEL_FILE
        if not weights.is_file():
            raise HFCheckpointError(
                f"{source}: no {MODEL_FILE} (expected a mindmoe checkpoint "
                "directory such as <run dir>/checkpoints/step_000300)"
            )
        if model_config is None:
            try:
                model_config = checkpoint_model_config(directory)
            except ValueError as err:
                raise HFCheckpointError(f"{err}; pass model_config") from None
        # Every tensor whole, from the pieces the ranks wrote (model/checkpoints/shards.py), one at a time.
        return model_config, read_tensors(directory, "model")
    cfg = model_config or source.config
    return cfg, ((param.name, param.asnumpy()) for param in source.get_parameters())
