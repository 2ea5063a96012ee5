"""LoRA on the whole model: merging, freezing the base and counting trainable parameters, target selection
following PEFT 0.21.2's name rules, modules trained in full, the frozen projections' skipped gradients and the
expert update isolation, and building a model's adapters from the config.
"""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.config import ModelConfig
from mindmoe.model.lora import LoraConfig, target_matches
from mindmoe.model.lora.layers import LoraLinear
from mindmoe.model.lora.plan import (
    adaptable_projections,
    lora_parameters,
    lora_report,
    merge_and_unload,
    plan_adapters,
)
from mindmoe.model.moe.experts import RoutedExperts
from mindmoe.model.moe.lora_experts import LoraRoutedExperts
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.param_count import parameter_shapes
from mindmoe.model.transformer import MoETransformer

DROPLESS = MoEConfig(dispatch="dropless")  # the whole-model tests' policy: no token dropped, logits compare exactly


# --------------------------------------------------------------------------- whole-model behaviour


def tiny_config(**overrides):
    fields = dict(
        vocab_size=48,
        hidden_size=16,
        num_layers=2,
        first_k_dense=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=24,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=8,
        num_shared_experts=1,
        max_position_embeddings=32,
        initializer_range=0.3,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def randomize_adapters(model, seed):
    rng = np.random.default_rng(seed)
    for param in lora_parameters(model).values():
        param.set_data(Tensor(rng.normal(0, 0.3, size=param.shape).astype(np.float32)))


def logits(model, ids):
    @ms.jit
    def forward(input_ids, doc_ids):
        return model(input_ids, doc_ids)[OUT_HEAD]

    return forward(Tensor(ids), Tensor(np.zeros_like(ids))).asnumpy()


def test_merged_model_equals_unmerged_and_has_the_base_parameter_names():
    cfg = tiny_config()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 10)).astype(np.int32)
    lora = LoraConfig(enabled=True, r=4, alpha=8.0)
    base = MoETransformer(cfg, seed=3, moe=DROPLESS)
    base_logits = logits(base, ids)
    unmerged = MoETransformer(cfg, seed=3, lora=plan_adapters(cfg, lora, seed=1), moe=DROPLESS)
    randomize_adapters(unmerged, 2)
    base_names = [p.name for p in base.get_parameters()]
    adapted = MoETransformer(cfg, seed=3, lora=plan_adapters(cfg, lora, seed=1), moe=DROPLESS)
    randomize_adapters(adapted, 2)
    merged = merge_and_unload(adapted)
    assert merged.moe_config == adapted.moe_config == DROPLESS  # the merged model routes as the adapted one
    assert [p.name for p in merged.get_parameters()] == base_names
    assert not any(isinstance(c, (LoraLinear, LoraRoutedExperts)) for _, c in merged.cells_and_names())
    unmerged_logits = logits(unmerged, ids)
    assert np.abs(unmerged_logits - base_logits).max() > 0.1
    np.testing.assert_allclose(logits(merged, ids), unmerged_logits, atol=1e-4, rtol=0)


def test_a_lora_build_freezes_the_base_and_counts_trainable_parameters():
    cfg = tiny_config()
    total_base = sum(p.size for p in MoETransformer(cfg, seed=0, moe=DROPLESS).get_parameters())
    lora = LoraConfig(enabled=True, r=2, target_modules=["q_proj", "down_proj"])
    model = MoETransformer(cfg, seed=0, lora=plan_adapters(cfg, lora, seed=0), moe=DROPLESS)
    report = lora_report(model)
    trainable = {p.name: p.shape for p in model.trainable_params()}
    h, heads, d = cfg.hidden_size, cfg.num_heads, cfg.hidden_size // cfg.num_heads
    expected = {
        "layers.0.self_attn.q_proj.lora_A": (2, h),
        "layers.0.self_attn.q_proj.lora_B": (heads * d, 2),
        "layers.1.self_attn.q_proj.lora_A": (2, h),
        "layers.1.self_attn.q_proj.lora_B": (heads * d, 2),
        "layers.0.mlp.down_proj.lora_A": (2, cfg.intermediate_size),
        "layers.0.mlp.down_proj.lora_B": (h, 2),
        "layers.1.mlp.experts.down_proj.lora_A": (cfg.num_experts, 2, cfg.moe_intermediate_size),
        "layers.1.mlp.experts.down_proj.lora_B": (cfg.num_experts, h, 2),
        "layers.1.mlp.shared_experts.down_proj.lora_A": (2, cfg.moe_intermediate_size),
        "layers.1.mlp.shared_experts.down_proj.lora_B": (h, 2),
    }
    assert {k: tuple(v) for k, v in trainable.items()} == expected
    count = sum(int(np.prod(s)) for s in expected.values())
    assert report.trainable == count and report.total == total_base + count
    assert report.share == pytest.approx(count / (total_base + count))


def test_targets_follow_peft_name_rules():
    assert target_matches(["q_proj"], "model.layers.0.self_attn.q_proj")
    assert not target_matches(["proj"], "model.layers.0.self_attn.q_proj")  # suffix means a whole name part
    assert target_matches(r".*\.experts\.\d+\.up_proj", "model.layers.1.mlp.experts.3.up_proj")
    assert not target_matches(r"up_proj", "model.layers.1.mlp.experts.3.up_proj")  # a regex matches in full
    cfg = tiny_config()
    names = {hf for t in adaptable_projections(cfg) for hf, _ in t.hf_modules}
    assert "model.layers.1.mlp.experts.3.gate_proj" in names and "model.layers.0.mlp.up_proj" in names
    lora = LoraConfig(enabled=True, target_modules=r"model\.layers\.1\.mlp\.shared_experts\..*")
    report = lora_report(MoETransformer(cfg, seed=0, lora=plan_adapters(cfg, lora), moe=DROPLESS))
    assert report.adapted == [f"layers.1.mlp.shared_experts.{p}.weight" for p in ("down_proj", "gate_proj", "up_proj")]


@pytest.mark.parametrize(
    "targets,message",
    [
        (["nonexistent"], "matches no projection"),
        (r".*\.experts\.0\.gate_proj", "only some experts"),
        ("(", "not a valid regular expression"),
    ],
)
def test_bad_targets_are_errors_naming_the_key(targets, message):
    with pytest.raises(ValueError, match=message) as raised:
        plan_adapters(tiny_config(), LoraConfig(enabled=True, target_modules=targets))
    assert "lora.target_modules" in str(raised.value)


def test_modules_to_save_are_trained_in_full():
    lora = LoraConfig(enabled=True, target_modules=["v_proj"], modules_to_save=["lm_head"])
    model = MoETransformer(tiny_config(), seed=0, lora=plan_adapters(tiny_config(), lora), moe=DROPLESS)
    assert {p.name for p in model.trainable_params()} == {
        "lm_head.weight",
        "layers.0.self_attn.v_proj.lora_A",
        "layers.0.self_attn.v_proj.lora_B",
        "layers.1.self_attn.v_proj.lora_A",
        "layers.1.self_attn.v_proj.lora_B",
    }
    with pytest.raises(ValueError, match="match no module"):
        plan_adapters(
            tiny_config(), LoraConfig(enabled=True, target_modules=["v_proj"], modules_to_save=["nothing_here"])
        )


def test_routed_experts_skip_the_weight_gradient_of_exactly_the_frozen_projections():
    """The grouped kernel without a weight gradient runs for a projection iff its weight does not train: the
    base of a LoRA build, not a modules_to_save projection, not a plain model's."""
    cfg = tiny_config()
    lora = LoraConfig(enabled=True, r=2, target_modules=["down_proj"], modules_to_save=["up_proj"])
    model = MoETransformer(cfg, seed=0, lora=plan_adapters(cfg, lora, seed=0), moe=DROPLESS)
    plain = MoETransformer(cfg, seed=0, moe=DROPLESS)
    checked = 0
    for (name, cell), (_, plain_cell) in zip(model.cells_and_names(), plain.cells_and_names()):
        if isinstance(cell, RoutedExperts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert getattr(cell, f"{proj}_frozen") == (not getattr(cell, proj).requires_grad), f"{name}.{proj}"
                assert not getattr(plain_cell, f"{proj}_frozen")
            assert (cell.gate_proj_frozen, cell.up_proj_frozen, cell.down_proj_frozen) == (True, False, True)
            checked += 1
    assert checked == cfg.num_layers - cfg.first_k_dense


def test_expert_update_isolation_scales_expert_adapters_not_the_frozen_weights():
    from mindmoe.train.routing import RouterStepUpdates

    cfg = tiny_config()
    moe = MoEConfig(dispatch="dropless", expert_lock=True, isolation_mode="expert_update")
    lora = LoraConfig(enabled=True, target_modules=["gate_proj", "down_proj"])
    model = MoETransformer(cfg, seed=0, lora=plan_adapters(cfg, lora), moe=moe)
    updates = RouterStepUpdates(model, cfg)
    assert [[p.name for p in layer] for layer in updates.expert_params] == [
        [
            "layers.1.mlp.experts.gate_proj.lora_A",
            "layers.1.mlp.experts.gate_proj.lora_B",
            "layers.1.mlp.experts.down_proj.lora_A",
            "layers.1.mlp.experts.down_proj.lora_B",
        ]
    ]


def test_a_lora_model_is_built_with_its_adapters_named_from_the_config():
    """Built once with the plan: every base parameter of ``parameter_shapes`` keeps its name and shape,
    each adapted weight ``<p>.weight`` / stacked ``<p>`` gains ``<p>.lora_A [.., R, F]`` and
    ``<p>.lora_B [.., O, R]`` (PEFT's layout), and nothing else trains."""
    cfg = tiny_config(qkv_bias=True)
    lora = LoraConfig(enabled=True, r=3, target_modules=["k_proj", "up_proj"])
    model = MoETransformer(cfg, seed=0, lora=plan_adapters(cfg, lora), moe=DROPLESS)
    expected = dict(parameter_shapes(cfg, include_buffers=True))
    for name, shape in parameter_shapes(cfg).items():
        if name.endswith(("k_proj.weight", "up_proj.weight", "experts.up_proj")):
            prefix = name.removesuffix(".weight")
            expected[prefix + ".lora_A"] = (*shape[:-2], 3, shape[-1])
            expected[prefix + ".lora_B"] = (*shape[:-1], 3)
    assert {p.name: tuple(p.shape) for p in model.get_parameters()} == expected
    assert {p.name for p in model.trainable_params()} == {n for n in expected if ".lora_" in n}
    experts = [c for _, c in model.cells_and_names() if isinstance(c, RoutedExperts)]
    assert experts and all(isinstance(c, LoraRoutedExperts) for c in experts)
