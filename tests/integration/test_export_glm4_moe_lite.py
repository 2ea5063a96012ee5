"""mindmoe-export of a HF ``glm4_moe_lite`` (GLM-4.7-Flash) checkpoint, against transformers 5.23.

The two tiny random ``Glm4MoeLiteForCausalLM`` variants of ``tests/helpers/hf_models.py`` (query compression,
interleaved RoPE, YaRN and group-limited routing; a plain ``q_proj``, rotate-half RoPE and two dense layers),
built and saved by the transformers 5 reference (``tf5_reference`` fixture), are exported through the command
line (``model.pretrained=DIR``), each once per module:

* ``export.format=hf`` keeps ``model_type: glm4_moe_lite`` (not ``deepseek_v3``, the first MLA architecture) and
  reloads in transformers 5 with the source's weights and logits;
* a mindmoe checkpoint, which records no ``model_type``, is written as the first architecture that reproduces it,
  and one that none reproduces is refused rather than labelled;
* the MindIR prefill graph gives transformers' last-position logits at two prompt shapes, with a latent cache of
  ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, and greedy decoding with that cache gives the
  greedy tokens of the training model (full recompute).
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.export.runner import ExportedModel
from mindmoe.model.hf import HFCheckpointError, hf_config_from_model, load_hf_pretrained, read_hf_config
from mindmoe.train.export.exporter import ExportSource, adapter_names_type, source_model_type
from tests.helpers.greedy_decode import greedy_by_recompute
from tests.helpers.hf_models import GLM4_MOE_LITE_VARIANTS, VOCAB

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4
NEW_TOKENS = 8
VARIANTS = GLM4_MOE_LITE_VARIANTS


def prompt(batch, length, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype(np.int32)


#: The ids transformers 5 runs (once, when it builds the model). Attention is causal and routing per token, so
#: its logits at position 6 are the last-position logits of the [2, 7] prompt ``IDS[:, :7]``, and those of row 0
#: at position 18 the [1, 19] prompt ``IDS[:1]``'s: one reference run covers both prefill shapes.
IDS = prompt(2, 19, seed=19)
PROMPTS = {(2, 7): IDS[:, :7], (1, 19): IDS[:1]}


def write_tokenizer(directory: Path) -> None:
    """A word-level ``tokenizer.json`` over the model's vocabulary (id 0 the end of text), as a HF checkpoint
    ships one; ``export.format=hf`` copies it and writes its special ids into ``config.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def export_cli(source: Path, out: Path, *args: str) -> Path:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindmoe.train.export.cli",
            f"model.pretrained={source}",
            f"export.out={out}",
            *args,
            f"hydra.run.dir={out.parent / (out.name + '_hydra')}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def once(function):
    """``function(name)`` computed once per name."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = function(name)
        return done[name]

    return get


@pytest.fixture(scope="module")
def source(tf5_reference, tmp_path_factory):
    """``name -> (HF directory saved by transformers 5 plus a tokenizer, the build's result for :data:`IDS`)``."""

    def build(name):
        directory = tmp_path_factory.mktemp(name) / "hf"
        reference = tf5_reference.build(VARIANTS[name], len(name), directory, IDS)
        assert reference["transformers"] == "5.23.0" and reference["model_class"] == "Glm4MoeLiteForCausalLM"
        assert np.abs(reference["logits"]).max() > 1.0, "logits must be far from zero for comparisons to mean anything"
        write_tokenizer(directory)
        return directory, reference

    return once(build)


@pytest.fixture(scope="module")
def exported(source):
    """``name -> ExportedModel`` of ``mindmoe-export model.pretrained=DIR`` (MindIR, the default format)."""
    return once(lambda name: ExportedModel(export_cli(source(name)[0], source(name)[0].parent / "serving")))


def test_hf_export_keeps_glm4_moe_lite_and_reloads_with_the_sources_weights_and_logits(source, tf5_reference):
    directory, reference = source("q_lora_interleaved_yarn_groups")
    out = export_cli(directory, directory.parent / "hf_export", "export.format=hf")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "glm4_moe_lite" and written["architectures"] == ["Glm4MoeLiteForCausalLM"]
    assert "rope_parameters" in written and "mlp_layer_types" in written and "rope_theta" not in written
    assert written["eos_token_id"] == written["pad_token_id"] == 0
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    reloaded = tf5_reference.reload(out, IDS)
    assert reloaded["model_class"] == "Glm4MoeLiteForCausalLM"
    assert set(reloaded["state"]) == set(reference["state"])
    for key, value in reloaded["state"].items():
        np.testing.assert_array_equal(value, reference["state"][key], err_msg=key)
    np.testing.assert_array_equal(reloaded["logits"], reference["logits"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_mindir_gives_transformers5_last_position_logits_and_the_latent_cache(source, exported, name):
    reference = source(name)[1]
    model = exported(name)
    config = reference["config"]
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert model.manifest["cache"]["kind"] == "mla_latent" and model.manifest["cache"]["shape"][-1] == width
    for shape, ids in PROMPTS.items():
        got, cache = model.prefill(Tensor(ids))[:2]
        expected = reference["logits"][: shape[0], shape[1] - 1]
        assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
        np.testing.assert_allclose(got.asnumpy(), expected, rtol=0, atol=ATOL, err_msg=f"{shape=}")
        assert cache.shape == (config["num_hidden_layers"], *shape, width)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_latent_cache_greedy_decoding_equals_the_training_models_greedy(source, exported, name):
    directory = source(name)[0]
    _, ours, _ = load_hf_pretrained(directory)  # dropless: an import's default
    ours.set_inputs(Tensor(shape=[None, None], dtype=ms.int32), Tensor(shape=[None, None], dtype=ms.int32))
    ids = prompt(2, 11, seed=5)  # 11 + 8 positions pass YaRN's original 16
    # full recompute of the whole sequence at every step
    sequence, step_logits = greedy_by_recompute(
        lambda seq: ours(Tensor(seq), Tensor(np.zeros_like(seq)))[0].asnumpy()[:, -1], ids, NEW_TOKENS
    )
    for logits in step_logits:
        assert np.abs(logits).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
    generated = exported(name).generate(ids, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(generated, sequence[:, ids.shape[1] :])


def test_a_checkpoint_source_is_the_first_architecture_that_reproduces_it_or_none(tmp_path):
    """``checkpoint=`` sources record no HF model_type: an imported glm4_moe_lite's config is written as
    ``deepseek_v3`` (the first supported architecture that reproduces it); one no architecture reproduces gets ""
    (so export_hf refuses it naming every architecture's reasons), and its adapter names follow its attention."""
    mla = read_hf_config(VARIANTS["q_lora_interleaved_yarn_groups"]).model_config
    checkpoint = ExportSource("checkpoint", tmp_path, mla, None, {})
    assert source_model_type(checkpoint) == "deepseek_v3"
    ntk = dataclasses.replace(mla, rope_scaling=dataclasses.replace(mla.rope_scaling, type="ntk"))
    assert source_model_type(dataclasses.replace(checkpoint, model_config=ntk)) == ""
    assert adapter_names_type(ntk, "") == "deepseek_v3" and adapter_names_type(ntk, "glm4_moe_lite") == "glm4_moe_lite"
    assert adapter_names_type(dataclasses.replace(ntk, attention_type="gqa"), "") == "glm4_moe"
    with pytest.raises(HFCheckpointError, match="(?s)glm4_moe: .*deepseek_v3: .*glm4_moe_lite: .*'ntk'"):
        hf_config_from_model(ntk, "")  # what export_hf(..., model_type="") writes by
