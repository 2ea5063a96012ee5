"""``mindmoe-export model.pretrained=DIR`` of a HF ``glm_moe_dsa`` (GLM-5) checkpoint, against transformers 5.23.

The GLM-5-shaped tiny variant of ``tests/helpers/hf_models.py`` (three dense layers first, a shared expert, a
sigmoid router, MLA with query compression, 16 indexer heads keeping 5 keys), built and saved by the transformers 5
reference, is exported through the command line once (MindIR, the default format). Its prefill graph gives
transformers' last-position logits at two prompt shapes, both longer than ``index_topk`` so the indexer's selection
decides them; the manifest states the cache row with the indexer's keys. (Selection ties: 16 indexer heads make an
exact tie of two ReLU'd sums vanishingly rare; tests/unit/test_hf_glm_moe_dsa.py checks the gaps on these weights.)
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor

from mindmoe.model.export.runner import ExportedModel
from tests.helpers.hf_models import GLM_MOE_DSA_VARIANTS

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4
CONFIG = GLM_MOE_DSA_VARIANTS["glm5_shaped"]
#: Transformers runs these ids once; attention is causal and routing per token, so its logits at position 6 are
#: the [2, 7] prompt's last-position logits and those of row 0 at position 18 the [1, 19] prompt's.
IDS = np.random.default_rng(19).integers(0, CONFIG["vocab_size"], (2, 19)).astype(np.int32)
PROMPTS = {(2, 7): IDS[:, :7], (1, 19): IDS[:1]}


@pytest.fixture(scope="module")
def exported(tf5_reference, tmp_path_factory):
    work = tmp_path_factory.mktemp("glm_moe_dsa")
    reference = tf5_reference.build(CONFIG, 5, work / "hf", IDS)
    out = work / "serving"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])))
    command = [
        sys.executable,
        "-m",
        "mindmoe.train.export.cli",
        f"model.pretrained={work / 'hf'}",
        f"export.out={out}",
        "export.ascend_prompt_lengths=[16]",
        f"hydra.run.dir={work / 'hydra'}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return reference, ExportedModel(out)


def test_prefill_mindir_gives_transformers_logits_at_two_shapes_with_sparse_attention(exported):
    reference, model = exported
    assert reference["model_class"] == "GlmMoeDsaForCausalLM"
    width = CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"] + CONFIG["index_head_dim"]
    for (batch, length), ids in PROMPTS.items():
        assert length > CONFIG["index_topk"]
        logits, cache = model.prefill(Tensor(ids))[:2]
        expected = reference["logits"][:batch, length - 1]
        assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
        np.testing.assert_allclose(logits.asnumpy(), expected, rtol=0, atol=ATOL, err_msg=f"{(batch, length)}")
        assert cache.shape == (CONFIG["num_hidden_layers"], batch, length, width)
    cache_entry = model.manifest["cache"]
    assert cache_entry["kind"] == "mla_latent_dsa" and cache_entry["values_per_token_per_layer"] == width
    assert [part["name"] for part in cache_entry["row"]] == ["c_kv", "k_rope", "index_k"]
    assert "stage" not in model.manifest["model_config"]["dsa"] and cache_entry["kind"] == "mla_latent_dsa"
