"""Specification of mindmoe-eval: long-context validation loss of a checkpoint per RoPE scaling type.

The reference packs the validation text itself (SentencePiece ids, windows of L + 1 cut from the
document stream) and takes a NumPy log-softmax over the logits of a model built by hand with the
RoPE scaling the table claims, run eagerly (PyNative), not through the compiled evaluation.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
import sentencepiece as spm
from hydra import compose, initialize_config_module
from mindspore import Tensor
from omegaconf import OmegaConf

import mindmoe.data as data
from mindmoe.conf.schema import register_configs
from mindmoe.data.config import DataConfig
from mindmoe.data.prepare import prepare_data
from mindmoe.model.config import ModelConfig
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.outputs import OUT_HEAD
from mindmoe.model.rope_scaling import RopeScalingConfig
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.checkpoints.checkpoint import CarriedFiles, load_model_weights, save_checkpoint
from mindmoe.train.evaluation.config import EvalConfig, validate_eval_config
from mindmoe.train.evaluation.evaluate import context_offsets, evaluate_checkpoint, evaluate_model
from mindmoe.train.evaluation.report import markdown

REPO = Path(__file__).resolve().parents[2]
TRAINED = 16
LENGTHS = [TRAINED, 3 * TRAINED]
FACTOR = 2.0
MAX_WINDOWS = 4


@pytest.fixture(scope="module")
def english_valid(tmp_path_factory):
    """English validation documents only: a 512-piece tokenizer needs no Chinese characters."""
    lines = (Path(data.__file__).parent / "samples" / "corpus_valid.jsonl").read_text(encoding="utf-8").splitlines(True)
    english = [line for line in lines if all(ord(char) < 0x2E80 for char in json.loads(line)["text"])]
    path = tmp_path_factory.mktemp("corpus") / "valid.jsonl"
    path.write_text("".join(english[:30]), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_cache, english_valid):
    """A run dir as mindmoe-train leaves it: checkpoints/step_000007 and resolved_config.yaml (seq_len 16)."""
    prepared = prepare_data(
        DataConfig(
            train_files=[str(english_valid)],
            valid_files=[str(english_valid)],
            seq_len=TRAINED,
            vocab_size=512,
            cache_dir=data_cache,
            num_proc=1,
        )
    )
    # A large init so attention is sharp and positions change the logits measurably.
    # One MoE layer keeps each of the four compiled graphs small.
    model_cfg = ModelConfig(
        vocab_size=prepared.vocab_size,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        first_k_dense=0,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=32,
        initializer_range=0.3,
    )
    model = MoETransformer(model_cfg, seed=3)
    run_dir = tmp_path_factory.mktemp("run")
    state = {"model_config": dataclasses.asdict(model_cfg)}
    carried = CarriedFiles.of_run(prepared.tokenizer_path)  # no config.yaml: the run dir's is read
    checkpoint = save_checkpoint(run_dir / "checkpoints", 7, list(model.get_parameters()), [], state, 1, None, carried)
    OmegaConf.save(OmegaConf.create({"data": {"seq_len": TRAINED}}), run_dir / "resolved_config.yaml")
    return checkpoint, model_cfg, prepared.tokenizer_path


def compose_config(overrides):
    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="module")
def report(tiny_run, english_valid, data_cache):
    checkpoint, _, _ = tiny_run
    cfg = compose_config(
        [
            f"checkpoint={checkpoint}",
            f"data.train_files=[{english_valid}]",
            f"data.valid_files=[{english_valid}]",
            f"data.cache_dir={data_cache}",
            "data.num_proc=1",
            f"eval.context_lengths={LENGTHS}",
            "eval.scaling_types=[none,dynamic_ntk]",
            f"eval.factor={FACTOR}",
            f"eval.max_windows={MAX_WINDOWS}",
            "eval.batch_size=2",
        ]
    )
    return evaluate_checkpoint(cfg)


def reference_windows(tokenizer_path, valid_file, length, count=MAX_WINDOWS):
    """The first ``count`` windows of ``length + 1`` tokens cut from the stream of BOS + text + EOS documents."""
    processor = spm.SentencePieceProcessor(model_file=tokenizer_path)
    documents = [
        [processor.bos_id()] + processor.encode(json.loads(line)["text"]) + [processor.eos_id()]
        for line in Path(valid_file).open(encoding="utf-8")
    ]
    tokens = np.concatenate([np.asarray(ids) for ids in documents])
    doc_of_token = np.concatenate([np.full(len(ids), index) for index, ids in enumerate(documents)])
    window = length + 1
    count = min(count, len(tokens) // window)
    ids = tokens[: count * window].reshape(count, window)
    docs = doc_of_token[: count * window].reshape(count, window)
    return ids, docs - docs[:, :1]


def reference_losses(model_cfg, checkpoint, rope_scaling, ids, docs, cross_document=False):
    """(mean NLL over scored labels, mean NLL over those whose input is >= TRAINED tokens into its
    document, or into the window when attention crosses documents)."""
    cfg = dataclasses.replace(model_cfg, rope_scaling=rope_scaling)
    model = MoETransformer(cfg, seed=0, moe=MoEConfig(dispatch="dropless"))
    load_model_weights(list(model.get_parameters()), checkpoint)
    attention_docs = np.zeros_like(docs) if cross_document else docs
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        inputs = Tensor(ids[:, :-1].astype(np.int32)), Tensor(attention_docs[:, :-1].astype(np.int32))
        logits = model(*inputs)[OUT_HEAD].asnumpy()
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, ids[:, 1:, None], -1)[..., 0]
    scored = docs[:, 1:] == docs[:, :-1]
    offset = np.array(
        [
            [t - min(s for s in range(t + 1) if row[s] == row[t]) for t in range(len(row))]
            for row in attention_docs[:, :-1]
        ]
    )
    beyond = scored & (offset >= TRAINED)
    return nll[scored].mean(), (nll[beyond].mean() if beyond.any() else None)


def test_loss_per_length_and_type_matches_numpy_log_softmax_on_independently_packed_windows(
    report, tiny_run, english_valid
):
    _, model_cfg, tokenizer_path = tiny_run
    checkpoint = Path(report["checkpoint"])
    assert report["trained_length"] == TRAINED  # read back from the run's resolved_config.yaml
    expected_scaling = {
        "none": RopeScalingConfig(),
        "dynamic_ntk": RopeScalingConfig(type="dynamic_ntk", factor=FACTOR, original_max_position=TRAINED),
    }
    assert [(row["scaling"], row["length"]) for row in report["rows"]] == [
        (name, length) for length in LENGTHS for name in ("none", "dynamic_ntk")
    ]
    for row in report["rows"]:
        ids, docs = reference_windows(tokenizer_path, english_valid, row["length"])
        loss, loss_beyond = reference_losses(model_cfg, checkpoint, expected_scaling[row["scaling"]], ids, docs)
        assert row["loss"] == pytest.approx(loss, abs=2e-5), row
        assert row["ppl"] == pytest.approx(np.exp(loss), rel=1e-4)
        if row["length"] == TRAINED:
            assert row["loss_beyond"] is None and row["beyond_tokens"] == 0
        else:
            assert row["loss_beyond"] == pytest.approx(loss_beyond, abs=2e-5), row


def test_a_copied_checkpoint_evaluates_with_its_own_tokenizer_and_config(report, tiny_run, english_valid, tmp_path):
    """Copied elsewhere, with its run directory and its tokenizer's cache deleted, a checkpoint still
    evaluates: tokenizer and trained length come from the files it carries."""
    checkpoint, model_cfg, tokenizer_path = tiny_run
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copyfile(tokenizer_path, cache / "spm.model")
    model = MoETransformer(model_cfg, seed=5)
    load_model_weights(list(model.get_parameters()), checkpoint)
    carried = CarriedFiles.of_run(cache / "spm.model", f"data:\n  seq_len: {TRAINED}\n")
    saved = save_checkpoint(
        tmp_path / "run" / "checkpoints",
        7,
        list(model.get_parameters()),
        [],
        {"model_config": dataclasses.asdict(model_cfg)},
        1,
        None,
        carried,
    )
    copied = shutil.copytree(saved, tmp_path / "elsewhere" / saved.name)
    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(cache)
    cfg = compose_config(
        [
            f"checkpoint={copied}",
            f"data.train_files=[{english_valid}]",
            f"data.valid_files=[{english_valid}]",
            f"data.cache_dir={tmp_path / 'data_cache'}",
            "data.num_proc=1",
            f"eval.context_lengths=[{TRAINED}]",
            "eval.scaling_types=[none]",
            f"eval.max_windows={MAX_WINDOWS}",
            "eval.batch_size=2",
        ]
    )
    copied_report = evaluate_checkpoint(cfg)
    assert copied_report["trained_length"] == TRAINED  # from the checkpoint's config.yaml
    expected = [row["loss"] for row in report["rows"] if (row["scaling"], row["length"]) == ("none", TRAINED)]
    assert [row["loss"] for row in copied_report["rows"]] == pytest.approx(expected, abs=1e-6)


def test_dynamic_ntk_equals_none_up_to_the_trained_length_and_differs_beyond(report):
    loss = {(row["scaling"], row["length"]): row["loss"] for row in report["rows"]}
    assert loss["dynamic_ntk", TRAINED] == pytest.approx(loss["none", TRAINED], abs=1e-6)
    assert abs(loss["dynamic_ntk", LENGTHS[1]] - loss["none", LENGTHS[1]]) > 1e-3


def test_each_length_packs_its_own_windows_and_the_table_names_them(report):
    columns = report["columns"]
    assert [column["length"] for column in columns] == LENGTHS
    assert len({column["data_cache_key"] for column in columns}) == len(LENGTHS)
    assert all(column["windows"] == MAX_WINDOWS for column in columns)
    table = markdown(report)
    assert "| none | " in table and "| dynamic_ntk | " in table and f"L={LENGTHS[1]} (3×)" in table
    assert "attention within each document" in table and f"At L={LENGTHS[1]} (3×)" in table


def test_cross_document_attention_reaches_the_window_and_scores_the_same_labels(tiny_run, english_valid):
    checkpoint, model_cfg, tokenizer_path = tiny_run
    ids, docs = reference_windows(tokenizer_path, english_valid, LENGTHS[1], count=10_000)
    # Windows where a document starts after the trained length, so crossing documents matters.
    with_boundary = np.flatnonzero((np.diff(docs[:, TRAINED:-1], axis=1) != 0).any(axis=1))[:2]
    ids, docs = ids[with_boundary], docs[with_boundary]
    model = MoETransformer(model_cfg, seed=0, moe=MoEConfig(dispatch="dropless"))
    load_model_weights(list(model.get_parameters()), checkpoint)
    result = evaluate_model(model, [{"input_ids": ids, "doc_ids": docs}], TRAINED, cross_document=True)
    loss, loss_beyond = reference_losses(model_cfg, checkpoint, RopeScalingConfig(), ids, docs, cross_document=True)
    assert result["loss"] == pytest.approx(loss, abs=2e-5)
    assert result["loss_beyond"] == pytest.approx(loss_beyond, abs=2e-5)
    scored = docs[:, 1:] == docs[:, :-1]
    assert result["scored_tokens"] == scored.sum()
    assert result["beyond_tokens"] == scored[:, TRAINED:].sum()
    within_loss, _ = reference_losses(model_cfg, checkpoint, RopeScalingConfig(), ids, docs)
    assert abs(loss - within_loss) > 1e-3


def test_static_scaling_changes_the_logits_even_within_the_trained_length(tiny_run):
    """Why the table's trained-length column differs by type: linear/ntk/yarn move every frequency."""
    _, model_cfg, _ = tiny_run
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, model_cfg.vocab_size, (1, TRAINED)).astype(np.int32))
    docs = Tensor(np.zeros((1, TRAINED), np.int32))
    logits = {}
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        for scaling in (
            RopeScalingConfig(),
            RopeScalingConfig(type="linear", factor=FACTOR),
            RopeScalingConfig(type="dynamic_ntk", factor=FACTOR, original_max_position=TRAINED),
        ):
            model = MoETransformer(dataclasses.replace(model_cfg, rope_scaling=scaling), seed=3)
            logits[scaling.type] = model(ids, docs)[OUT_HEAD].asnumpy()
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert np.abs(logits["linear"] - logits["none"]).max() > 1e-3
    np.testing.assert_allclose(logits["dynamic_ntk"], logits["none"], atol=1e-5)


def test_context_offsets_count_from_the_document_start_or_the_window_start():
    doc_ids = np.array([[0, 0, 0, 1, 1, 2], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(
        context_offsets(doc_ids, cross_document=False), [[0, 1, 2, 0, 1, 0], [0, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(context_offsets(doc_ids, cross_document=True), [list(range(6))] * 2)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("context_lengths", [], r"eval.context_lengths=\[\]: must list at least one"),
        ("scaling_types", ["none", "rope2"], r"eval.scaling_types=\['none', 'rope2'\]: must be a non-empty list"),
        ("factor", 0.5, r"eval.factor=0.5: must be 0 \(L / trained length per column\) or >= 1"),
        ("dispatch", "gshard", r"eval.dispatch='gshard': must be one of"),
    ],
)
def test_invalid_eval_keys_fail_naming_the_key(field, value, message):
    with pytest.raises(ValueError, match=message):
        validate_eval_config(dataclasses.replace(EvalConfig(), **{field: value}))


def run_eval_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mindmoe.train.evaluation.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HYDRA_FULL_ERROR="0"),
    )


def test_cli_rejects_a_missing_checkpoint_naming_it(tmp_path):
    missing = tmp_path / "checkpoints" / "step_000100"
    result = run_eval_cli(f"checkpoint={missing}", f"hydra.run.dir={tmp_path / 'eval'}")
    assert result.returncode == 2
    assert f"checkpoint {missing}: no model.safetensors found" in result.stderr + result.stdout


def test_unset_checkpoint_is_rejected_with_the_key_to_set():
    with pytest.raises(ValueError, match=r"checkpoint is not set: pass checkpoint=<run dir>/checkpoints/step_NNNNNN"):
        evaluate_checkpoint(compose_config([]))
