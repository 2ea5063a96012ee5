"""Self-contained checkpoints: the tokenizer, config and MoE policy a checkpoint carries, and who reads them.

A checkpoint names its tokenizer files in ``state.json`` ``tokenizer``, relative to its directory; export,
eval, resume and ``lora.base_checkpoint`` read those files and nothing outside the checkpoint.
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from mindspore import Parameter, Tensor

from mindmoe.data.hf_tokenizer import HFSentencePieceTokenizer
from mindmoe.data.tokenizer import train_sentencepiece
from mindmoe.data.tokenizer_files import open_tokenizer, special_token_ids
from mindmoe.model.config import ModelConfig
from mindmoe.model.moe_config import MoEConfig
from mindmoe.train.checkpoints.checkpoint import CarriedFiles, save_checkpoint
from mindmoe.train.checkpoints.tokenizer import checkpoint_tokenizer, run_data_config
from mindmoe.train.evaluation.evaluate import load_checkpoint_config
from mindmoe.train.export.exporter import resolve_source
from tests.helpers.runs import compose_config

#: The policy the checkpoints below were trained with (serving replays its expert locking).
TRAINED_MOE = MoEConfig(dispatch="dropless", aux_loss="seq", expert_lock=True, lock_span=4)
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
    (directory / "config.json").write_text(json.dumps({"model_type": "glm4_moe", "bos_token_id": 1}))
    (directory / "model.safetensors").write_bytes(b"weights, not a tokenizer file")
    return directory


def write_checkpoint(root, carried=None, step=3):
    params = [Parameter(Tensor(np.arange(4, dtype=np.float32)), name="w")]
    state = {"model_config": dataclasses.asdict(ModelConfig()), "moe_config": dataclasses.asdict(TRAINED_MOE)}
    return save_checkpoint(root / "checkpoints", step, params, [], state, 2, None, carried)


def edit_state(checkpoint, **changes):
    state = json.loads((checkpoint / "state.json").read_text())
    state.update(changes)
    (checkpoint / "state.json").write_text(json.dumps(state))


def test_a_checkpoint_carries_its_sentencepiece_tokenizer_and_config_hashed_like_its_weights(tmp_path, spm_model):
    checkpoint = write_checkpoint(tmp_path, CarriedFiles.of_run(spm_model, "data:\n  seq_len: 64\n"))
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["tokenizer"] == ["tokenizer.model"]
    assert {"tokenizer.model", "config.yaml"} <= set(state["files"])
    assert (checkpoint / "tokenizer.model").read_bytes() == spm_model.read_bytes()
    assert (checkpoint / "config.yaml").read_text() == "data:\n  seq_len: 64\n"
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == [checkpoint.name]  # no temporary dir
    assert checkpoint_tokenizer(checkpoint) == checkpoint / "tokenizer.model"


def test_a_hf_tokenizer_is_carried_under_tokenizer_with_its_config_json_and_opens_the_same(tmp_path, hf_dir):
    checkpoint = write_checkpoint(tmp_path, CarriedFiles.of_run(hf_dir))
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["tokenizer"] == [
        "tokenizer/config.json",
        "tokenizer/tokenizer.model",
        "tokenizer/tokenizer_config.json",
    ]
    carried = checkpoint_tokenizer(checkpoint)
    assert carried == checkpoint / "tokenizer"
    tokenizer, original = open_tokenizer(carried), open_tokenizer(hf_dir)
    assert isinstance(tokenizer, HFSentencePieceTokenizer) and tokenizer.chat_template == original.chat_template
    assert special_token_ids(tokenizer) == special_token_ids(original)
    assert tokenizer.encode("invoice 12 was reissued") == original.encode("invoice 12 was reissued")


@pytest.mark.parametrize(
    "names, expected",
    [
        (["/etc/hostname"], "'/etc/hostname' is an absolute path"),
        (["../outside.model"], "'../outside.model' leaves the checkpoint directory ('..')"),
        (["tokenizer/../../outside.model"], "leaves the checkpoint directory"),
        (["C:\\tokenizer.model"], "is an absolute path"),
        ([], "must be a non-empty list"),
        (["missing.model"], "'missing.model' is not a file of the checkpoint"),
    ],
)
def test_tokenizer_names_outside_the_checkpoint_are_refused_by_export_and_eval(tmp_path, spm_model, names, expected):
    checkpoint = write_checkpoint(tmp_path / "run", CarriedFiles.of_run(spm_model))
    (tmp_path / "outside.model").write_bytes(spm_model.read_bytes())
    edit_state(checkpoint, tokenizer=names)
    where = f"{checkpoint / 'state.json'} 'tokenizer'"
    with pytest.raises(ValueError) as exported:
        resolve_source(compose_config([f"checkpoint={checkpoint}"]), {})
    with pytest.raises(ValueError) as evaluated:
        load_checkpoint_config(str(checkpoint))
    for error in (exported, evaluated):
        assert where in str(error.value) and expected in str(error.value)


def test_a_symbolic_link_out_of_the_checkpoint_is_refused(tmp_path, spm_model):
    checkpoint = write_checkpoint(tmp_path / "run", CarriedFiles.of_run(spm_model))
    (checkpoint / "tokenizer.model").unlink()
    (checkpoint / "tokenizer.model").symlink_to(spm_model)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        checkpoint_tokenizer(checkpoint)


def test_an_older_checkpoint_recording_a_path_needs_data_tokenizer_and_its_path_is_never_read(tmp_path, spm_model):
    checkpoint = write_checkpoint(tmp_path, CarriedFiles.of_run(spm_model))
    edit_state(checkpoint, tokenizer=str(spm_model))  # what checkpoints held before they carried it
    with pytest.raises(ValueError) as error:
        resolve_source(compose_config([f"checkpoint={checkpoint}"]), {})
    assert "'tokenizer' is the path" in str(error.value) and "Pass data.tokenizer=" in str(error.value)
    given = tmp_path / "given.model"
    shutil.copyfile(spm_model, given)
    source = resolve_source(compose_config([f"checkpoint={checkpoint}", f"data.tokenizer={given}"]), {})
    assert source.tokenizer == given


def test_data_tokenizer_is_refused_for_a_checkpoint_that_carries_one(tmp_path, spm_model):
    checkpoint = write_checkpoint(tmp_path, CarriedFiles.of_run(spm_model))
    with pytest.raises(ValueError, match="carries its own tokenizer"):
        resolve_source(compose_config([f"checkpoint={checkpoint}", f"data.tokenizer={spm_model}"]), {})


def test_resume_and_lora_base_checkpoint_prepare_data_with_the_carried_tokenizer(tmp_path, spm_model):
    checkpoint = write_checkpoint(tmp_path / "run", CarriedFiles.of_run(spm_model))
    assert run_data_config(compose_config([]), checkpoint).tokenizer == str(checkpoint / "tokenizer.model")
    base = compose_config(["lora.enabled=true", f"lora.base_checkpoint={checkpoint}"])
    assert run_data_config(base, None).tokenizer == str(checkpoint / "tokenizer.model")
    # The same tokenizer given again is accepted (same files), another one is not.
    same = tmp_path / "same.model"
    shutil.copyfile(spm_model, same)
    assert run_data_config(compose_config([f"data.tokenizer={same}"]), checkpoint).tokenizer.endswith("tokenizer.model")
    other = train_sentencepiece(TEXTS[::-1][:120], 300, tmp_path / "other")
    with pytest.raises(ValueError, match=r"data.tokenizer=.*differ from those train.resume"):
        run_data_config(compose_config([f"data.tokenizer={other}"]), checkpoint)
    # An older checkpoint: the config's tokenizer, as before (its recorded path is not read).
    edit_state(checkpoint, tokenizer="/nowhere/spm.model")
    assert not run_data_config(compose_config([]), checkpoint).tokenizer


def test_export_and_eval_read_the_moe_policy_the_checkpoint_records_old_or_new(tmp_path, spm_model):
    checkpoint = write_checkpoint(tmp_path, CarriedFiles.of_run(spm_model))
    assert resolve_source(compose_config([f"checkpoint={checkpoint}"]), {}).moe_config == TRAINED_MOE
    explicit = resolve_source(compose_config([f"checkpoint={checkpoint}", "moe.lock_span=3"]), {}, {"lock_span": 3})
    assert explicit.moe_config == dataclasses.replace(TRAINED_MOE, lock_span=3)
    # A checkpoint written before the moe.* section kept the policy inside model_config.
    state = json.loads((checkpoint / "state.json").read_text())
    del state["moe_config"]
    state["model_config"].update(dataclasses.asdict(TRAINED_MOE))
    (checkpoint / "state.json").write_text(json.dumps(state))
    assert resolve_source(compose_config([f"checkpoint={checkpoint}"]), {}).moe_config == TRAINED_MOE
    assert load_checkpoint_config(str(checkpoint))[2] == ModelConfig()
