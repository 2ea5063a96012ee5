"""``mindmoe-export export.adapter=...``: a PEFT adapter merged into the bundled HF base before export
gives, in transformers, the logits of ``PeftModel`` on the original base (fp32, <= 1e-4)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from mindspore import Tensor
from peft import PeftModel
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM

from mindmoe.model.hf import load_hf_pretrained
from mindmoe.model.lora import LoraConfig
from mindmoe.model.lora.peft_adapter import save_adapter
from mindmoe.model.moe_config import MoEConfig
from tests.helpers.runs import compose_config

BASE = Path(__file__).resolve().parents[2] / "data" / "samples" / "tiny_base"
DROPLESS = MoEConfig(dispatch="dropless")


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """An adapter on every projection, routed experts included, with non-zero stand-in values."""
    lora = LoraConfig(enabled=True, r=4, alpha=8.0)
    _, model, _ = load_hf_pretrained(BASE, lora=lora, lora_seed=0)
    rng = np.random.default_rng(1)
    for param in model.trainable_params():
        param.set_data(Tensor(rng.normal(0, 0.05, size=param.shape).astype(np.float32)))
    return save_adapter(model, tmp_path_factory.mktemp("adapter"), lora, "glm4_moe", str(BASE))


def test_hf_export_with_adapter_equals_peft_on_the_base(adapter_dir, tmp_path):
    from mindmoe.train.export.exporter import run_export

    overrides = [
        f"model.pretrained={BASE}",
        "export.format=hf",
        f"export.out={tmp_path / 'out'}",
        f"export.adapter={adapter_dir}",
    ]
    out = run_export(compose_config(overrides), tmp_path, overrides)
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 4096, size=(2, 24)))
    peft = PeftModel.from_pretrained(
        Glm4MoeForCausalLM.from_pretrained(BASE, dtype=torch.float32), str(adapter_dir)
    ).eval()
    exported = Glm4MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = Glm4MoeForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, ours, plain = (m(input_ids=ids).logits.numpy() for m in (peft, exported, base))
    assert np.abs(expected - plain).max() > 0.05, "the adapter must change the logits"
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_a_lora_checkpoint_is_not_an_export_source(tmp_path):
    from mindmoe.train.export.exporter import resolve_source

    checkpoint = tmp_path / "step_000010"
    (checkpoint / "adapter").mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"")
    (checkpoint / "state.json").write_text('{"files": {}, "step": 10}')
    cfg = compose_config([f"checkpoint={checkpoint}"])
    with pytest.raises(ValueError, match="export.adapter=.*step_000010/adapter"):
        resolve_source(cfg, {})


def test_mindir_export_with_adapter_equals_the_unmerged_model_with_adapters(adapter_dir, tmp_path):
    """The exported prefill graph of base + adapter gives the last-position logits of mindmoe's own
    model with the adapters applied and not merged (LoRA branches computed in the graph)."""
    from mindmoe.model.export.runner import ExportedModel
    from mindmoe.model.lora.peft_adapter import load_adapter, read_adapter_config
    from mindmoe.train.export.exporter import run_export

    out = tmp_path / "mindir"
    overrides = [f"model.pretrained={BASE}", f"export.out={out}", f"export.adapter={adapter_dir}"]
    run_export(compose_config(overrides), tmp_path, overrides)
    _, unmerged, _ = load_hf_pretrained(BASE, lora=read_adapter_config(adapter_dir), moe=DROPLESS)
    load_adapter(unmerged, adapter_dir)
    unmerged.set_train(False)
    _, base, _ = load_hf_pretrained(BASE, moe=DROPLESS)
    assert unmerged.moe_config == base.moe_config == DROPLESS  # serving graphs are dropless
    exported = ExportedModel(out)
    ids = np.random.default_rng(3).integers(0, 4096, size=(2, 20)).astype(np.int32)
    expected = unmerged(Tensor(ids), Tensor(np.zeros_like(ids)))[0].asnumpy()[:, -1]
    plain = base(Tensor(ids), Tensor(np.zeros_like(ids)))[0].asnumpy()[:, -1]
    ours = exported.prefill(Tensor(ids))[0].asnumpy()
    assert np.abs(expected - plain).max() > 0.05, "the adapter must change the logits"
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
