"""LoRA layers against PEFT 0.21.2 (torch, CPU) on the same weights: forward, initialisation, expert adapters,
dropout placement and gradient isolation of expert adapters. Whole-model behaviour is in ``test_lora_model.py``.

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

from mindmoe.model.lora.layers import AdapterSpec, LoraLinear
from mindmoe.model.moe.experts import RoutedExperts
from mindmoe.model.moe.lora_experts import LoraRoutedExperts

HIDDEN, WIDTH, EXPERTS, ROWS, RANK = 12, 10, 3, 5, 4


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


def lora_experts(projections, seed=0, row_scaled=False):
    rng = np.random.default_rng(seed)
    spec = AdapterSpec(RANK, 16.0 / RANK, 0.0, rng)
    layer = LoraRoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.2, rng, projections, spec, row_scaled=row_scaled)
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
    layer, adapters = lora_experts(("gate_proj", "up_proj", "down_proj"), seed=4, row_scaled=True)
    for param in (layer.gate_proj, layer.up_proj, layer.down_proj):
        param.requires_grad = False
    rng = np.random.default_rng(5)
    x = rng.normal(size=(EXPERTS, ROWS, HIDDEN)).astype(np.float32)
    probe = rng.normal(size=x.shape).astype(np.float32)
    scale = np.where(rng.random((EXPERTS, ROWS)) < 0.5, 0.3, 1.0).astype(np.float32)
    params = layer.trainable_params()
    assert len(params) == 6

    def loss_fn(x_ECH, scale_EC, probe_ECH):
        return (layer(x_ECH, None, scale_EC) * probe_ECH).sum()

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
