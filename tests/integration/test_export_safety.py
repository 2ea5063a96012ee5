"""Safe export (issue 22, Found 7 and the export/generate messages of Found 11): ``export.out`` must be
empty unless ``export.overwrite=true``, never the source or beside it in either direction, and is written
whole or not at all; ``mindmoe-generate`` names the prompt length and ``max_position_embeddings``.

One whole export (MindIR, from the bundled ``data/samples/tiny_base``) through the command line; the refusals
and the injected failure run ``run_export`` in-process and stop before a model is built.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mindmoe.conf.exit_codes import CONFIG_ERROR
from mindmoe.train.export import exporter as export_module
from mindmoe.train.export.exporter import run_export
from mindmoe.train.export.target import check_export_target, staged_export
from tests.helpers.runs import compose_config

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "data" / "samples" / "tiny_base"
#: A user's files in the directory named as export.out (a sentencepiece tokenizer is exported, so a
#: tokenizer_config.json left there would sit beside a tokenizer it does not describe).
USER_FILES = {
    "tokenizer.model": b"my own tokenizer",
    "manifest.json": b'{"mine": true}',
    "CONVERT.md": b"my notes",
    "tokenizer_config.json": b'{"tokenizer_class": "Stale"}',
}


def run_cli(module: str, *args: str):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO, timeout=600)


def snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def siblings(out: Path) -> list:
    """Hidden staging or old directories of ``out`` left beside it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.fixture(scope="module")
def overwritten(tmp_path_factory):
    """``export.out`` holding a user's files: refused without ``export.overwrite`` (files unchanged), then
    exported with it. Returns ``(out, the refusal's message, files before the refusal, CLI result)``."""
    out = tmp_path_factory.mktemp("safety") / "serving"
    out.mkdir()
    for name, data in USER_FILES.items():
        (out / name).write_bytes(data)
    (out / "extra").mkdir()
    (out / "extra" / "keep_me.txt").write_bytes(b"user data")
    before = snapshot(out)
    args = [f"model.pretrained={BASE}", f"export.out={out}", "export.ascend_prompt_lengths=[16]"]
    with pytest.raises(ValueError) as refused:
        run_export(compose_config(args), out.parent / "hydra_refused", args)
    after_refusal = snapshot(out)
    assert after_refusal == before
    result = run_cli(
        "mindmoe.train.export.cli", *args, "export.overwrite=true", f"hydra.run.dir={out.parent / 'hydra'}"
    )
    return out, str(refused.value), before, result


def test_non_empty_out_is_refused_naming_it_and_its_files(overwritten):
    out, message, _, _ = overwritten
    assert f"export.out={out} is not empty (5 entries: " in message
    for name in (*USER_FILES, "extra"):
        assert name in message
    assert "export.overwrite=true" in message


def test_overwrite_replaces_the_directory_as_a_whole(overwritten):
    out, _, before, result = overwritten
    assert result.returncode == 0, result.stderr[-3000:]
    files = snapshot(out)
    assert {"prefill.mindir", "decode.mindir", "manifest.json", "CONVERT.md", "tokenizer.model"} <= set(files)
    assert files["tokenizer.model"] == (BASE / "tokenizer.model").read_bytes()
    assert files["manifest.json"] != before["manifest.json"]
    # Nothing of the old directory is left: no stale tokenizer_config.json, no user subdirectory.
    assert "tokenizer_config.json" not in files and "extra/keep_me.txt" not in files
    assert siblings(out) == []


def test_generate_with_a_too_long_prompt_names_its_length_and_the_positions(overwritten):
    out, _, _, result = overwritten
    assert result.returncode == 0, result.stderr[-3000:]
    prompt = "the river " * 3000  # > 4096 tokens (the tiny base's max_position_embeddings)
    generated = run_cli("mindmoe.train.export.generate_cli", str(out), "--prompt", prompt, "--max-new-tokens", "8")
    assert generated.returncode == CONFIG_ERROR, generated.stderr[-2000:]
    error = generated.stderr.strip().splitlines()[-1]
    assert "tokens long, but the model's max_position_embeddings=4096 leaves no room" in error
    assert "at most 4095 tokens" in error and "max-new-tokens" not in error


@pytest.mark.parametrize("where", ["source", "inside", "parent"])
def test_export_into_the_source_hf_directory_is_refused_with_nothing_written(where, tmp_path):
    """Found 11: ``model.pretrained=D export.out=D`` failed in shutil with SameFileError after writing weights."""
    source = Path(shutil.copytree(BASE, tmp_path / "models" / "base"))
    out = {"source": source, "inside": source / "export", "parent": source.parent}[where]
    before = snapshot(tmp_path)
    for overwrite in ("false", "true"):
        args = [f"model.pretrained={source}", "export.format=hf", f"export.out={out}", f"export.overwrite={overwrite}"]
        with pytest.raises(ValueError) as error:
            run_export(compose_config(args), tmp_path / "run", args)
        assert f"export.out={out}" in str(error.value) and f"model.pretrained={source}" in str(error.value)
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()
    assert siblings(out) == []


@pytest.mark.parametrize("previous", [False, True])
def test_a_failing_export_leaves_export_out_as_it_was(previous, tmp_path, monkeypatch):
    """The writer fails half-way (after writing a file): no export.out (or the previous one, untouched)
    and no staging directory are left."""

    def half_written(source, overrides, adapter, model_type, staging):
        (staging / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "write_hf_export", half_written)
    out = tmp_path / "hf"
    if previous:
        out.mkdir()
        (out / "config.json").write_text("{}")
    args = [
        f"model.pretrained={BASE}",
        "export.format=hf",
        f"export.out={out}",
        f"export.overwrite={str(previous).lower()}",
    ]
    with pytest.raises(RuntimeError, match="disk full"):
        run_export(compose_config(args), tmp_path / "run", args)
    assert (snapshot(out) == {"config.json": b"{}"}) if previous else not out.exists()
    assert siblings(out) == []


def test_an_interrupted_staging_is_removed_and_a_dead_process_leftover_too(tmp_path):
    out = tmp_path / "export"
    leftover = tmp_path / ".export.tmp-999999999"  # no such pid
    leftover.mkdir()
    target = check_export_target(str(out), {})
    with pytest.raises(KeyboardInterrupt):
        with staged_export(target) as staging:
            (staging / "prefill.mindir").write_bytes(b"partial")
            raise KeyboardInterrupt
    assert not out.exists() and siblings(out) == []


@pytest.mark.parametrize(
    "layout, message",
    [
        ("file", "is a file, not a directory"),
        ("checkpoint_parent", "contains the export's source checkpoint="),
        ("cwd", "which holds the working directory"),
    ],
)
def test_other_targets_that_cannot_be_written(layout, message, tmp_path, monkeypatch):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    out = {"file": tmp_path / "a_file", "checkpoint_parent": tmp_path / "run", "cwd": tmp_path / "work"}[layout]
    if layout == "file":
        out.write_text("x")
    if layout == "cwd":
        (out / "inner").mkdir(parents=True)
        monkeypatch.chdir(out / "inner")
    with pytest.raises(ValueError, match=message):
        check_export_target(str(out), {"checkpoint": checkpoint}, overwrite=True, run_dir=tmp_path / "hydra")
    assert os.path.exists(out)
