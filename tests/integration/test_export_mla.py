"""mindmoe-export of multi-head latent attention (HF ``deepseek_v3``): the serving graphs against transformers.

Two tiny random transformers 4.57.1 ``DeepseekV3ForCausalLM`` checkpoints are exported through the command line
(``model.pretrained=DIR``): query compression (``q_lora_rank``) with interleaved RoPE, YaRN with ``mscale`` /
``mscale_all_dim`` and group-limited routing; and a plain ``q_proj`` with rotate-half RoPE. The graphs, loaded
back with ``mindspore.load`` + ``nn.GraphCell``, must give HF's last-position logits at two prompt shapes, decode
with the latent cache (absorbed weights) must give HF's logits at every new position and its greedy tokens,
and the manifest must state a cache of ``layers * (kv_lora_rank + qk_rope_head_dim)`` values per token.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.export.runner import ExportedModel
from tests.helpers.greedy_decode import assert_decode_steps_match, greedy_by_recompute
from tests.helpers.hf_models import DEEPSEEK_V3_VARIANTS, VOCAB, deepseek_v3_variant, hf_logits, save_hf

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4
NEW_TOKENS = 8
VARIANTS = DEEPSEEK_V3_VARIANTS


@pytest.fixture(scope="module")
def exported_variant(tmp_path_factory):
    """``name -> (hf model, ExportedModel)``, each exported once with ``mindmoe-export model.pretrained=DIR``."""
    built = {}

    def get(name):
        if name not in built:
            hf = deepseek_v3_variant(name)
            work = tmp_path_factory.mktemp(name)
            source = save_hf(hf, work / "hf")
            out = work / "serving"
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])))
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "mindmoe.train.export.cli",
                    f"model.pretrained={source}",
                    f"export.out={out}",
                    "export.ascend_prompt_lengths=[16]",
                    f"hydra.run.dir={work / 'hydra'}",
                ],
                capture_output=True,
                text=True,
                env=env,
                cwd=REPO,
                timeout=900,
            )
            assert result.returncode == 0, result.stderr[-3000:]
            built[name] = hf, ExportedModel(out)
        return built[name]

    return get


def prompt(batch, length, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype(np.int32)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_mindir_gives_transformers_last_position_logits_at_two_shapes(exported_variant, name):
    hf, exported = exported_variant(name)
    for batch, length in ((2, 7), (1, 19)):
        ids = prompt(batch, length, seed=length)
        logits, cache = exported.prefill(Tensor(ids))[:2]
        expected = hf_logits(hf, ids)[:, -1]
        assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
        np.testing.assert_allclose(logits.asnumpy(), expected, rtol=0, atol=ATOL)
        cfg = hf.config
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        assert cache.shape == (cfg.num_hidden_layers, batch, length, width)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_latent_cache_decode_gives_transformers_logits_and_greedy_tokens(exported_variant, name):
    hf, exported = exported_variant(name)
    ids = prompt(2, 11, seed=5)  # 11 + 8 positions pass YaRN's original 16
    # Greedy by full recompute in transformers (no cache): the independent reference.
    sequence, expected_logits = greedy_by_recompute(lambda seq: hf_logits(hf, seq)[:, -1], ids, NEW_TOKENS)
    generated = exported.generate(ids, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(generated, sequence[:, ids.shape[1] :])

    # Every decode step's logits, fed HF's tokens, against HF's at the same position.
    assert_decode_steps_match(exported, ids, sequence, expected_logits, ATOL)


def test_manifest_states_the_latent_cache_layout(exported_variant):
    hf, exported = exported_variant("q_lora_interleaved_yarn_groups")
    cfg, manifest = hf.config, exported.manifest
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layers = cfg.num_hidden_layers
    cache = manifest["cache"]
    assert cache["kind"] == "mla_latent"
    assert cache["values_per_token_per_layer"] == width == 20
    assert cache["values_per_token"] == layers * width
    assert cache["shape"] == [layers, "batch", "cache_len", width] and cache["length_axis"] == 2
    prefill, decode = manifest["graphs"]["prefill"], manifest["graphs"]["decode"]
    assert [entry["name"] for entry in prefill["inputs"]] == ["input_ids"]
    assert prefill["inputs"][0]["shape"] == ["batch", "prompt_len"] and prefill["inputs"][0]["dtype"] == "int32"
    assert [entry["name"] for entry in prefill["outputs"]] == ["logits", "kv_cache"]
    assert prefill["outputs"][1]["shape"] == [layers, "batch", "prompt_len", width]
    assert [entry["name"] for entry in decode["inputs"]] == ["input_ids", "kv_cache", "position"]
    assert decode["inputs"][1]["shape"] == [layers, "batch", "cache_len", width]
    assert [entry["name"] for entry in decode["outputs"]] == ["logits", "kv_cache"]
    assert manifest["model_config"]["attention_type"] == "mla"
