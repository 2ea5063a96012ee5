"""HF import builds no weight the checkpoint provides: nothing is drawn for it, and each tensor is read
straight into its parameter in the parameter's own dtype (the reference for dtype conversion: torch)."""

import dataclasses

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Parameter
from safetensors.torch import save_file as save_torch_file
from transformers import Glm4MoeForCausalLM

from mindmoe.model.deferred_init import checkpoint_weights, finish_deferred, provided
from mindmoe.model.hf import load_hf_pretrained, read_pretrained_config
from mindmoe.model.hf.param_stream import ParamStreamer
from mindmoe.model.hf.safetensors_io import read_header
from mindmoe.model.lora import LoraConfig, is_adapter
from mindmoe.model.lora.plan import plan_adapters
from mindmoe.model.transformer import MoETransformer
from tests.helpers.hf_models import glm4_config, randomize_hf, save_hf
from tests.unit.test_hf_rank_local_load import SecondHalfOfTheExperts

TORCH_DTYPES = {ms.float32: torch.float32, ms.float16: torch.float16, ms.bfloat16: torch.bfloat16}


class DrawSpy:
    """Wraps every ``np.random.default_rng`` generator and counts the values each method draws."""

    def __init__(self, monkeypatch):
        self.drawn = {}
        real = np.random.default_rng
        spy = self

        class Recording:
            def __init__(self, generator):
                self.generator = generator

            def __getattr__(self, name):
                attr = getattr(self.generator, name)
                if name not in ("normal", "uniform", "standard_normal", "integers", "random"):
                    return attr

                def draw(*args, size=None, **kwargs):
                    values = attr(*args, size=size, **kwargs)
                    spy.drawn[name] = spy.drawn.get(name, 0) + int(np.size(values))
                    return values

                return draw

        monkeypatch.setattr(np.random, "default_rng", lambda *args, **kwargs: Recording(real(*args, **kwargs)))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = randomize_hf(Glm4MoeForCausalLM(glm4_config()).eval(), seed=5)
    state = {name: tensor.float().numpy() for name, tensor in hf.state_dict().items()}
    return save_hf(hf, tmp_path_factory.mktemp("hf")), state


@pytest.mark.parametrize("dispatcher", [None, SecondHalfOfTheExperts()], ids=["one_process", "half_the_experts"])
def test_import_draws_nothing_for_the_base_and_adapters_start_as_in_an_eager_build(hf_dir, monkeypatch, dispatcher):
    directory, state = hf_dir
    lora = LoraConfig(enabled=True, r=2, alpha=4.0, target_modules=["q_proj", "gate_proj"])
    model_cfg = read_pretrained_config(directory).model_config
    eager_spy = DrawSpy(monkeypatch)
    eager = MoETransformer(model_cfg, seed=7, lora=plan_adapters(model_cfg, lora, 7), expert_dispatcher=dispatcher)
    assert eager_spy.drawn.get("normal", 0) > 0  # the spy sees an ordinary build's random weights
    eager_uniform = eager_spy.drawn["uniform"]  # before the next spy: it would count the import's draws too

    spy = DrawSpy(monkeypatch)
    _, model, _ = load_hf_pretrained(directory, lora=lora, lora_seed=7, expert_dispatcher=dispatcher)
    assert spy.drawn.get("normal", 0) == 0, spy.drawn
    adapters = {p.name: p.asnumpy() for p in eager.get_parameters() if is_adapter(p.name)}
    # The adapters' draws only, as many as an eager build makes (a share of the experts draws every expert's
    # lora_A and keeps its rows, so the random stream is one process's).
    assert adapters and spy.drawn == {"uniform": eager_uniform}
    params = {p.name: p for p in model.get_parameters()}
    for name, value in adapters.items():  # drawn from the adapter plan's generator, as without a checkpoint
        np.testing.assert_array_equal(params[name].asnumpy(), value, err_msg=name)
    assert not any(p.has_init for p in params.values())
    first = 0 if dispatcher is None else model_cfg.num_experts // 2
    for ours, theirs in (
        ("layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight"),
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("layers.1.mlp.experts.down_proj", f"model.layers.1.mlp.experts.{first}.down_proj.weight"),
    ):
        param = params[ours]  # in its own storage dtype (lora.base_dtype may make the frozen base half)
        expected = torch.from_numpy(state[theirs]).to(TORCH_DTYPES[param.dtype]).float().numpy()
        got = param.astype(ms.float32).asnumpy()
        np.testing.assert_array_equal(got if got.ndim == expected.ndim else got[0], expected, err_msg=ours)


def test_a_deferred_build_holds_no_values_and_refuses_to_invent_unloaded_weights(hf_dir):
    model_cfg = read_pretrained_config(hf_dir[0]).model_config
    with checkpoint_weights():
        model = MoETransformer(model_cfg)
    deferred = [p.name for p in model.get_parameters() if p.has_init]
    eager = [p.name for p in model.get_parameters() if not p.has_init]
    assert eager == [f"layers.{i}.mlp.router.e_score_correction_bias" for i in range(1, model_cfg.num_layers)]
    assert "layers.0.self_attn.q_proj.bias" in deferred and "norm.weight" in deferred
    with pytest.raises(
        RuntimeError, match=r"weights were built for a checkpoint that did not provide them: embed_tokens"
    ):
        finish_deferred(model)
    np.testing.assert_array_equal(model.norm.weight.asnumpy(), np.ones(model_cfg.hidden_size, np.float32))
    np.testing.assert_array_equal(model.layers[0].self_attn.q_proj.bias.asnumpy(), 0.0)


def test_each_tensor_is_converted_to_its_parameters_own_dtype_as_torch_converts_it(tmp_path):
    values = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    # Exact bf16 / fp16 rounding ties, both directions, and the special values.
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 7e4])
    values = torch.cat([values, ties, torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])])
    sources = {
        f"from_{name}": values.to(dtype)
        for name, dtype in (("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16))
    }
    save_torch_file(sources, str(tmp_path / "t.safetensors"))
    with checkpoint_weights():
        params = {
            f"{source}_to_{ms_dtype}": Parameter(provided(values.shape, ms_dtype), name=f"{source}_to_{ms_dtype}")
            for source in sources
            for ms_dtype in TORCH_DTYPES
        }
    streamer = ParamStreamer(params)
    with open(tmp_path / "t.safetensors", "rb") as handle:
        for entry in read_header(tmp_path / "t.safetensors"):
            for name in params:
                if name.startswith(entry.name + "_to_"):
                    streamer.read(handle, entry, name, None, 1)
    assert len(streamer.notes()) == 6
    for name, param in params.items():
        source, ms_dtype = name.split("_to_")[0], param.dtype
        assert not param.has_init and param.dtype == ms_dtype
        expected = sources[source].to(TORCH_DTYPES[ms_dtype]).float().numpy()
        got = param.astype(ms.float32).asnumpy()
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_a_lora_base_checkpoint_is_loaded_into_a_model_that_drew_nothing_for_it(tmp_path, monkeypatch):
    from mindmoe.model.config import ModelConfig
    from mindmoe.train.checkpoints.checkpoint import save_checkpoint
    from mindmoe.train.init_model import build_model
    from tests.helpers.runs import compose_config

    base_cfg = ModelConfig(
        vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=24,
        num_experts=4, moe_intermediate_size=8, max_position_embeddings=64,
    )  # fmt: skip
    base = MoETransformer(base_cfg, seed=7)
    saved = save_checkpoint(
        tmp_path, 5, list(base.get_parameters()), [], {"model_config": dataclasses.asdict(base_cfg)}, keep_last=1
    )
    cfg = compose_config([f"lora.base_checkpoint={saved}", "lora.enabled=true", "lora.r=2", "lora.base_dtype=fp32"])
    spy = DrawSpy(monkeypatch)
    _, model = build_model(cfg, vocab_size=64)
    assert "normal" not in spy.drawn and spy.drawn.get("uniform", 0) > 0  # only the adapters' lora_A
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    for param in base.get_parameters():
        np.testing.assert_array_equal(weights[param.name], param.asnumpy(), err_msg=param.name)
