"""HF interop of ``glm4_moe``: tiny random transformers 4.57.1 models saved with ``save_pretrained`` and loaded
by mindmoe give HF's logits (fp32, eager attention, <= 1e-4), survive a round trip through export, load bf16
weights exactly, and carry their tokenizer. Softmax-routed architectures and mindmoe-native models are in
``test_hf_softmax_and_native.py``; broken directories and the config.json mapping in ``test_hf_import_errors.py``.

Weights are O(1) (HF's 0.02 init gives near-zero logits that would match anything); router
weights are scaled so routing is decisive and glm4_moe's correction bias is non-zero and checked
to change the routing.
"""

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from mindspore import Tensor
from safetensors.torch import load_file as load_torch_file
from transformers import AutoModelForCausalLM
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM

from mindmoe.model.hf import (
    HFCheckpointError,
    export_hf,
    load_hf_pretrained,
    load_hf_weights,
    plan_hf_weights,
    read_pretrained_config,
)
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.train.export.exporter import export_hf_with_tokenizer
from tests.helpers.hf_models import glm4_config, hf_logits, randomize_hf, save_hf, token_ids

ATOL = 1e-4


# ------------------------------------------------------------------------------------------- helpers


def our_logits(model, ids):
    return model(Tensor(ids), Tensor(np.zeros_like(ids)))[OUT_HEAD].asnumpy()


def assert_logits_match(ours, hf, ids):
    expected = hf_logits(hf, ids)
    assert np.abs(expected).max() > 1.0, "logits must be far from zero for the comparison to mean anything"
    np.testing.assert_allclose(our_logits(ours, ids), expected, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- glm4_moe logits vs HF

GLM4_VARIANTS = {
    # group-limited routing, QK-norm, q/k/v bias, linear RoPE scaling; saved in shards with an index
    "groups_qknorm_linear": (
        dict(n_group=2, topk_group=1, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        10,
        "40KB",
    ),
    # no QK-norm, no bias, no dense layer, dynamic NTK evaluated beyond max_position_embeddings (HF
    # grows its tables). Fewer layers where they add nothing: each MoE layer costs ~5 s of compile.
    "no_qknorm_dynamic": (
        dict(
            use_qk_norm=False,
            attention_bias=False,
            max_position_embeddings=16,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        ),
        24,
        None,
    ),
    # YaRN from a shorter original context, two shared experts, tied embeddings, 4 groups pick 2
    "yarn_tied_two_shared": (
        dict(
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            tie_word_embeddings=True,
            num_hidden_layers=2,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        ),
        20,
        None,
    ),
}


@pytest.fixture(scope="module")
def glm4_variant(tmp_path_factory):
    """``name -> (hf, directory, cfg, ours, notes, seq_len)``, built once per module: every mindmoe
    model compiles one graph (~20 s on CPU), which the tests below share."""
    built = {}

    def get(name):
        if name not in built:
            overrides, seq_len, shard = GLM4_VARIANTS[name]
            torch.manual_seed(0)
            hf = randomize_hf(
                Glm4MoeForCausalLM(glm4_config(attn_implementation="eager", **copy.deepcopy(overrides))), seed=len(name)
            )
            directory = save_hf(hf, tmp_path_factory.mktemp(name), **({"max_shard_size": shard} if shard else {}))
            cfg, ours, notes = load_hf_pretrained(directory)
            built[name] = hf, directory, cfg, ours, notes, seq_len
        return built[name]

    return get


@pytest.mark.parametrize("name", list(GLM4_VARIANTS))
def test_glm4_moe_checkpoint_gives_hf_logits(glm4_variant, name):
    hf, directory, cfg, ours, notes, seq_len = glm4_variant(name)
    ids = token_ids(seq_len, seed=3)
    assert_logits_match(ours, hf, ids)
    # The import is faithful, not lucky: the correction bias changes HF's routing here.
    unbiased = copy.deepcopy(hf)
    for layer in unbiased.model.layers[hf.config.first_k_dense_replace :]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert np.abs(hf_logits(unbiased, ids) - hf_logits(hf, ids)).max() > 1e-2
    if hf.config.n_group > 1:  # ... and so does the group limit
        ungrouped = copy.deepcopy(hf)
        for layer in ungrouped.model.layers[hf.config.first_k_dense_replace :]:
            layer.mlp.gate.n_group = layer.mlp.gate.topk_group = 1
        assert np.abs(hf_logits(ungrouped, ids) - hf_logits(hf, ids)).max() > 1e-2
    assert ours.moe_config.dispatch == "dropless" and cfg.expert_bias and cfg.score_func == "sigmoid"
    assert any("moe.dispatch=dropless" in note for note in notes)
    if name == "groups_qknorm_linear":
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(list(directory.glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("name", list(GLM4_VARIANTS))
def test_glm4_moe_config_maps_every_setting(glm4_variant, name):
    hf, _, cfg, _, _, _ = glm4_variant(name)
    hc = hf.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hc.hidden_size,
        hc.num_hidden_layers,
        hc.num_attention_heads,
        hc.num_key_value_heads,
        hc.head_dim,
    )
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.partial_rotary_factor, cfg.first_k_dense) == (
        hc.use_qk_norm,
        hc.attention_bias,
        hc.partial_rotary_factor,
        hc.first_k_dense_replace,
    )
    assert (cfg.num_experts, cfg.top_k, cfg.num_shared_experts, cfg.n_group, cfg.topk_group) == (
        hc.n_routed_experts,
        hc.num_experts_per_tok,
        hc.n_shared_experts,
        hc.n_group,
        hc.topk_group,
    )
    assert (cfg.routed_scaling_factor, cfg.norm_topk_prob, cfg.tie_word_embeddings) == (
        hc.routed_scaling_factor,
        hc.norm_topk_prob,
        hc.tie_word_embeddings,
    )
    expected_type = {
        "groups_qknorm_linear": "linear",
        "no_qknorm_dynamic": "dynamic_ntk",
        "yarn_tied_two_shared": "yarn",
    }[name]
    assert cfg.rope_scaling.type == expected_type
    if expected_type == "dynamic_ntk":
        assert cfg.rope_scaling.original_max_position == hc.max_position_embeddings
    if expected_type == "yarn":
        assert cfg.rope_scaling.original_max_position == 16


@pytest.mark.parametrize("name", list(GLM4_VARIANTS))
def test_glm4_moe_round_trip_through_export_gives_the_same_logits(glm4_variant, name, tmp_path):
    hf, _, cfg, ours, _, seq_len = glm4_variant(name)
    sharded = name == "groups_qknorm_linear"
    notes = export_hf(ours, out_dir=tmp_path, **({"max_shard_bytes": 30_000} if sharded else {}))
    assert notes == []
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    plan_hf_weights(tmp_path, read_pretrained_config(tmp_path))  # and mindmoe reads its own export
    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["model_type"] == "glm4_moe" and exported["architectures"] == ["Glm4MoeForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", torch_dtype=torch.float32
    ).eval()
    original = hf.state_dict()
    for key, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, original[key], rtol=0, atol=0, msg=key)
    ids = token_ids(seq_len, seed=4)  # the compiled shape: no second graph
    np.testing.assert_allclose(hf_logits(reloaded, ids), our_logits(ours, ids), atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------- bf16 weights


def test_bf16_checkpoint_loads_as_the_exact_fp32_values(glm4_variant, tmp_path):
    # Reuses a compiled model: weights are graph parameters, so new values need no new graph.
    name = "groups_qknorm_linear"
    hf, directory, _, ours, _, seq_len = glm4_variant(name)
    save_hf(copy.deepcopy(hf).to(torch.bfloat16), tmp_path)
    assert {v.dtype for v in load_torch_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}
    try:
        notes = load_hf_weights(ours, plan_hf_weights(tmp_path, read_pretrained_config(tmp_path)))
        assert any("BF16 tensors converted to float32" in note for note in notes)
        # The reference: HF's own fp32 upcast of the same bf16 file.
        reference = AutoModelForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager", torch_dtype=torch.float32
        ).eval()
        ids = token_ids(seq_len, seed=9)
        assert_logits_match(ours, reference, ids)
        assert np.abs(hf_logits(reference, ids) - hf_logits(hf, ids)).max() > 1e-3  # bf16 did round
    finally:
        load_hf_weights(ours, plan_hf_weights(directory, read_pretrained_config(directory)))


# ------------------------------------------------------------------------------------------ tokenizer

CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]
MESSAGES = [
    {"role": "system", "content": "你是客服助手。"},
    {"role": "user", "content": "发票 how to reissue?"},
    {"role": "assistant", "content": "请提供订单号 12345。"},
]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE ``tokenizer.json`` with GLM-style special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["发票 how to reissue an invoice for order 12345?", "请提供订单号，我们会在三个工作日内处理。"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            },
            ensure_ascii=False,
        )
    )
    return directory


def test_tokenizer_json_encodes_decodes_and_templates_like_transformers(hf_tokenizer_dir):
    import pickle

    from transformers import AutoTokenizer

    from mindmoe.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer

    ours = load_hf_tokenizer(hf_tokenizer_dir)
    reference = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    assert isinstance(ours, HFTokenizer)
    text = "发票 how to reissue?\n请提供订单号 12345。<|user|>"
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids) == text
    assert ours.encode_batch([text, "abc"]) == [ids, reference.encode("abc", add_special_tokens=False)]
    assert (ours.vocab_size, ours.eos_id, ours.pad_id, ours.bos_id) == (
        len(reference),
        reference.eos_token_id,
        reference.pad_token_id,
        -1,
    )
    for add_generation_prompt in (False, True):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    assert pickle.loads(pickle.dumps(ours)).encode(text) == ids  # the tokenising workers get a copy


def test_chat_template_file_and_sentencepiece_fallback(hf_tokenizer_dir, tmp_path):
    from mindmoe.data.hf_tokenizer import HFSentencePieceTokenizer, load_hf_tokenizer
    from mindmoe.data.tokenizer import load_tokenizer, train_sentencepiece

    # Newer transformers save the template beside tokenizer_config.json; that file wins.
    directory = Path(shutil.copytree(hf_tokenizer_dir, tmp_path / "with_file"))
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    assert load_hf_tokenizer(directory).apply_chat_template(MESSAGES) == "你是客服助手。!"
    # A directory with only a sentencepiece model loads it (with the template of tokenizer_config.json).
    spm_dir = tmp_path / "spm"
    spm_dir.mkdir()
    texts = [f"invoice {i} was reissued on day {i % 7} for order number {i * 37}" for i in range(200)]
    model_path = train_sentencepiece(texts, 320, tmp_path / "trained")
    shutil.copyfile(model_path, spm_dir / "tokenizer.model")
    (spm_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    tokenizer = load_hf_tokenizer(spm_dir)
    assert isinstance(tokenizer, HFSentencePieceTokenizer)
    assert tokenizer.encode(texts[0]) == load_tokenizer(model_path).encode(texts[0])
    assert tokenizer.apply_chat_template(MESSAGES[1:2]).startswith("[gMASK]<sop><|user|>\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
        load_hf_tokenizer(empty)


def test_export_copies_the_tokenizer_and_records_its_special_ids(glm4_variant, hf_tokenizer_dir, tmp_path):
    _, _, _, ours, _, _ = glm4_variant("yarn_tied_two_shared")
    export_hf_with_tokenizer(ours, out_dir=tmp_path, tokenizer_dir=hf_tokenizer_dir)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == config["pad_token_id"] == 0 and "bos_token_id" not in config
    assert (tmp_path / "tokenizer.json").read_bytes() == (hf_tokenizer_dir / "tokenizer.json").read_bytes()
    assert "lm_head.weight" not in load_torch_file(tmp_path / "model.safetensors")  # tied, as HF saves it
    with pytest.raises(HFCheckpointError, match="already holds a checkpoint"):
        export_hf(ours, out_dir=tmp_path)
