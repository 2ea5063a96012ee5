"""``data.tokenizer_files``: one way to open, list and copy a tokenizer (a sentencepiece file or a directory)."""

import json
import shutil

import pytest
import sentencepiece as spm

from mindmoe.data.hf_tokenizer import HFSentencePieceTokenizer
from mindmoe.data.tokenizer import Tokenizer, train_sentencepiece
from mindmoe.data.tokenizer_files import (
    copy_tokenizer,
    open_export_tokenizer,
    open_tokenizer,
    special_token_ids,
    tokenizer_files,
)

TEXTS = [f"invoice {i} was reissued on day {i % 7} for order number {i * 37}" for i in range(200)]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    return train_sentencepiece(TEXTS, 320, tmp_path_factory.mktemp("spm") / "trained")


@pytest.fixture
def hf_dir(tmp_path, spm_model):
    directory = tmp_path / "hf"
    directory.mkdir()
    shutil.copyfile(spm_model, directory / "tokenizer.model")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    (directory / "config.json").write_text(json.dumps({"model_type": "glm4_moe"}))
    (directory / "model.safetensors").write_bytes(b"not a tokenizer file")
    return directory


def test_a_sentencepiece_file_opens_and_copies_as_tokenizer_model(tmp_path, spm_model):
    tokenizer = open_tokenizer(spm_model)
    assert isinstance(tokenizer, Tokenizer)
    reference = spm.SentencePieceProcessor(model_file=str(spm_model))
    assert tokenizer.encode(TEXTS[3]) == reference.encode(TEXTS[3])
    assert special_token_ids(tokenizer) == {
        "bos_token_id": reference.bos_id(),
        "eos_token_id": reference.eos_id(),
        "pad_token_id": reference.pad_id(),
    }
    out = tmp_path / "out"
    out.mkdir()
    assert copy_tokenizer(spm_model, out) == ["tokenizer.model"]
    assert (out / "tokenizer.model").read_bytes() == spm_model.read_bytes()
    assert tokenizer_files(spm_model) == [spm_model]
    assert isinstance(open_export_tokenizer(out), Tokenizer)


def test_a_directory_copies_only_its_tokenizer_files(tmp_path, hf_dir):
    assert isinstance(open_tokenizer(hf_dir), HFSentencePieceTokenizer)
    out = tmp_path / "out"
    out.mkdir()
    assert copy_tokenizer(hf_dir, out) == ["tokenizer_config.json", "tokenizer.model"]
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    # The cache key of prepared data hashes what decides token ids and chat rendering, config.json included.
    assert [p.name for p in tokenizer_files(hf_dir)] == ["tokenizer.model", "tokenizer_config.json", "config.json"]
    assert copy_tokenizer(None, out) == []


def test_missing_tokenizers_name_the_directory(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        copy_tokenizer(empty, tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        open_export_tokenizer(empty)
    with pytest.raises(FileNotFoundError, match="data.tokenizer: .*neither tokenizer.json nor tokenizer.model"):
        open_tokenizer(empty)
