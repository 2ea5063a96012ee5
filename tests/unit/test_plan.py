"""mindmoe-plan: exact parameter counts (vs the instantiated model and HF ``num_parameters()``),
the GLM-4.5 recipes against their published sizes, the memory model against hand arithmetic,
and the layout search."""

import re
import subprocess
import sys
from math import prod
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from mindmoe.conf.schema import register_configs
from mindmoe.launch.config import PlanConfig, validate_plan_config
from mindmoe.launch.plan import (
    GIB,
    MIB,
    Batch,
    Layout,
    activation_bytes_per_token,
    layout_errors,
    plan_layout,
    search_layouts,
)
from mindmoe.model.config import ModelConfig
from mindmoe.model.param_count import count_parameters, parameter_shapes

REPO = Path(__file__).resolve().parents[2]


def tiny(**overrides):
    fields = dict(
        vocab_size=50,
        hidden_size=16,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=24,
        first_k_dense=1,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=8,
        num_shared_experts=1,
        qkv_bias=True,
        qk_norm=True,
        expert_bias=True,
        score_func="sigmoid",
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


TINY_CONFIGS = {
    "glm_like": tiny(),
    "tied_no_bias_no_qknorm": tiny(tie_word_embeddings=True, qkv_bias=False, qk_norm=False),
    "all_moe_no_shared": tiny(first_k_dense=0, num_shared_experts=0, expert_bias=False),
    "two_dense_two_shared": tiny(num_layers=4, first_k_dense=2, num_shared_experts=2, num_kv_heads=4),
    "all_dense_tied": tiny(num_layers=2, first_k_dense=2, tie_word_embeddings=True, head_dim=0),
}


def model_config(name):
    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={name}"])
    return OmegaConf.to_object(cfg.model)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_parameter_shapes_are_exactly_what_the_model_creates(name):
    from mindmoe.model.transformer import MoETransformer

    cfg = TINY_CONFIGS[name]
    model = MoETransformer(cfg)
    created = [(p.name, tuple(p.shape)) for p in model.get_parameters()]
    assert list(parameter_shapes(cfg, include_buffers=True).items()) == created
    trained = {p.name: tuple(p.shape) for p in model.trainable_params()}
    assert parameter_shapes(cfg) == trained
    assert count_parameters(cfg).total == sum(prod(shape) for shape in trained.values())


def hf_glm4_moe(cfg):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM

    return Glm4MoeForCausalLM(hf_config(cfg))


def hf_config(cfg):
    """The HF ``glm4_moe`` config of one of ours (the fields that shape parameters)."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.resolved_head_dim,
        attention_bias=cfg.qkv_bias,
        use_qk_norm=cfg.qk_norm,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts_per_tok=cfg.top_k,
        n_shared_experts=cfg.num_shared_experts,
        n_routed_experts=cfg.num_experts,
        first_k_dense_replace=cfg.first_k_dense,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # HF builds 0-wide shared experts
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_total_equals_hf_num_parameters_and_active_follows_hf_modules(name):
    cfg = TINY_CONFIGS[name]
    hf = hf_glm4_moe(cfg)
    counts = count_parameters(cfg)
    assert counts.total == hf.num_parameters()
    # Active per token from HF's own module tree: drop embeddings and head, keep top_k of E experts.
    active = 0
    for param_name, param in hf.named_parameters():
        if "embed_tokens" in param_name or param_name.startswith("lm_head"):
            continue
        is_expert = re.search(r"\.mlp\.experts\.\d+\.", param_name)
        active += param.numel() * (cfg.top_k / cfg.num_experts if is_expert else 1)
    assert counts.active == round(active)
    assert counts.active_with_lm_head == counts.active + cfg.vocab_size * cfg.hidden_size


@pytest.mark.parametrize("name", ["glm45", "glm45_air"])
def test_glm45_recipes_equal_hf_num_parameters(name):
    """HF models built on the meta device (no memory) with the dense layers plus one and two MoE
    layers; MoE layers are identical, so the full depth is the linear extrapolation. (Building all
    92 layers on meta gives the same 352,797,814,784 for GLM-4.5 but takes ~20 s.)"""
    from dataclasses import replace

    import torch
    from transformers.modeling_utils import no_init_weights
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM

    cfg = model_config(name)
    sizes = []
    for moe_layers in (1, 2):
        with torch.device("meta"), no_init_weights():
            model = Glm4MoeForCausalLM(hf_config(replace(cfg, num_layers=cfg.first_k_dense + moe_layers)))
        sizes.append(model.num_parameters())
    hf_total = sizes[0] + (cfg.num_moe_layers - 1) * (sizes[1] - sizes[0])
    assert count_parameters(cfg).total == hf_total


def closed_form_total(cfg):
    """GLM parameter count written out by hand from the architecture (independent of the shape list)."""
    hidden, head_dim = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    attention = hidden * q * 2 + hidden * kv * 2 + (q + 2 * kv) * cfg.qkv_bias + 2 * head_dim * cfg.qk_norm
    dense = 3 * hidden * cfg.intermediate_size
    moe = (
        cfg.num_experts * hidden
        + cfg.num_experts * 3 * hidden * cfg.moe_intermediate_size
        + 3 * hidden * cfg.moe_intermediate_size * cfg.num_shared_experts
    )
    layers = cfg.num_layers * (attention + 2 * hidden) + cfg.first_k_dense * dense + cfg.num_moe_layers * moe
    return layers + hidden + cfg.vocab_size * hidden * (1 if cfg.tie_word_embeddings else 2)


@pytest.mark.parametrize("name, total, active", [("glm45", 355e9, 32e9), ("glm45_air", 106e9, 12e9)])
def test_glm45_recipes_match_the_published_sizes(name, total, active):
    cfg = model_config(name)
    counts = count_parameters(cfg)
    assert counts.total == closed_form_total(cfg)
    assert abs(counts.total / total - 1) < 0.01
    assert abs(counts.active / active - 1) < 0.03
    assert counts.buffers == cfg.num_moe_layers * cfg.num_experts


def test_glm45_exact_counts():
    """The figures quoted in the README (MTP excluded; active excludes embedding and LM head)."""
    glm45, air = count_parameters(model_config("glm45")), count_parameters(model_config("glm45_air"))
    assert (glm45.total, glm45.active, glm45.active_with_lm_head) == (352_797_814_784, 32_080_359_424, 32_856_305_664)
    assert (air.total, air.active, air.active_with_lm_head) == (106_852_245_504, 12_182_609_920, 12_803_366_912)


def run_cli(args, cwd, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mindmoe.launch.plan_cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_prints_total_and_active_first_and_exits_zero():
    result = run_cli(["model=glm45"], REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    counts = count_parameters(model_config("glm45"))
    assert lines[0] == f"total parameters: {counts.total}"
    assert lines[1] == f"active parameters: {counts.active}"
    assert "DOES NOT FIT" in result.stdout  # 355B on one device: planned, reported, still exit 0


def test_cli_writes_no_files_and_rejects_an_impossible_layout(tmp_path):
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    result = run_cli(["model=glm45_air", "parallel.dp=4", "parallel.ep=3"], tmp_path, env)
    assert result.returncode == 2
    assert "parallel.ep=3 must divide model.num_experts=128" in result.stderr
    assert list(tmp_path.iterdir()) == []


# Hand-worked example: h=8, 2 layers (layer 0 dense, layer 1 MoE), 4 query heads / 2 KV heads of
# width 2 (q = 8, kv = 4), QK-norm, q/k/v bias, dense FFN 16, 4 experts of width 4, top-2, one shared
# expert, vocab 100, untied, dropless. Layout dp=2 tp=1 pp=2 ep=2 (edp=1); seq 16, micro-batch 2,
# global batch 8 -> 2 micro-batches per rank, 32 tokens per micro-batch.
HAND = dict(
    vocab_size=100,
    hidden_size=8,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    intermediate_size=16,
    first_k_dense=1,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=4,
    num_shared_experts=1,
    qkv_bias=True,
    qk_norm=True,
    dispatch="dropless",
    tie_word_embeddings=False,
)
HAND_BATCH = Batch(seq_len=16, micro_batch=2, global_batch=8)
ATTENTION = 8 * 8 + 8 + 2 * (8 * 4 + 4) + 8 * 8  # q, k, v (+ bias), o = 208
NORMS_PER_LAYER = 8 + 8 + 2 + 2  # two RMSNorms + q_norm, k_norm
STAGE0_SPLIT = 100 * 8 + ATTENTION + 3 * 8 * 16  # embedding, attention, dense FFN = 1392
STAGE0_REPLICATED = NORMS_PER_LAYER  # 20
STAGE1_SPLIT = ATTENTION + 3 * 8 * 4 + 100 * 8  # attention, shared expert, LM head = 1104
STAGE1_REPLICATED = NORMS_PER_LAYER + 4 * 8 + 8  # + router, final norm = 60
STAGE1_EXPERTS = 4 * 3 * 8 * 4  # 384
# bytes per token: norm+qkv inputs 4h, q/k/v 2(q+2kv), o_proj input 2q, qk-norm inputs 2(q+kv), lse 4a
ATTN_ACT = 4 * 8 + 2 * (8 + 8) + 2 * 8 + 2 * (8 + 4) + 4 * 4  # 120
DENSE_ACT = ATTN_ACT + 4 * 8 + 6 * 16  # 248
MOE_ACT = ATTN_ACT + 4 * 8 + 8 * 4 + 2 * (4 * 8 + 6 * 4) + 6 * 4  # 320
HEAD_ACT = 4 * 8 + 4 * 100  # 432


def hand_plan(**plan_overrides):
    plan = PlanConfig(grad_bucket_mb=1.0, **{k: v for k, v in plan_overrides.items() if k != "layout"})
    layout = plan_overrides.get("layout", Layout(dp=2, tp=1, pp=2, ep=2, zero=plan.zero, recompute=plan.recompute))
    return plan_layout(ModelConfig(**HAND), layout, HAND_BATCH, plan)


def test_memory_matches_hand_arithmetic_zero1():
    stage0, stage1 = hand_plan().stages
    assert stage0.weights == 2 * (STAGE0_SPLIT + STAGE0_REPLICATED)
    assert stage0.grads == 4 * (STAGE0_SPLIT + STAGE0_REPLICATED)
    assert stage0.optimizer == 12 * (STAGE0_SPLIT + STAGE0_REPLICATED) / 2  # ZeRO-1 over dp=2
    assert stage0.activations == 2 * 32 * DENSE_ACT  # 2 micro-batches in flight
    assert stage0.comm == 2 * MIB + 2 * 32 * 2 * 8 * 2 + 4 * 32 * 8 * 2  # buckets, all-to-all, p2p
    held1 = STAGE1_SPLIT + STAGE1_REPLICATED + STAGE1_EXPERTS / 2  # experts over ep=2
    assert stage1.weights == 2 * held1
    assert stage1.grads == 4 * held1
    # dense states over dp=2, expert states over edp = dp*tp/ep = 1
    assert stage1.optimizer == 12 * (STAGE1_SPLIT / 2 + STAGE1_REPLICATED / 2 + STAGE1_EXPERTS / 2)
    assert stage1.activations == 1 * 32 * (MOE_ACT + HEAD_ACT)  # last stage: 1 in flight


def test_memory_zero_levels_recompute_and_scores():
    full = hand_plan(zero=0).stages[0]
    assert full.optimizer == 12 * (STAGE0_SPLIT + STAGE0_REPLICATED)
    sharded_grads = hand_plan(zero=2, grad_dtype="bf16").stages[0]
    assert sharded_grads.grads == 2 * (STAGE0_SPLIT + STAGE0_REPLICATED) / 2
    recompute = hand_plan(recompute=True).stages[0]
    assert recompute.activations == 32 * (2 * 1 * 2 * 8 + DENSE_ACT)  # inputs kept + one layer
    no_flash = hand_plan(flash_attention=False).stages[0]
    assert no_flash.activations == 2 * 32 * (DENSE_ACT - 4 * 4 + 2 * 4 * 16)  # stored softmax 2as


def test_memory_with_tensor_parallelism():
    layout = Layout(dp=1, tp=2, pp=1, ep=2)  # edp = 1
    stage = hand_plan(layout=layout).stages[0]
    held = (STAGE0_SPLIT + STAGE1_SPLIT) / 2 + STAGE0_REPLICATED + STAGE1_REPLICATED + STAGE1_EXPERTS / 2
    assert stage.weights == 2 * held
    assert stage.activations == 32 / 2 * (DENSE_ACT + MOE_ACT + HEAD_ACT)  # sequence parallel
    assert stage.comm == 2 * 32 / 2 * 2 * 8 * 2 + 2 * 32 * 8 * 2  # all-to-all, SP gather


def test_attention_activations_are_korthikanti_without_dropout():
    """MHA, no QK-norm, stored softmax: Korthikanti's attention 11h + 5as plus its norm 2h, minus the
    dropout mask h and the dropout's 3as, is 12h + 2as per token."""
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=64,
        num_heads=8,
        num_kv_heads=8,
        qk_norm=False,
        intermediate_size=32,
        first_k_dense=1,
        num_layers=1,
    )
    seq = 128
    attention = activation_bytes_per_token(cfg, False, seq, flash_attention=False) - (4 * 64 + 6 * 32)
    assert attention == 12 * 64 + 2 * 8 * seq


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("zero", 3, "plan.zero=3: must be 0"),
        ("grad_dtype", "fp16", "plan.grad_dtype='fp16': must be one of"),
        ("reserved_gb", 64.0, "plan.device_memory_gb=64.0: must exceed"),
    ],
)
def test_plan_config_errors_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_plan_config(PlanConfig(**{key: value}))


def test_layout_errors_name_the_key():
    cfg = ModelConfig(**HAND)
    errors = layout_errors(cfg, Layout(dp=3, tp=4, pp=3, ep=8), HAND_BATCH)
    assert any(e.startswith("plan.tp=4 must divide model.num_heads") for e in errors)
    assert any(e.startswith("plan.pp=3 exceeds model.num_layers=2") for e in errors)
    assert any(e.startswith("parallel.ep=8 must divide") for e in errors)
    assert any(e.startswith("data.global_batch_size=8 must be a multiple") for e in errors)


def test_search_returns_only_fitting_layouts_of_the_device_count():
    cfg = model_config("glm45_air")
    batch = Batch(seq_len=4096, micro_batch=1, global_batch=1024)
    plan = PlanConfig()
    found = search_layouts(cfg, 256, batch, plan)
    assert found
    for candidate in found:
        layout = candidate.layout
        assert layout.dp * layout.tp * layout.pp == 256
        assert candidate.fits and candidate.worst.total <= (64 - 4) * GIB
        assert not layout_errors(cfg, layout, batch)
    sizes = [c.layout.tp * c.layout.pp for c in found]
    assert sizes == sorted(sizes)
    # A layout that does not fit is never offered.
    assert not plan_layout(cfg, Layout(dp=256, tp=1, pp=1, ep=1), batch, plan).fits


def test_search_finds_glm45_pretraining_layouts_on_1024_devices_of_64gb():
    cfg = model_config("glm45")
    batch = Batch(seq_len=4096, micro_batch=1, global_batch=4096)
    found = search_layouts(cfg, 1024, batch, PlanConfig(device_memory_gb=64.0))
    assert found
    best = found[0]
    assert best.layout.devices == 1024 and best.fits
    assert best.tokens_per_step == 4096 * 4096
