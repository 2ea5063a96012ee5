"""HF ``glm_moe_dsa`` (GLM-5: MLA, DeepSeek Sparse Attention's indexer, sigmoid MoE) against transformers 5.23.

The reference runs in its own venv (``tf5_reference`` fixture). Tiny random ``GlmMoeDsaForCausalLM`` models saved
with ``save_pretrained`` load in mindmoe (``model.dsa``, stage sparse) with transformers' logits (fp32, eager
attention, <= 1e-4) at every position of sequences longer than ``index_topk``, so the indexer's choice of keys
matters (dense MLA, ``dsa.stage=off``, misses by far more). The import exported again reloads there with
identical weights and logits; an MTP layer (``model.layers.{L}.*``, its indexer included) round-trips byte for byte;
what mindmoe cannot reproduce (IndexShare's ``"shared"`` layers, biases) is refused naming the key.

Ties: the indexer scores ``sum_j w_j ReLU(q_j . k)``; torch's topk and mindmoe's threshold (model/dsa.py keeps every
key tied with the k-th) would part ways only at an exact tie, so the variants use 8 or 16 indexer heads and a test
checks, with the imported indexer's weights on the reference's layer inputs, that no query's k-th and (k+1)-th best
keys are close.
"""

import json
import shutil

import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model import attention
from mindmoe.model.dsa_config import DSAConfig, DSATrainingConfig
from mindmoe.model.hf import HFCheckpointError, export_hf, hf_config_from_model, load_hf_pretrained, read_hf_config
from mindmoe.model.outputs import OUT_HEAD
from tests.helpers.hf_models import GLM_MOE_DSA_VARIANTS as VARIANTS
from tests.helpers.hf_models import glm_moe_dsa_config as dsa_config
from tests.helpers.hf_models import token_ids
from tests.helpers.hf_mtp import all_tensors, with_mtp_layer

ATOL = 1e-4
SEQ = 20
INDEXER = "self_attn.indexer"


@pytest.fixture(scope="module")
def variant(tf5_reference, tmp_path_factory):
    """``name -> (reference result, directory, cfg, ours)``, built once per module."""
    built = {}

    def get(name):
        if name not in built:
            directory = tmp_path_factory.mktemp(name) / "hf"
            reference = tf5_reference.build(VARIANTS[name], len(name), directory, token_ids(SEQ, seed=3), [INDEXER])
            cfg, ours, _ = load_hf_pretrained(directory)
            built[name] = reference, directory, cfg, ours
        return built[name]

    return get


def our_logits(model, ids):
    return model(Tensor(ids), Tensor(np.zeros_like(ids)))[OUT_HEAD].asnumpy()


def indexer_scores(params: dict, layer: int, cfg, captured: dict) -> np.ndarray:
    """``[B, S, S]`` scores of layer ``layer``'s indexer (model/dsa.py's formula, the imported weights) on the inputs
    transformers' indexer received: the normed hidden state, MLA's compressed query and the RoPE tables."""
    prefix, at = f"layers.{layer}.{INDEXER}.", f"model.layers.{layer}.{INDEXER}."
    x, q_resid, cos, sin = (captured[at + arg] for arg in ("arg0", "arg1", "arg2.0", "arg2.1"))
    heads, width, rope = cfg.dsa.index_n_heads, cfg.dsa.index_head_dim, cfg.qk_rope_head_dim
    q = (q_resid @ params[prefix + "wq_b.weight"].T).reshape(*x.shape[:2], heads, width)
    k = x @ params[prefix + "wk.weight"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * params[prefix + "k_norm.weight"] + params[prefix + "k_norm.bias"]
    cos, sin = cos[..., : rope // 2], sin[..., : rope // 2]  # one angle per interleaved pair

    def rotate(v, c, s):
        even, odd = v[..., 0:rope:2], v[..., 1:rope:2]
        return np.concatenate([even * c - odd * s, odd * c + even * s, v[..., rope:]], -1)

    q, k = rotate(q, cos[:, :, None], sin[:, :, None]), rotate(k, cos, sin)
    weights = x @ params[prefix + "weights_proj.weight"].T / np.sqrt(heads)
    relu = np.maximum(np.einsum("bthd,bsd->bths", q, k), 0.0) / np.sqrt(width)
    return np.einsum("bth,bths->bts", weights, relu)


def boundary_gaps(scores: np.ndarray, topk: int) -> np.ndarray:
    """Per query with more than ``topk`` visible keys: its k-th minus its (k+1)-th best visible score."""
    gaps = []
    for t in range(topk, scores.shape[1]):
        ranked = -np.sort(-scores[:, t, : t + 1], axis=-1)
        gaps.append(ranked[:, topk - 1] - ranked[:, topk])
    return np.concatenate(gaps)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_glm_moe_dsa_checkpoint_gives_transformers5_logits(variant, name):
    reference, _, cfg, ours = variant(name)
    assert reference["transformers"] == "5.23.0" and reference["model_class"] == "GlmMoeDsaForCausalLM"
    assert ours.dsa_training.stage == "sparse" and cfg.dsa.index_topk < SEQ and cfg.rope_interleaved
    assert ours.moe_config.dispatch == "dropless"  # moe.dispatch=auto on imported weights: no token dropped
    params = {p.name: p.asnumpy() for p in ours.get_parameters()}
    for layer in range(cfg.num_layers):
        scores = indexer_scores(params, layer, cfg, reference["captured"])
        gaps = boundary_gaps(scores, cfg.dsa.index_topk)
        # far from a tie: the two implementations' layer inputs agree to ~1e-5, which cannot swap the k-th and
        # (k+1)-th key of any query
        assert gaps.min() > 1e-4 * np.abs(scores).max(), (layer, gaps.min())
    expected = reference["logits"]
    assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
    np.testing.assert_allclose(our_logits(ours, token_ids(SEQ, seed=3)), expected, atol=ATOL, rtol=0)


def test_blockwise_dsa_kernel_gives_transformers5_logits(variant, monkeypatch):
    """The same checkpoint with 20 positions in blocks of 8: every layer runs the ``indexed_attention`` kernel
    (model/kernels/cpu_dsa.py) instead of the whole-mask path."""
    reference, directory, _, _ = variant("glm5_shaped")
    monkeypatch.setattr(attention, "BLOCK_SIZE", 8)
    _, blockwise, _ = load_hf_pretrained(directory)
    assert all(layer.self_attn.indexed_blockwise.block_size == 8 for layer in blockwise.layers)
    np.testing.assert_allclose(our_logits(blockwise, token_ids(SEQ, seed=3)), reference["logits"], atol=ATOL, rtol=0)


def test_dense_attention_misses_transformers_logits(variant):
    """The same checkpoint with the indexer not run (``dsa.stage=off``): the key selection is what matched."""
    reference, directory, _, _ = variant("glm5_shaped")
    cfg, dense, _ = load_hf_pretrained(directory, dsa=DSATrainingConfig(stage="off"))
    assert cfg.dsa == DSAConfig(index_n_heads=16, index_head_dim=16, index_topk=5)
    assert not any(layer.self_attn.dsa_active for layer in dense.layers)
    assert np.abs(our_logits(dense, token_ids(SEQ, seed=3)) - reference["logits"]).max() > 1e-2


def test_glm_moe_dsa_config_maps_every_setting(variant):
    reference, directory, cfg, _ = variant("yarn_two_dense_topk7")
    saved = json.loads((directory / "config.json").read_text())
    assert "rope_interleave" not in saved and saved["indexer_types"] == ["full"] * 3
    assert cfg.dsa == DSAConfig(index_n_heads=8, index_head_dim=12, index_topk=7)
    assert (cfg.attention_type, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.first_k_dense) == ("mla", 16, 4, 2)
    assert (cfg.score_func, cfg.expert_bias, cfg.routed_scaling_factor, cfg.num_shared_experts) == (
        "sigmoid",
        True,
        2.5,
        1,
    )
    assert (cfg.rope_scaling.type, cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim) == ("yarn", 4.0, 0.8)
    assert (cfg.n_group, cfg.topk_group) == (4, 2)
    glm5 = variant("glm5_shaped")[2]
    assert (glm5.first_k_dense, glm5.num_shared_experts, glm5.score_func, glm5.expert_bias) == (3, 1, "sigmoid", True)
    assert (glm5.routed_scaling_factor, glm5.q_lora_rank, glm5.rope_theta, glm5.v_head_dim) == (2.5, 16, 1e6, 16)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_glm_moe_dsa_export_reloads_in_transformers5_with_the_same_weights_and_logits(
    variant, tf5_reference, name, tmp_path
):
    """HF -> mindmoe -> HF; the GLM-5-shaped model without a model_type (a model with an indexer is a glm_moe_dsa)."""
    reference, _, cfg, ours = variant(name)
    out = tmp_path / "export"
    assert export_hf(ours, out_dir=out, model_type="" if name == "glm5_shaped" else "glm_moe_dsa") == []
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert exported["indexer_types"] == ["full"] * cfg.num_layers and "rope_interleave" not in exported
    reloaded = tf5_reference.reload(out, token_ids(SEQ, seed=3))
    assert reloaded["model_class"] == "GlmMoeDsaForCausalLM"
    for key in ("mlp_layer_types", "index_n_heads", "index_head_dim", "index_topk", "q_lora_rank", "head_dim"):
        assert reloaded["config"][key] == reference["config"][key], key
    assert set(reloaded["state"]) == set(reference["state"])
    for key, value in reloaded["state"].items():
        np.testing.assert_array_equal(value, reference["state"][key], err_msg=key)
    np.testing.assert_array_equal(reloaded["logits"], reference["logits"])


def test_mtp_layer_with_its_indexer_imports_and_exports_byte_identical(variant, tmp_path):
    _, built, cfg, _ = variant("glm5_shaped")
    directory = tmp_path / "hf"
    shutil.copytree(built, directory)
    mtp = with_mtp_layer(directory, cfg.num_layers)
    assert f"model.layers.{cfg.num_layers}.{INDEXER}.wq_b.weight" in mtp
    skipped = load_hf_pretrained(directory)[2]
    assert any(f"multi-token-prediction tensors of layer(s) [{cfg.num_layers}]" in note for note in skipped)
    mtp_cfg, model, notes = load_hf_pretrained(directory, {"mtp_layers": 1})
    assert mtp_cfg.mtp_layers == 1 and not any("skipped" in note for note in notes)
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    for part in ("wq_b.weight", "k_norm.bias", "weights_proj.weight"):
        ours = params[f"mtp_layers.0.{INDEXER}.{part}"]
        np.testing.assert_array_equal(ours, mtp[f"model.layers.{cfg.num_layers}.{INDEXER}.{part}"])
    export_hf(model, out_dir=tmp_path / "out")  # the DSA indexer picks glm_moe_dsa
    original, exported = all_tensors(directory), all_tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, array in original.items():
        assert exported[name].tobytes() == array.astype(np.float32).tobytes(), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["num_nextn_predict_layers"]) == ("glm_moe_dsa", 1)


def test_glm_moe_dsa_defaults_are_transformers5s(tf5_reference, tmp_path):
    """A config.json with only ``model_type`` imports as the full config transformers 5.23 writes for it (which
    states head_dim, qk_head_dim, layer_types and indexer_types)."""
    written = tf5_reference.config({"model_type": "glm_moe_dsa"}, tmp_path)
    bare = read_hf_config({"model_type": "glm_moe_dsa"})
    assert read_hf_config(written).model_config == bare.model_config and bare.notes == []
    cfg = bare.model_config
    assert (cfg.num_layers, cfg.first_k_dense, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        78,
        3,
        2048,
        192,
        256,
    )
    assert cfg.dsa == DSAConfig(index_n_heads=32, index_head_dim=128, index_topk=2048)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(indexer_types=["full", "shared", "full"]), r"indexer_types: layers \[1\] are 'shared'.*only 'full'"),
        (dict(index_topk_freq=2), r"indexer_types \(from index_topk_freq=2, .*layers \[2\] are 'shared'"),
        (dict(index_topk_pattern="FSS"), r"indexer_types \(from index_topk_pattern='FSS'\): layers \[1, 2\]"),
        (dict(indexer_types=["full", "full"]), "indexer_types: has 2 entries for num_hidden_layers=3"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(q_lora_rank=None), "q_lora_rank=None: must be set"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2: must equal num_attention_heads=4"),
        (dict(layer_types=["full_attention"] * 3), "layer_types=.*'indexed_attention'"),
        (dict(index_n_heads=0), "index_n_heads=0: must be >= 1"),
        (dict(index_head_dim=2), "index_head_dim=2: must be even and at least qk_rope_head_dim=4"),
        (dict(mlp_layer_types=["dense", "sparse", "dense"]), "mlp_layer_types=.*dense layer after a MoE layer"),
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ],
)
def test_unsupported_glm_moe_dsa_settings_are_refused_naming_the_key(changes, match):
    with pytest.raises(HFCheckpointError, match=match):
        read_hf_config(dsa_config(**changes))


def test_keys_transformers_recomputes_or_never_reads_are_noted():
    imported = read_hf_config(
        dsa_config(
            head_dim=99,
            qk_head_dim=7,
            rope_interleave=False,
            mlp_bias=True,
            mlp_layer_types=["dense", "sparse", "sparse"],
            first_k_dense_replace=2,
            num_local_experts=16,
            num_experts=4,
        )
    )
    cfg, notes = imported.model_config, " | ".join(imported.notes)
    assert (cfg.rope_interleaved, cfg.first_k_dense, cfg.num_experts) == (True, 1, 16)
    for noted in ("head_dim=99", "qk_head_dim=7", "rope_interleave=False", "mlp_bias=True", "first_k_dense_replace=2"):
        assert f"{noted} is not used" in notes, noted
    assert read_hf_config(dsa_config(num_experts=4)).model_config.num_experts == 4


def test_an_indexer_is_exported_only_as_glm_moe_dsa_and_no_key_of_it_overrides():
    cfg = read_hf_config(dsa_config()).model_config
    assert hf_config_from_model(cfg)[0] == "glm_moe_dsa"
    for other in ("deepseek_v3", "glm4_moe_lite"):
        with pytest.raises(HFCheckpointError, match=r"has a DSA indexer \(model.dsa.index_n_heads=16\)"):
            hf_config_from_model(cfg, other)
    plain = read_hf_config(dict(dsa_config(), model_type="glm4_moe_lite")).model_config
    with pytest.raises(HFCheckpointError, match="glm_moe_dsa: needs model.dsa.index_n_heads > 0"):
        hf_config_from_model(plain, "glm_moe_dsa")
    from mindmoe.model.hf import apply_overrides

    imported = read_hf_config(dsa_config())
    assert apply_overrides(imported, {"dsa": {"index_topk": 5}}).dsa == imported.model_config.dsa
    with pytest.raises(HFCheckpointError, match=r"model.dsa.stage is now dsa.stage"):
        apply_overrides(imported, {"dsa": {"stage": "off"}})
    assert "dsa.stage='off'" in hf_config_from_model(imported.model_config, "", None, "off")[2][0]
    assert hf_config_from_model(imported.model_config)[2] == []
    with pytest.raises(HFCheckpointError, match=r"model.dsa.index_topk=3 conflicts with .*which gives 5"):
        apply_overrides(imported, {"dsa": {"index_topk": 3}})
    with pytest.raises(HFCheckpointError, match=r"model\.aux_loss: unknown key"):  # the MoE policy is moe.*
        apply_overrides(imported, {"aux_loss": "seq"})


def test_glm5_model_group_is_the_published_model_and_counts_its_parameters():
    """``model=glm5`` equals the import of a ``glm_moe_dsa`` config.json holding its model type and GLM-5's
    rope_theta (every other setting of GLM-5 is a transformers 5.23 default), and counts transformers' figures."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from mindmoe.conf.policy import run_moe_config
    from mindmoe.conf.schema import register_configs
    from mindmoe.model.param_count import count_parameters

    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        composed = compose(config_name="config", overrides=["model=glm5"])
        imported_run = compose(config_name="config", overrides=["model=glm5", "model.pretrained=glm5_dir"])
    group = OmegaConf.to_object(composed.model)
    # the published model runs dropless: moe.dispatch=auto gives that to an import of it
    assert composed.moe.dispatch == "auto" and run_moe_config(imported_run).dispatch == "dropless"
    imported = read_hf_config({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_theta": 1e6}}).model_config
    architecture = [
        "vocab_size", "hidden_size", "num_layers", "num_heads", "attention_type", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleaved", "rope_theta",
        "max_position_embeddings", "rope_scaling", "rms_norm_eps", "intermediate_size", "first_k_dense",
        "num_experts", "top_k", "moe_intermediate_size", "num_shared_experts", "score_func", "expert_bias",
        "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "tie_word_embeddings", "dsa",
    ]  # fmt: skip
    assert {key: getattr(group, key) for key in architecture} == {key: getattr(imported, key) for key in architecture}
    count = count_parameters(imported)
    assert (count.total, count.active, count.active_with_lm_head) == (
        743_911_199_232,
        39_881_544_192,
        40_833_126_912,
    )
