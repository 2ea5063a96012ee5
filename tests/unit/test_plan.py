"""mindmoe-plan: exact parameter counts (vs the instantiated model and HF ``num_parameters()``),
the GLM-4.5 recipes against their published sizes, the memory model of the trainer against hand
arithmetic, the layout search and what it prints."""

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
    Batch,
    Layout,
    Setup,
    layout_errors,
    search_layouts,
)
from mindmoe.launch.plan_cli import removed_key_error, report
from mindmoe.launch.plan_params import lora_trained
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


def composed(overrides):
    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def model_config(name):
    return OmegaConf.to_object(composed([f"model={name}"]).model)


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


@pytest.mark.parametrize(
    "name, total, active, with_head",
    [
        ("deepseek_v3", 671_026_404_352, 35_698_924_544, 36_625_603_584),
        ("glm5", 743_911_199_232, 39_881_544_192, 40_833_126_912),  # transformers' GlmMoeDsaForCausalLM
    ],
)
def test_mla_models_exact_counts_are_the_plans_first_lines(name, total, active, with_head):
    counts = count_parameters(model_config(name))
    assert (counts.total, counts.active, counts.active_with_lm_head) == (total, active, with_head)
    lines = report(composed([f"model={name}"]))
    assert lines[:2] == [f"total parameters: {total}", f"active parameters: {active}"]
    assert f"  active incl. LM head: {with_head} " in "\n".join(lines)


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


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("reserved_gb", 64.0, "plan.device_memory_gb=64.0: must exceed"),
        ("device", "GPU", "plan.device='GPU': must be one of Ascend, CPU"),
        ("devices", -1, "plan.devices=-1: must be >= 0"),
    ],
)
def test_plan_config_errors_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_plan_config(PlanConfig(**{key: value}))


@pytest.mark.parametrize(
    "arg, replacement",
    [
        ("plan.zero=1", "use parallel.zero (1-3: ZeRO"),
        ("plan.recompute=true", "use train.recompute"),
        ("+plan.tp=2", "tensor parallelism is not implemented"),
        ("plan.pp=4", "pipeline parallelism is not implemented"),
        ("plan.flash_attention=false", "blockwise on Ascend"),
        ("plan.grad_dtype=bf16", "gradients are fp32"),
    ],
)
def test_old_plan_keys_name_their_replacement(arg, replacement):
    assert replacement in removed_key_error(["model=glm45", arg])
    assert removed_key_error(["plan.devices=8", "train.recompute=true"]) is None


def test_cli_rejects_an_old_plan_key_before_composing():
    result = run_cli(["plan.zero=1"], REPO)
    assert result.returncode == 2
    assert "mindmoe-plan: error: plan.zero: use parallel.zero" in result.stderr


AIR_LORA = ["model=glm45_air", "moe.bias_update_rate=0", "lora.enabled=true", "plan.device_memory_gb=64"]


def table_verdict(lines):
    """The memory table's last line (the total) and the layout line above the table."""
    layout = next(line for line in lines if line.startswith("layout: "))
    total = next(line for line in lines if line.startswith("    total "))
    return layout, total


def test_glm45_air_lora_on_8_devices_of_64gb_fits_and_names_its_keys():
    result = run_cli([*AIR_LORA, "plan.devices=8"], REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"total parameters: {count_parameters(model_config('glm45_air')).total}"
    layout, total = table_verdict(lines)
    assert total.endswith(": fits")
    assert "DOES NOT FIT" not in result.stdout  # no proposed layout is printed as not fitting
    keys = layout[len("layout: ") : layout.index(" on 8 devices")]
    assert "parallel.ep=8" in keys and "tp" not in keys  # 128 experts of bf16 need all 8 devices
    cfg = composed([*AIR_LORA, *keys.split()])
    assert not layout_errors(
        OmegaConf.to_object(cfg.model),
        Layout(dp=cfg.parallel.dp, ep=cfg.parallel.ep, dispatcher=cfg.parallel.ep_dispatcher),
        Batch(cfg.data.seq_len, cfg.data.micro_batch_size, cfg.data.global_batch_size),
    )


GLM5_LORA = ["model=glm5", "lora.enabled=true", "moe.bias_update_rate=0", "plan.device_memory_gb=64"]


def test_glm5_lora_needs_128_devices_of_64gb_and_names_its_keys():
    """GLM-5 (744 B, MLA with the DSA indexer) LoRA: the bf16 base outside the routed experts (about 36 GiB) is on
    every rank, so 64 devices do not fit; 128 do, with the experts split over all of them."""
    result = run_cli([*GLM5_LORA, "plan.devices=128"], REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "total parameters: 743911199232"
    assert lines[1] == "active parameters: 39881544192"
    layout, total = table_verdict(lines)
    assert layout.startswith("layout: parallel.dp=1 parallel.ep=128 ") and total.endswith(": fits")
    assert "DOES NOT FIT" not in result.stdout
    fewer = report(composed([*GLM5_LORA, "plan.devices=64"]))
    assert "no layout fits on 64 devices; the one needing the least memory:" in fewer


def test_search_proposes_only_fitting_layouts_best_first_and_plans_the_best():
    """GLM-4.5-Air LoRA at 4,096 positions on 16 devices (full training of it fits nowhere without ZeRO:
    the fp32 non-expert weights, gradients and moments alone are over 100 GiB)."""
    overrides = [*AIR_LORA, "data.seq_len=4096", "data.micro_batch_size=1", "data.global_batch_size=16"]
    cfg = composed(overrides)
    model, batch = OmegaConf.to_object(cfg.model), Batch(4096, 1, 16)
    setup = Setup(trained=lora_trained(model, OmegaConf.to_object(cfg.lora), "Ascend"))
    found = search_layouts(model, 16, batch, PlanConfig(), setup)
    assert len(found) >= 2
    for candidate in found:
        assert candidate.layout.devices == 16 and candidate.fits
        assert candidate.memory.total <= 60 * GIB and not layout_errors(model, candidate.layout, batch)
    order = [(c.layout.recompute, c.layout.ep) for c in found]
    assert order == sorted(order)
    assert not search_layouts(model, 16, batch, PlanConfig(device_memory_gb=8.0), setup)
    lines = report(composed([*overrides, "plan.devices=16"]))
    layout, total = table_verdict(lines)
    assert layout.startswith(f"layout: {found[0].layout.keys()} on 16 devices") and total.endswith(": fits")
    assert "DOES NOT FIT" not in "\n".join(lines)


def test_a_given_layout_is_planned_and_nothing_fitting_says_so():
    lines = report(composed(["model=glm45", "plan.devices=8", "parallel.ep=8"]))
    layout, total = table_verdict(lines)
    assert layout.startswith("layout: parallel.dp=1 parallel.ep=8 parallel.ep_dispatcher=allgather")
    assert total.endswith(": DOES NOT FIT")  # 355 B fp32 parameters on 8 devices
    assert "layouts that fit on 8 devices of 64 GiB: 0 fit" in "\n".join(lines)


def test_when_nothing_fits_the_least_memory_layout_is_shown_as_not_fitting():
    lines = report(composed(["model=glm45", "plan.devices=8"]))  # full training of 355 B: fp32, no ZeRO
    assert "no layout fits on 8 devices; the one needing the least memory:" in lines
    layout, total = table_verdict(lines)
    assert layout.startswith("layout: parallel.dp=1 parallel.ep=8 ") and total.endswith(": DOES NOT FIT")
