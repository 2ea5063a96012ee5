"""Multi-head latent attention (``model/mla.py``) beyond the logits of ``test_hf_deepseek_v3.py``: gradients
against torch autograd through transformers 4.57.1's ``DeepseekV3ForCausalLM`` (values narrower than the
keys exercise the attention kernel's backward), LoRA on every MLA projection against PEFT 0.21.2 and the
config checks (the serving graphs: ``tests/integration/test_export_mla.py``).
"""

import copy

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor
from peft import PeftModel
from safetensors.numpy import load_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

from mindmoe.model.config import validate_model_config
from mindmoe.model.hf import NameMap, load_hf_pretrained
from mindmoe.model.lora import LoraConfig
from mindmoe.model.lora.peft_adapter import ADAPTER_WEIGHTS, save_adapter
from mindmoe.model.lora.plan import lora_parameters
from mindmoe.model.param_count import parameter_shapes
from mindmoe.model.rope_scaling import RopeScalingConfig
from mindmoe.model.transformer import MoETransformer
from tests.helpers.hf_models import deepseek_v3_config, hf_logits, randomize_hf, save_hf, token_ids
from tests.helpers.mla_models import tiny_mla_config as mla_config

MLA_PROJECTIONS = ["q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_parameter_shapes_list_exactly_the_mla_models_parameters(q_lora_rank):
    cfg = mla_config(q_lora_rank=q_lora_rank)
    model = MoETransformer(cfg)
    assert {p.name: tuple(p.shape) for p in model.get_parameters()} == parameter_shapes(cfg, include_buffers=True)
    assert [p.name for p in model.get_parameters()] == list(parameter_shapes(cfg, include_buffers=True))
    names = NameMap("deepseek_v3")
    for name in parameter_shapes(cfg):  # every parameter has its HF name and back
        hf_name = names.to_hf(name, 1)[0][0]
        assert names.to_ours(hf_name)[0] == name


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(attention_type="mha"), "model.attention_type='mha': must be one of"),
        (dict(q_lora_rank=0), "model.q_lora_rank=0: must be a positive integer, or null"),
        (dict(kv_lora_rank=0), "model.kv_lora_rank=0: must be >= 1"),
        (dict(v_head_dim=0), "model.v_head_dim=0: must be >= 1"),
        (dict(qk_rope_head_dim=5), "model.qk_rope_head_dim=5: must be even"),
        (
            dict(attention_type="gqa", num_kv_heads=2, rope_scaling=RopeScalingConfig("yarn", 2.0, mscale_all_dim=1.0)),
            "model.rope_scaling=.*mscale_all_dim scales MLA's softmax",
        ),
    ],
)
def test_mla_config_errors_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_model_config(mla_config(**overrides))


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory):
    """A one-layer dense DeepSeek-V3 (no routing: gradients compare without top-k ties) and its import."""
    torch.manual_seed(0)
    config = deepseek_v3_config(num_hidden_layers=1, first_k_dense_replace=1, attn_implementation="eager")
    hf = randomize_hf(DeepseekV3ForCausalLM(config), seed=5)
    _, ours, _ = load_hf_pretrained(save_hf(hf, tmp_path_factory.mktemp("dense")))
    return hf, ours


def test_mla_gradients_match_torch_autograd(dense_pair):
    hf, ours = dense_pair
    ids = token_ids(12, seed=1)
    probe = np.random.default_rng(2).normal(size=(2, 12, hf.config.vocab_size)).astype(np.float32)

    hf.zero_grad()
    logits = hf(input_ids=torch.from_numpy(ids.astype(np.int64))).logits
    (logits * torch.from_numpy(probe)).sum().backward()
    expected = {name: p.grad.numpy() for name, p in hf.named_parameters()}

    weights = ours.trainable_params()

    @ms.jit
    def probed(ids_BS, doc_ids_BS, probe_BSV):
        return (ours(ids_BS, doc_ids_BS)[0] * probe_BSV).sum()

    grad_fn = ms.value_and_grad(probed, None, weights)
    _, grads = grad_fn(Tensor(ids), Tensor(np.zeros_like(ids)), Tensor(probe))
    names = NameMap("deepseek_v3")
    checked = 0
    for param, grad in zip(weights, grads):
        hf_name = names.to_hf(param.name)[0][0]
        scale = np.abs(expected[hf_name]).max()
        np.testing.assert_allclose(
            grad.asnumpy(), expected[hf_name], atol=1e-4 * max(scale, 1.0), rtol=0, err_msg=hf_name
        )
        checked += ".self_attn." in param.name
    assert checked == 7  # q_a, q_a_layernorm, q_b, kv_a, kv_a_layernorm, kv_b, o


def test_lora_on_every_mla_projection_matches_peft(dense_pair, tmp_path):
    hf, _ = dense_pair
    hf_dir = save_hf(hf, tmp_path / "hf")
    lora = LoraConfig(enabled=True, r=2, alpha=4.0, target_modules=MLA_PROJECTIONS, base_dtype="fp32")
    _, ours, _ = load_hf_pretrained(hf_dir, lora=lora)
    adapted = {name.split(".")[-2] for name in ours.adapter_plan.adapted}
    assert adapted == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    rng = np.random.default_rng(3)
    for param in lora_parameters(ours).values():  # B = 0 at init would make every adapter invisible
        param.set_data(Tensor(rng.normal(0.0, 0.3, size=param.shape).astype(np.float32)))
    adapter_dir = save_adapter(ours, tmp_path / "adapter", lora, "deepseek_v3")

    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), adapter_dir, is_trainable=False).eval()
    peft_keys = {k for k in peft_model.state_dict() if "lora_" in k}
    expected_keys = {k.replace(".weight", ".default.weight") for k in load_file(str(adapter_dir / ADAPTER_WEIGHTS))}
    assert peft_keys == expected_keys
    ids = token_ids(12, seed=4)
    expected = hf_logits(peft_model, ids)
    assert np.abs(expected - hf_logits(hf, ids)).max() > 1e-2  # the adapters matter
    got = ours(Tensor(ids), Tensor(np.zeros_like(ids)))[0].asnumpy()
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
