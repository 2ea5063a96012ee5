"""LoRA layers against PEFT 0.21.2 (torch, CPU) on the same weights, target selection, merging,
dropout placement and gradient isolation of expert adapters.

PEFT's reference layers: ``peft.inject_adapter_in_model`` on a torch ``nn.Linear`` and on HF
``Glm4MoeMLP`` experts (the modules PEFT adapts per expert on a transformers 4.57 glm4_moe).
"""

import math

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor, nn
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMLP

from mindmoe.model.config import ModelConfig
from mindmoe.model.lora import LoraConfig, target_matches
from mindmoe.model.lora_layers import AdapterSpec, LoraLinear
from mindmoe.model.lora_plan import (
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

HIDDEN, WIDTH, EXPERTS, ROWS, RANK = 12, 10, 3, 5, 4
DROPLESS = MoEConfig(dispatch="dropless")  # the whole-model tests' policy: no token dropped, logits compare exactly


def peft_linear(weight, bias, lora_A, lora_B, alpha, rslora, dropout=0.0):
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        holder.proj.weight.copy_(torch.from_numpy(weight))
        if bias is not None:
            holder.proj.bias.copy_(torch.from_numpy(bias))
    inject_adapter_in_model(
        PeftLoraConfig(
            r=lora_A.shape[0], lora_alpha=alpha, use_rslora=rslora, lora_dropout=dropout, target_modules=["proj"]
        ),
        holder,
    )
    with torch.no_grad():
        holder.proj.lora_A["default"].weight.copy_(torch.from_numpy(lora_A))
        holder.proj.lora_B["default"].weight.copy_(torch.from_numpy(lora_B))
    return holder.eval()


def run_cell(cell, *arrays):
    @ms.jit
    def forward(*inputs):
        return cell(*inputs)

    return forward(*[Tensor(a) for a in arrays]).asnumpy()


@pytest.mark.parametrize("rslora,bias", [(False, True), (True, False)])
def test_lora_linear_forward_equals_peft(rslora, bias):
    rng = np.random.default_rng(0)
    alpha = 8.0
    scaling = alpha / (math.sqrt(RANK) if rslora else RANK)
    layer = base = LoraLinear(HIDDEN, WIDTH, bias, 0.5, rng, AdapterSpec(RANK, scaling, 0.0, rng))
    if bias:
        base.bias.set_data(Tensor(rng.normal(size=WIDTH).astype(np.float32)))
    layer.lora_B.set_data(Tensor(rng.normal(size=(WIDTH, RANK)).astype(np.float32)))
    x = rng.normal(size=(2, 7, HIDDEN)).astype(np.float32)
    reference = peft_linear(
        base.weight.asnumpy(),
        base.bias.asnumpy() if bias else None,
        layer.lora_A.asnumpy(),
        layer.lora_B.asnumpy(),
        alpha,
        rslora,
    )
    with torch.no_grad():
        expected = reference.proj(torch.from_numpy(x)).numpy()
        base_only = torch.nn.functional.linear(torch.from_numpy(x), reference.proj.base_layer.weight).numpy()
    assert np.abs(expected - base_only).max() > 0.1, "the adapter must change the output"
    np.testing.assert_allclose(run_cell(layer, x), expected, atol=1e-5, rtol=0)


def test_init_follows_peft_a_uniform_in_one_over_sqrt_in_b_zero():
    in_features = 400
    layer = LoraLinear(
        in_features, 64, False, 0.02, np.random.default_rng(0), AdapterSpec(16, 2.0, 0.0, np.random.default_rng(1))
    )
    holder = peft_linear(
        np.zeros((64, in_features), np.float32),
        None,
        np.zeros((16, in_features), np.float32),
        np.zeros((64, 16), np.float32),
        16,
        False,
    )
    # PEFT's own initialisation, which the copies above overwrote.
    holder.proj.reset_lora_parameters("default", True)
    peft_A = holder.proj.lora_A["default"].weight.detach().numpy()
    ours = layer.lora_A.asnumpy()
    bound = 1.0 / math.sqrt(in_features)
    for values in (peft_A, ours):
        assert np.abs(values).max() <= bound and np.abs(values).max() > 0.99 * bound
        assert abs(values.std() - bound / math.sqrt(3)) < 0.02 * bound  # uniform, not normal
    assert not layer.lora_B.asnumpy().any()
    assert not holder.proj.lora_B["default"].weight.detach().numpy().any()


def peft_experts(experts: RoutedExperts, adapters: dict, alpha: float):
    """HF Glm4MoeMLP experts holding our stacked weights, adapted by PEFT with our factors."""
    config = Glm4MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, hidden_act="silu")
    holder = torch.nn.Module()
    holder.experts = torch.nn.ModuleList(Glm4MoeMLP(config, intermediate_size=WIDTH) for _ in range(EXPERTS))
    inject_adapter_in_model(PeftLoraConfig(r=RANK, lora_alpha=alpha, target_modules=list(adapters)), holder)
    with torch.no_grad():
        for e, expert in enumerate(holder.experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                module = getattr(expert, proj)
                base = module.base_layer if proj in adapters else module
                base.weight.copy_(torch.from_numpy(getattr(experts, proj).asnumpy()[e]))
                if proj in adapters:
                    module.lora_A["default"].weight.copy_(torch.from_numpy(adapters[proj][0][e]))
                    module.lora_B["default"].weight.copy_(torch.from_numpy(adapters[proj][1][e]))
    return holder.eval()


def lora_experts(projections, seed=0):
    rng = np.random.default_rng(seed)
    layer = LoraRoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.2, rng, projections, AdapterSpec(RANK, 16.0 / RANK, 0.0, rng))
    adapters = {}
    for proj in layer.projections:
        lora_A, lora_B = getattr(layer, f"{proj}_lora")
        lora_B.set_data(Tensor(rng.normal(0, 0.1, size=lora_B.shape).astype(np.float32)))
        adapters[proj] = (lora_A.asnumpy(), lora_B.asnumpy())
    return layer, adapters


@pytest.mark.parametrize("projections", [("gate_proj", "up_proj", "down_proj"), ("down_proj",)])
def test_expert_adapters_equal_peft_on_each_hf_expert(projections):
    layer, adapters = lora_experts(projections)
    reference = peft_experts(layer, adapters, 16.0)
    x = np.random.default_rng(3).normal(size=(EXPERTS, ROWS, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        expected = np.stack([reference.experts[e](torch.from_numpy(x[e])).numpy() for e in range(EXPERTS)])
    ours = run_cell(layer, x)
    assert np.abs(expected).max() > 0.5
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
    plain = RoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.2, np.random.default_rng(0))  # same base weights
    assert np.abs(run_cell(plain, x) - expected).max() > 0.05, "the adapters must change the output"


def test_expert_adapter_gradients_follow_token_grad_isolation():
    """Rows are independent, so the isolated gradient of every factor is the torch gradient of
    ``sum_ec scale_ec * <out_ec, probe_ec>``, while the input gradient is that of the plain loss."""
    layer, adapters = lora_experts(("gate_proj", "up_proj", "down_proj"), seed=4)
    for param in (layer.gate_proj, layer.up_proj, layer.down_proj):
        param.requires_grad = False
    rng = np.random.default_rng(5)
    x = rng.normal(size=(EXPERTS, ROWS, HIDDEN)).astype(np.float32)
    probe = rng.normal(size=x.shape).astype(np.float32)
    scale = np.where(rng.random((EXPERTS, ROWS)) < 0.5, 0.3, 1.0).astype(np.float32)
    params = layer.trainable_params()
    assert len(params) == 6

    def loss_fn(x_ECH, scale_EC, probe_ECH):
        return (layer.with_weight_grad_scale(x_ECH, scale_EC) * probe_ECH).sum()

    grad_fn = ms.value_and_grad(loss_fn, 0, params)

    @ms.jit
    def grads(x_ECH, scale_EC, probe_ECH):
        return grad_fn(x_ECH, scale_EC, probe_ECH)

    _, (dx, dparams) = grads(Tensor(x), Tensor(scale), Tensor(probe))

    reference = peft_experts(layer, adapters, 16.0)
    x_t = torch.from_numpy(x).requires_grad_(True)
    outputs = torch.stack([reference.experts[e](x_t[e]) for e in range(EXPERTS)])
    per_row = (outputs * torch.from_numpy(probe)).sum(-1)
    factors = {
        (proj, kind): [getattr(getattr(reference.experts[e], proj), kind)["default"].weight for e in range(EXPERTS)]
        for proj in adapters
        for kind in ("lora_A", "lora_B")
    }
    flat = [w for ws in factors.values() for w in ws]
    isolated = torch.autograd.grad((per_row * torch.from_numpy(scale)).sum(), flat, retain_graph=True)
    (plain_dx,) = torch.autograd.grad(per_row.sum(), [x_t])
    expected = {}
    for i, key in enumerate(factors):
        expected[f"{key[0]}.{key[1]}"] = np.stack([g.numpy() for g in isolated[i * EXPERTS : (i + 1) * EXPERTS]])
    for param, grad in zip(params, dparams):
        np.testing.assert_allclose(grad.asnumpy(), expected[param.name], rtol=1e-4, atol=1e-5, err_msg=param.name)
    np.testing.assert_allclose(dx.asnumpy(), plain_dx.numpy(), rtol=1e-4, atol=1e-5)
    assert np.abs(plain_dx.numpy()).max() > 1e-2


def test_dropout_acts_on_the_lora_branch_only_and_only_in_training():
    rng = np.random.default_rng(6)
    layer = LoraLinear(HIDDEN, WIDTH, True, 0.5, rng, AdapterSpec(RANK, 2.0, 0.5, rng))
    x = rng.normal(size=(4, 9, HIDDEN)).astype(np.float32)
    base = x @ layer.weight.asnumpy().T + layer.bias.asnumpy()
    layer.set_train(True)
    # B = 0: whatever dropout draws, the output is exactly the base output.
    np.testing.assert_allclose(run_cell(layer, x), base, atol=1e-5, rtol=0)
    layer.lora_B.set_data(Tensor(rng.normal(size=(WIDTH, RANK)).astype(np.float32)))

    class Wrapped(nn.Cell):  # a fresh cell so the new B is compiled into new graphs
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def construct(self, x_BSH):
            return self.inner(x_BSH)

    train_out = run_cell(Wrapped(layer), x)
    layer.set_train(False)
    eval_out = run_cell(Wrapped(layer), x)
    no_dropout = base + 2.0 * (x @ layer.lora_A.asnumpy().T) @ layer.lora_B.asnumpy().T
    np.testing.assert_allclose(eval_out, no_dropout, atol=1e-4, rtol=0)
    assert np.abs(train_out - eval_out).max() > 0.1, "dropout must act while training"


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
