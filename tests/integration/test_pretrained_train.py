"""``model.pretrained``: training starts from a HF ``glm4_moe`` directory, with its architecture, its
weights and its tokenizer.

The reference is the HF model itself: the first step's loss (measured before any update) equals
the transformers model's next-token loss on the same packed windows, evaluated document by
document (packing's per-document causal mask; RoPE depends only on relative positions).
"""

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module

from mindmoe.conf.schema import SAMPLES_DIR, register_configs
from tests.helpers.hf_models import glm4_config, randomize_hf, save_hf

SEQ_LEN, MICRO, GLOBAL = 32, 2, 4


def compose_config(overrides):
    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory):
    """A tiny random glm4_moe (sigmoid router with a non-zero correction bias) and a BPE tokenizer.json
    trained on the bundled corpus, saved the way transformers saves them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM

    directory = tmp_path_factory.mktemp("hf_base")
    texts = [
        json.loads(line)["text"]
        for line in (SAMPLES_DIR / "corpus_train.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    vocab = tokenizer.get_vocab_size(with_added_tokens=True) + 20  # padded, as published models are
    torch.manual_seed(0)
    hf = randomize_hf(Glm4MoeForCausalLM(glm4_config(vocab_size=vocab, max_position_embeddings=128)), seed=3)
    save_hf(hf, directory, max_shard_size="200KB")
    data_file = directory.parent / "train.jsonl"
    data_file.write_text(
        "\n".join(json.dumps({"text": text}, ensure_ascii=False) for text in texts) + "\n", encoding="utf-8"
    )
    return directory, data_file, hf


def run_overrides(pretrained, data_file, cache, *extra):
    return [
        f"model.pretrained={pretrained}",
        f"data.train_files=[{data_file}]",
        "data.valid_files=[]",
        f"data.seq_len={SEQ_LEN}",
        f"data.micro_batch_size={MICRO}",
        f"data.global_batch_size={GLOBAL}",
        f"data.cache_dir={cache}",
        "train.max_steps=2",
        "train.log_every=1",
        "train.save_every=2",
        "train.eval_every=0",
        "train.progress_bar=false",
        "train.peak_gflops=50",
        *extra,
    ]


@pytest.fixture(scope="module")
def pretrained_run(pretrained_dir, tmp_path_factory):
    from mindmoe.train.loop import run

    directory, data_file, _ = pretrained_dir
    cache = tmp_path_factory.mktemp("cache")
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_config(run_overrides(directory, data_file, cache))
    run(cfg, run_dir, explicit_model_keys=set())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, run_dir, rows


def hf_window_loss(hf, window_ids, window_docs):
    """Mean next-token NLL of one packed window, each document run through HF on its own."""
    nll_sum, count = 0.0, 0
    starts = [0] + [t for t in range(1, len(window_docs)) if window_docs[t] != window_docs[t - 1]]
    for start, end in zip(starts, starts[1:] + [len(window_docs)]):
        if end - start < 2:
            continue
        ids = torch.tensor(window_ids[start:end], dtype=torch.long)[None]
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(input_ids=ids).logits.double(), -1)[0]
        targets = ids[0, 1:]
        nll_sum -= log_probs[torch.arange(end - start - 1), targets].sum().item()
        count += end - start - 1
    return nll_sum, count


def test_first_step_loss_is_the_hf_models_loss_on_the_same_windows(pretrained_dir, pretrained_run):
    from mindmoe.data.mindrecord import WindowLoader
    from mindmoe.data.prepare import prepare_data, with_pretrained_tokenizer

    _, _, hf = pretrained_dir
    cfg, _, rows = pretrained_run
    prepared = prepare_data(with_pretrained_tokenizer(cfg.data, cfg.model.pretrained))
    loader = iter(WindowLoader(prepared.train_shards, MICRO, GLOBAL, seed=cfg.train.seed))
    micro_losses = []
    for _ in range(GLOBAL // MICRO):
        batch = next(loader)
        sums = [hf_window_loss(hf, ids, docs) for ids, docs in zip(batch["input_ids"], batch["doc_ids"])]
        micro_losses.append(sum(s for s, _ in sums) / sum(c for _, c in sums))
    first = [row for row in rows if row.get("step") == 1 and "lm_loss" in row][0]
    assert first["lm_loss"] == pytest.approx(np.mean(micro_losses), rel=1e-5)


def test_run_uses_the_hf_architecture_tokenizer_and_dropless_dispatch(pretrained_dir, pretrained_run):
    directory, _, hf = pretrained_dir
    _, run_dir, _ = pretrained_run
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "state.json").read_text())
    model_config = state["model_config"]
    assert model_config["hidden_size"] == hf.config.hidden_size  # not tiny_moe's 192
    assert model_config["num_experts"] == hf.config.n_routed_experts
    assert model_config["vocab_size"] == hf.config.vocab_size
    assert model_config["score_func"] == "sigmoid" and model_config["expert_bias"]
    assert "dispatch" not in model_config and state["moe_config"]["dispatch"] == "dropless"  # auto, resolved
    assert model_config["pretrained"] == str(directory)
    # The checkpoint carries the HF tokenizer's files (not a path to them), config.json for its fallback ids.
    assert "tokenizer/tokenizer.json" in state["tokenizer"] and "tokenizer/config.json" in state["tokenizer"]
    for name in state["tokenizer"]:
        checkpoint_file = run_dir / "checkpoints" / "step_000002" / name
        assert checkpoint_file.read_bytes() == (directory / name.split("/")[-1]).read_bytes()


def test_resume_of_a_pretrained_run_continues_from_its_checkpoint(pretrained_dir, pretrained_run, tmp_path):
    """The checkpoint, not the HF weights, is where a resumed run starts: step 3 follows step 2."""
    from mindmoe.train.loop import run

    directory, data_file, _ = pretrained_dir
    cfg, run_dir, rows = pretrained_run
    resumed = compose_config(
        run_overrides(directory, data_file, cfg.data.cache_dir, "train.max_steps=3", "train.resume=auto")
    )
    run(resumed, run_dir, explicit_model_keys=set())
    all_rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in all_rows if "lm_loss" in row]
    assert steps == [1, 2, 3]


def test_command_line_policy_and_context_keys_apply_and_architecture_keys_must_agree(pretrained_dir, tmp_path):
    from mindmoe.train.init_model import build_model, explicit_model_keys

    directory, data_file, hf = pretrained_dir
    overrides = run_overrides(
        directory,
        data_file,
        tmp_path,
        "moe.dispatch=capacity",
        "moe.capacity_factor=2.0",
        "model.rope_scaling.type=linear",
        "model.rope_scaling.factor=2.0",
    )
    keys = explicit_model_keys(overrides)
    assert keys == {"rope_scaling"}
    model_cfg, model = build_model(compose_config(overrides), hf.config.vocab_size, keys, load_weights=False)
    assert (model.moe_config.dispatch, model.moe_config.capacity_factor) == ("capacity", 2.0)
    assert (model_cfg.rope_scaling.type, model_cfg.rope_scaling.factor) == ("linear", 2.0)
    assert model_cfg.hidden_size == hf.config.hidden_size

    conflicting = run_overrides(directory, data_file, tmp_path, "model.hidden_size=64")
    with pytest.raises(ValueError, match=r"model.hidden_size=64 conflicts with .*config.json"):
        build_model(
            compose_config(conflicting), hf.config.vocab_size, explicit_model_keys(conflicting), load_weights=False
        )


def test_tokenizer_larger_than_the_pretrained_vocabulary_is_refused(pretrained_dir, tmp_path):
    from mindmoe.train.init_model import build_model

    directory, data_file, hf = pretrained_dir
    cfg = compose_config(run_overrides(directory, data_file, tmp_path))
    with pytest.raises(ValueError, match=r"config.json: vocab_size=\d+ is smaller than the tokenizer's"):
        build_model(cfg, hf.config.vocab_size + 1, set(), load_weights=False)


def test_a_recipes_training_keys_apply_on_top_of_config_json(pretrained_dir, tmp_path):
    """``recipe=pretrain_tiny_aux_free`` sets expert locking and aux-free balancing (``moe.*``): they apply to
    the imported model; its ``model.*`` keys count as if typed, and the command line's routed scaling matches
    config.json."""
    from mindmoe.train.export.exporter import command_line_moe_overrides
    from mindmoe.train.init_model import build_model, explicit_model_keys

    directory, data_file, hf = pretrained_dir
    overrides = run_overrides(
        directory, data_file, tmp_path, "recipe=pretrain_tiny_aux_free", f"model.routed_scaling_factor={2.5}"
    )
    keys = explicit_model_keys(overrides)
    assert keys == {"score_func", "expert_bias", "routed_scaling_factor"}
    cfg = compose_config(overrides)
    model_cfg, model = build_model(cfg, hf.config.vocab_size, keys, load_weights=False)
    policy = model.moe_config
    assert policy.expert_lock and policy.bias_update_rate == 0.002 and policy.aux_loss == "seq"
    assert policy.dispatch == "dropless"  # auto: the weights come from the HF directory
    assert model_cfg.hidden_size == hf.config.hidden_size and model_cfg.routed_scaling_factor == 2.5
    # mindmoe-export reads the same keys.
    assert command_line_moe_overrides(cfg, overrides)["expert_lock"] is True


def test_a_recipes_architecture_key_that_disagrees_with_config_json_fails_naming_both(pretrained_dir, tmp_path):
    """The recipe pins routed_scaling_factor 1.0; the HF model has 2.5: training and the launcher's
    pre-check (no MindSpore) both refuse, naming the key, both values and the file."""
    from mindmoe.conf.checks import check_launch_config
    from mindmoe.train.init_model import build_model, explicit_model_keys

    directory, data_file, hf = pretrained_dir
    overrides = run_overrides(directory, data_file, tmp_path, "recipe=pretrain_tiny_aux_free")
    cfg = compose_config(overrides)
    expected = r"model.routed_scaling_factor=1.0 conflicts with .*config.json .*which gives 2.5"
    with pytest.raises(ValueError, match=expected):
        build_model(cfg, hf.config.vocab_size, explicit_model_keys(overrides), load_weights=False)
    with pytest.raises(ValueError, match=expected):
        check_launch_config(cfg, [], overrides)
    # The default model group and recipe set nothing: config.json alone decides.
    plain = run_overrides(directory, data_file, tmp_path)
    model_cfg, model = build_model(compose_config(plain), hf.config.vocab_size, explicit_model_keys(plain), False)
    assert model_cfg.routed_scaling_factor == 2.5 and model.moe_config.dispatch == "dropless"


def test_a_recipe_in_a_user_config_dir_applies_through_the_hydra_runtime(pretrained_dir, tmp_path):
    from hydra import compose, initialize_config_module

    from mindmoe.train.init_model import build_model, explicit_model_keys

    directory, data_file, hf = pretrained_dir
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "locked.yaml").write_text(
        "# @package _global_\nmodel:\n  num_experts: 3\nmoe:\n  expert_lock: true\n  lock_span: 4\n"
    )
    overrides = run_overrides(directory, data_file, tmp_path, "recipe=locked")
    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        cfg = compose(
            "config", overrides=[*overrides, f"hydra.searchpath=[file://{tmp_path / 'conf'}]"], return_hydra_config=True
        )
    keys = explicit_model_keys(cfg.hydra.overrides.task, cfg.hydra.runtime)
    assert keys == {"num_experts"}
    with pytest.raises(ValueError, match=rf"model.num_experts=3 conflicts with .*gives {hf.config.n_routed_experts}"):
        build_model(cfg, hf.config.vocab_size, keys, load_weights=False)
    keys.discard("num_experts")
    _, model = build_model(cfg, hf.config.vocab_size, keys, load_weights=False)
    assert model.moe_config.expert_lock and model.moe_config.lock_span == 4
