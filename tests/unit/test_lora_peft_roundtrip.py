"""LoRA on a HF-imported glm4_moe, end to end against PEFT 0.21.2 + transformers 4.57.1.

A tiny random HF model is saved with ``save_pretrained`` and imported; adapters on every projection
(attention, the dense MLP, shared and routed experts) are trained for a few AdamW steps with expert
locking and ``expert_update`` isolation on; then

- every base tensor is bit-identical to what was loaded, every adapter moved;
- the adapter directory has exactly the tensors PEFT creates for the same ``target_modules`` on the
  HF model, and ``PeftModel.from_pretrained`` loads it (values checked);
- PEFT's logits equal those of mindmoe's merged model (``merge_adapters`` on a fresh import) to 1e-4.
"""

import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.numpy import load_file
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM

from mindmoe.model.hf import load_hf_pretrained
from mindmoe.model.lora import LoraConfig, is_adapter
from mindmoe.model.lora.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError, merge_adapters, save_adapter
from mindmoe.model.lora.plan import lora_parameters, lora_report
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD
from tests.helpers.hf_models import glm4_config, hf_logits, randomize_hf, save_hf, token_ids

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from mindmoe.train.config import TrainConfig
    from mindmoe.train.optim import build_optimizer
    from mindmoe.train.routing import RouterStepUpdates
    from mindmoe.train.step import CompiledStep

    hf_dir = save_hf(
        randomize_hf(Glm4MoeForCausalLM(glm4_config(n_routed_experts=4, num_hidden_layers=2)), seed=11),
        tmp_path_factory.mktemp("hf"),
    )
    lora = LoraConfig(enabled=True, r=4, alpha=8.0, dropout=0.1, target_modules=TARGETS)
    cfg, model, _ = load_hf_pretrained(
        hf_dir,
        lora=lora,
        moe=MoEConfig(expert_lock=True, lock_run_length=2, lock_span=4, isolation_mode="expert_update"),
    )
    base = {p.name: p.asnumpy().copy() for p in model.get_parameters() if not is_adapter(p.name)}
    report = lora_report(model)
    optimizer = build_optimizer(
        model.trainable_params(), TrainConfig(lr=2e-2, warmup_ratio=0.0, max_steps=STEPS, weight_decay=0.0)
    )
    trainer = CompiledStep(model, optimizer, 1.0, 1, RouterStepUpdates(model, cfg))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(STEPS):
        window = {
            "input_ids": rng.integers(0, cfg.vocab_size, size=(2, 13)).astype(np.int32),
            "doc_ids": np.zeros((2, 13), np.int32),
        }
        stats = trainer.step([window])
        losses.append((stats.lm_loss, float(stats.layer_stats[:, 1].mean())))
    adapter_dir = save_adapter(model, tmp_path_factory.mktemp("adapter"), lora, "glm4_moe", str(hf_dir))
    return hf_dir, model, base, report, adapter_dir, losses


def test_training_moves_only_the_adapters(trained):
    _, model, base, report, _, losses = trained
    current = {p.name: p.asnumpy() for p in model.get_parameters()}
    for name, before in base.items():
        assert np.array_equal(current[name], before), f"{name}: a base weight changed"
    adapters = lora_parameters(model)
    assert {p.name for p in model.trainable_params()} == set(adapters)
    assert report.trainable == sum(p.size for p in adapters.values())
    for name, param in adapters.items():
        if name.endswith(".lora_B"):
            assert np.abs(param.asnumpy()).max() > 0, f"{name} did not train"
    assert all(np.isfinite(loss) for loss, _ in losses)
    assert max(lock_rate for _, lock_rate in losses) > 0, "locking (and so expert_update isolation) must act"


def test_adapter_files_hold_what_peft_creates_for_the_same_targets(trained):
    hf_dir, _, _, _, adapter_dir, _ = trained
    ours = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    hf = Glm4MoeForCausalLM.from_pretrained(hf_dir)
    peft = get_peft_model(hf, PeftLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM"))
    expected = {name.replace(".default", ""): tuple(p.shape) for name, p in peft.named_parameters() if "lora_" in name}
    assert {name: tuple(t.shape) for name, t in ours.items()} == expected
    assert any(".mlp.experts.3.down_proj.lora_B" in name for name in ours)
    assert any(".mlp.shared_experts.gate_proj.lora_A" in name for name in ours)
    assert any("layers.0.mlp.up_proj.lora_A" in name for name in ours)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == ("LORA", 4, 8.0, False)
    assert config["base_model_name_or_path"] == str(hf_dir) and config["task_type"] == "CAUSAL_LM"


def test_peft_loads_the_adapters_and_matches_the_merged_model(trained):
    hf_dir, _, _, _, adapter_dir, _ = trained
    stored = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    peft = PeftModel.from_pretrained(Glm4MoeForCausalLM.from_pretrained(hf_dir), str(adapter_dir)).eval()
    loaded = {
        name.replace(".default", ""): p.detach().numpy() for name, p in peft.named_parameters() if "lora_" in name
    }
    assert set(loaded) == set(stored)
    for name, value in stored.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)

    _, merged, _ = load_hf_pretrained(hf_dir)
    merge_adapters(merged, adapter_dir)
    ids = token_ids(12, seed=3)
    base_logits = hf_logits(Glm4MoeForCausalLM.from_pretrained(hf_dir).eval(), ids)
    expected = hf_logits(peft, ids)
    assert np.abs(expected - base_logits).max() > 1e-2, "the trained adapters must change the logits"

    @ms.jit
    def forward(input_ids, doc_ids):
        return merged(input_ids, doc_ids)[OUT_HEAD]

    ours = forward(Tensor(ids), Tensor(np.zeros_like(ids))).asnumpy()
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_adapters_for_another_model_are_rejected(trained, tmp_path):
    hf_dir, _, _, _, adapter_dir, _ = trained
    _, model, _ = load_hf_pretrained(hf_dir, lora=LoraConfig(enabled=True, r=4, alpha=8.0, target_modules=["q_proj"]))
    from mindmoe.model.lora.peft_adapter import load_adapter

    with pytest.raises(AdapterError, match=r"unexpected base_model\.model\.model\.layers\.0\.mlp"):
        load_adapter(model, adapter_dir)


def test_modules_to_save_round_trip_through_peft(trained, tmp_path):
    hf_dir = trained[0]
    lora = LoraConfig(
        enabled=True,
        r=2,
        alpha=4.0,
        rslora=True,
        target_modules=r".*\.self_attn\.(q|v)_proj",
        modules_to_save=["lm_head"],
    )
    _, model, _ = load_hf_pretrained(hf_dir, lora=lora, lora_seed=1)
    rng = np.random.default_rng(8)
    for param in model.trainable_params():  # stand-ins for trained values
        param.set_data(Tensor((param.asnumpy() + rng.normal(0, 0.3, size=param.shape)).astype(np.float32)))
    save_adapter(model, tmp_path, lora, "glm4_moe", str(hf_dir))
    assert "base_model.model.lm_head.weight" in load_file(str(tmp_path / ADAPTER_WEIGHTS))
    peft = PeftModel.from_pretrained(Glm4MoeForCausalLM.from_pretrained(hf_dir), str(tmp_path)).eval()
    _, merged, _ = load_hf_pretrained(hf_dir)
    merge_adapters(merged, tmp_path)

    @ms.jit
    def forward(input_ids, doc_ids):
        return merged(input_ids, doc_ids)[OUT_HEAD]

    ids = token_ids(9, seed=5)
    np.testing.assert_allclose(
        forward(Tensor(ids), Tensor(np.zeros_like(ids))).asnumpy(), hf_logits(peft, ids), atol=1e-4, rtol=0
    )
