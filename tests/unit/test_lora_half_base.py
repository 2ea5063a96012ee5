"""``lora.base_dtype``: a half-precision frozen base under fp32 adapters.

References are float64 NumPy built from the rounded half weights; the rounding itself is checked against
NumPy (fp16) and torch (bf16).
"""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor
from safetensors.numpy import load_file, save_file

from mindmoe.model.linear import numpy_of
from mindmoe.model.lora import LoraConfig, resolve_base_dtype, validate_lora_config
from mindmoe.model.lora.layers import STORAGE_DTYPES, AdapterSpec, LoraLinear
from mindmoe.model.lora.peft_adapter import ADAPTER_WEIGHTS, save_adapter
from mindmoe.model.lora.plan import lora_parameters, merge_and_unload, plan_adapters
from mindmoe.model.moe.lora_experts import LoraRoutedExperts
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.checkpoints.checkpoint import load_parameters, parameters_to_numpy

from .test_lora_model import tiny_config

HIDDEN, WIDTH, RANK, EXPERTS, ROWS = 12, 10, 3, 3, 5
HALF = ["fp16", "bf16"]


def jit_grad(fn, grad_position, params):
    grad_fn = ms.value_and_grad(fn, grad_position, params)

    @ms.jit
    def step(*inputs):
        return grad_fn(*inputs)

    return step


def rounded(values_f32: np.ndarray, dtype: str) -> np.ndarray:
    """Independent rounding to ``dtype`` (round to nearest even), as float64."""
    if dtype == "fp16":
        return values_f32.astype(np.float16).astype(np.float64)
    return torch.from_numpy(values_f32).to(torch.bfloat16).to(torch.float64).numpy()


def test_bad_values_are_refused_naming_the_key_and_auto_resolves_per_device():
    with pytest.raises(ValueError, match=r"lora.base_dtype='fp8' must be one of auto, fp32, fp16, bf16"):
        validate_lora_config(LoraConfig(base_dtype="fp8"))
    with pytest.raises(ValueError, match="lora.base_dtype"):
        plan_adapters(tiny_config(), LoraConfig(enabled=True, base_dtype="float16"))
    assert resolve_base_dtype("auto", "Ascend") == "bf16"
    assert resolve_base_dtype("auto", "CPU") == "fp16"
    assert resolve_base_dtype("bf16", "CPU") == "bf16"
    assert plan_adapters(tiny_config(), LoraConfig(enabled=True), device_target="Ascend").base_dtype == "bf16"


@pytest.mark.parametrize("dtype", HALF)
def test_lora_linear_on_a_half_base_matches_float64_and_adapter_gradients_are_exact(dtype):
    rng = np.random.default_rng(0)
    draw = np.random.default_rng(1).normal(0.0, 0.5, size=(WIDTH, HIDDEN)).astype(np.float32)
    spec = AdapterSpec(RANK, 2.0, 0.0, rng)
    layer = LoraLinear(HIDDEN, WIDTH, True, 0.5, np.random.default_rng(1), spec, dtype=STORAGE_DTYPES[dtype])
    layer.weight.requires_grad = False
    layer.bias.requires_grad = False
    assert layer.weight.dtype == STORAGE_DTYPES[dtype] and layer.lora_A.dtype == ms.float32
    w = rounded(draw, dtype)
    np.testing.assert_array_equal(numpy_of(layer.weight).astype(np.float64), w)  # stored = rounded draw
    layer.lora_B.set_data(Tensor(rng.normal(size=(WIDTH, RANK)).astype(np.float32)))
    a, b = (p.asnumpy().astype(np.float64) for p in (layer.lora_A, layer.lora_B))
    x = rng.normal(size=(2, 4, HIDDEN)).astype(np.float32)
    probe = rng.normal(size=(2, 4, WIDTH)).astype(np.float32)

    def probed(x_ZF, probe_ZO):
        return (layer(x_ZF) * probe_ZO).sum()

    loss, (dx, (d_a, d_b)) = jit_grad(probed, 0, layer.trainable_params())(Tensor(x), Tensor(probe))

    x64, p64 = x.reshape(-1, HIDDEN).astype(np.float64), probe.reshape(-1, WIDTH).astype(np.float64)
    y64 = x64 @ w.T + 2.0 * (x64 @ a.T) @ b.T
    np.testing.assert_allclose(float(loss.asnumpy()), (y64 * p64).sum(), rtol=1e-5)
    np.testing.assert_allclose(dx.asnumpy().reshape(-1, HIDDEN), p64 @ w + 2.0 * (p64 @ b) @ a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_a.asnumpy(), 2.0 * (p64 @ b).T @ x64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_b.asnumpy(), 2.0 * p64.T @ (x64 @ a.T), rtol=1e-5, atol=1e-5)
    assert np.abs(w - draw).max() > 1e-5, "the base must really be rounded"


def test_expert_adapters_on_a_bf16_base_match_float64():
    rng = np.random.default_rng(2)
    dtypes = {p: ms.bfloat16 for p in ("gate_proj", "up_proj", "down_proj")}
    layer = LoraRoutedExperts(
        EXPERTS, HIDDEN, WIDTH, 0.3, rng, ("gate_proj", "down_proj"), AdapterSpec(RANK, 2.0, 0.0, rng), dtypes=dtypes
    )
    for param in (layer.gate_proj, layer.up_proj, layer.down_proj):
        assert param.dtype == ms.bfloat16
        param.requires_grad = False
    for factors in (layer.gate_proj_lora, layer.down_proj_lora):
        factors[1].set_data(Tensor(rng.normal(0, 0.3, size=factors[1].shape).astype(np.float32)))
    x = rng.normal(size=(EXPERTS, ROWS, HIDDEN)).astype(np.float32)
    params = layer.trainable_params()

    def total(x_ECH):
        return layer(x_ECH).sum()

    loss, grads = jit_grad(total, None, params)(Tensor(x))

    weights = {n: torch.from_numpy(numpy_of(getattr(layer, n)).astype(np.float64)) for n in dtypes}
    factors = {
        p.name: torch.from_numpy(p.asnumpy().astype(np.float64)).requires_grad_(True) for p in params
    }  # gate_proj.lora_A, ...

    def proj(h, name):
        y = torch.bmm(h, weights[name].transpose(1, 2))
        if f"{name}.lora_A" in factors:
            low = torch.bmm(h, factors[f"{name}.lora_A"].transpose(1, 2))
            y = y + 2.0 * torch.bmm(low, factors[f"{name}.lora_B"].transpose(1, 2))
        return y

    x64 = torch.from_numpy(x.astype(np.float64))
    hidden = torch.nn.functional.silu(proj(x64, "gate_proj")) * proj(x64, "up_proj")
    expected = proj(hidden, "down_proj").sum()
    expected_grads = torch.autograd.grad(expected, list(factors.values()))
    np.testing.assert_allclose(float(loss.asnumpy()), expected.item(), rtol=1e-5)
    for param, grad, ref in zip(params, grads, expected_grads):
        np.testing.assert_allclose(grad.asnumpy(), ref.numpy(), rtol=1e-4, atol=1e-5, err_msg=param.name)


def half_model(dtype, **lora_fields):
    cfg = tiny_config()
    lora = LoraConfig(enabled=True, r=2, alpha=4.0, base_dtype=dtype, **lora_fields)
    return MoETransformer(cfg, seed=3, lora=plan_adapters(cfg, lora, seed=1))


def test_only_the_frozen_base_weights_are_half_and_checkpoints_restore_them_exactly(tmp_path):
    model = half_model("bf16", target_modules=["q_proj", "gate_proj"], modules_to_save=["lm_head"])
    half = {p.name for p in model.get_parameters() if p.dtype == ms.bfloat16}
    fp32 = {p.name for p in model.get_parameters() if p.dtype == ms.float32}
    assert half | fp32 == {p.name for p in model.get_parameters()}
    assert all(p.dtype == ms.float32 for p in model.trainable_params())
    assert "lm_head.weight" in fp32 and "embed_tokens.weight" in half
    assert {"layers.1.mlp.experts.down_proj", "layers.1.mlp.shared_experts.up_proj.weight"} <= half
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.self_attn.o_proj.weight"} <= half
    # fp32: norms, the router, biases (all small), the adapters and the modules_to_save.
    small_or_trained = (".bias", ".lora_A", ".lora_B", "lm_head.weight")
    assert all(("norm" in n or "router" in n or n.endswith(small_or_trained)) for n in fp32)

    arrays = parameters_to_numpy(model.get_parameters())
    save_file(arrays, str(tmp_path / "model.safetensors"))
    again = half_model("bf16", target_modules=["q_proj", "gate_proj"], modules_to_save=["lm_head"])
    load_parameters(again.get_parameters(), load_file(str(tmp_path / "model.safetensors")), "checkpoint")
    for before, after in zip(model.get_parameters(), again.get_parameters()):
        assert after.dtype == before.dtype
        np.testing.assert_array_equal(numpy_of(after), numpy_of(before), err_msg=before.name)


def test_merge_of_a_half_base_is_the_rounded_base_plus_the_fp32_delta_and_the_adapter_file_is_fp32(tmp_path):
    model = half_model("fp16")
    rng = np.random.default_rng(4)
    for param in lora_parameters(model).values():
        param.set_data(Tensor(rng.normal(0, 0.3, size=param.shape).astype(np.float32)))
    merged = {p.name: p.asnumpy() for p in merge_and_unload(model).get_parameters()}
    params = {p.name: p for p in model.get_parameters()}
    name = "layers.1.mlp.experts.up_proj"
    a, b = (params[f"{name}.lora_A"].asnumpy().astype(np.float64), params[f"{name}.lora_B"].asnumpy())
    expected = params[name].asnumpy().astype(np.float64) + 2.0 * np.matmul(b.astype(np.float64), a)
    assert merged[name].dtype == np.float32
    np.testing.assert_allclose(merged[name], expected, rtol=1e-6, atol=1e-6)

    save_adapter(model, tmp_path / "adapter", model.adapter_plan.config)
    tensors = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    assert tensors and all(t.dtype == np.float32 for t in tensors.values())
    fp32_model = half_model("fp32")
    save_adapter(fp32_model, tmp_path / "fp32", fp32_model.adapter_plan.config)
    reference = load_file(str(tmp_path / "fp32" / ADAPTER_WEIGHTS))
    assert {k: v.shape for k, v in tensors.items()} == {k: v.shape for k, v in reference.items()}


def test_a_half_base_model_trains_like_an_fp32_model_holding_the_rounded_weights():
    """The whole graph (embedding gather, dropless grouped experts, head) on a bf16 base: the loss and
    adapter gradients of an fp32-base model given the same rounded weights (fp32 compute in both)."""
    half = half_model("bf16")
    full = half_model("fp32")
    for target, source in zip(full.get_parameters(), half.get_parameters()):
        target.set_data(Tensor(numpy_of(source), dtype=ms.float32))
    ids = np.random.default_rng(0).integers(0, 48, size=(2, 8)).astype(np.int32)

    def loss_and_grads(model):
        def spread(input_ids, doc_ids):
            return model(input_ids, doc_ids)[OUT_HEAD].std()

        loss, grads = jit_grad(spread, None, model.trainable_params())(Tensor(ids), Tensor(np.zeros_like(ids)))
        return float(loss.asnumpy()), [g.asnumpy() for g in grads]

    (loss_h, grads_h), (loss_f, grads_f) = loss_and_grads(half), loss_and_grads(full)
    np.testing.assert_allclose(loss_h, loss_f, rtol=1e-5)
    for param, g_h, g_f in zip(half.trainable_params(), grads_h, grads_f):
        np.testing.assert_allclose(g_h, g_f, rtol=1e-4, atol=1e-6, err_msg=param.name)
    assert max(np.abs(g).max() for g in grads_h) > 1e-4


@pytest.mark.parametrize("hf_dtype", [torch.bfloat16, torch.float32])
def test_hf_import_fills_a_half_base_in_its_own_dtype_with_the_rounded_hf_weights(tmp_path, hf_dtype):
    from transformers import Glm4MoeForCausalLM

    from mindmoe.model.hf import load_hf_pretrained
    from tests.helpers.hf_models import glm4_config, randomize_hf, save_hf

    torch.manual_seed(0)
    hf = randomize_hf(Glm4MoeForCausalLM(glm4_config(num_hidden_layers=2)), seed=5).to(hf_dtype)
    directory = save_hf(hf, tmp_path / "hf")
    lora = LoraConfig(enabled=True, r=2, target_modules=["q_proj", "gate_proj"], base_dtype="bf16")
    _, model, _ = load_hf_pretrained(directory, lora=lora)
    params = {p.name: p for p in model.get_parameters()}
    state = hf.state_dict()
    for ours, theirs in [
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("layers.1.mlp.shared_experts.down_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight"),
    ]:
        assert params[ours].dtype == ms.bfloat16, ours
        expected = rounded(state[theirs].float().numpy(), "bf16")
        np.testing.assert_array_equal(numpy_of(params[ours]).astype(np.float64), expected, err_msg=ours)
    row = rounded(state["model.layers.1.mlp.experts.3.up_proj.weight"].float().numpy(), "bf16")
    assert params["layers.1.mlp.experts.up_proj"].dtype == ms.bfloat16
    np.testing.assert_array_equal(numpy_of(params["layers.1.mlp.experts.up_proj"])[3].astype(np.float64), row)
    assert params["layers.0.self_attn.q_proj.lora_A"].dtype == ms.float32


def test_a_bf16_base_is_refused_for_training_on_cpu_naming_the_key_and_what_works():
    from mindmoe.conf.checks import validate_run_config
    from tests.helpers.runs import compose_config

    cfg = compose_config(["lora.enabled=true", "lora.base_dtype=bf16"])
    with pytest.raises(ValueError, match=r"lora.base_dtype=bf16: the CPU backend .* lora.base_dtype=auto \(fp16 on"):
        validate_run_config(cfg, "CPU")
    validate_run_config(cfg, "Ascend")
    validate_run_config(compose_config(["lora.enabled=true", "lora.base_dtype=fp16"]), "CPU")
