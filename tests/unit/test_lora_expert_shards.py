"""LoRA on a process holding a share of the experts (``parallel.ep``): a process holding experts ``held``
gets exactly those rows of the adapters one process builds (the random stream after them unchanged), and
those rows of a ``lora.base_checkpoint``'s expert weights."""

import dataclasses

import numpy as np
import pytest

from mindmoe.model.lora.layers import AdapterSpec
from mindmoe.model.moe.lora_experts import LoraRoutedExperts
from mindmoe.model.moe.token_dispatcher import ExpertPlacement

EXPERTS, HIDDEN, WIDTH, RANK = 4, 8, 6, 2


def build(held):
    rng = np.random.default_rng(7)
    spec = AdapterSpec(RANK, 2.0, 0.0, rng)
    experts = LoraRoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.5, rng, ("gate_proj", "down_proj"), spec, held)
    return {p.name: p.asnumpy() for p in experts.get_parameters()}, rng.standard_normal(3)


def test_a_share_of_the_experts_holds_their_rows_of_the_adapters_and_leaves_the_random_stream_alone():
    whole, after_whole = build(None)
    assert whole["gate_proj.lora_A"].shape == (EXPERTS, RANK, HIDDEN)
    for held in (range(0, 2), range(2, 4)):
        share, after_share = build(held)
        assert sorted(share) == sorted(whole)
        for name, array in share.items():
            np.testing.assert_array_equal(array, whole[name][held.start : held.stop], err_msg=name)
        np.testing.assert_array_equal(after_share, after_whole)
    assert share["down_proj.lora_B"].shape == (2, HIDDEN, RANK)


class SecondHalf(ExpertPlacement):
    """The placement of rank 1 of 2 (``parallel.ep=2``) without its collectives: the build and the load only."""

    def held_experts(self, num_experts):
        return range(num_experts // 2, num_experts)


def test_a_base_checkpoint_gives_a_share_of_the_experts_its_rows(tmp_path):
    from mindmoe.train.init_model import build_model
    from tests.helpers.base_checkpoint import save_tiny_base_checkpoint
    from tests.helpers.runs import compose_config

    _, base, saved = save_tiny_base_checkpoint(tmp_path, 1)
    cfg = compose_config([f"lora.base_checkpoint={saved}", "lora.enabled=true", "lora.r=2", "lora.base_dtype=fp32"])
    _, model = build_model(cfg, vocab_size=64, expert_dispatcher=SecondHalf())
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    for param in base.get_parameters():
        expected = param.asnumpy()
        if ".experts." in param.name:
            expected = expected[2:]
        np.testing.assert_array_equal(weights[param.name], expected, err_msg=param.name)
    assert weights["layers.1.mlp.experts.up_proj.lora_B"].shape == (2, 8, 2)


def test_a_base_checkpoint_is_hash_checked_where_it_is_read_and_only_there(tmp_path):
    """A flipped byte in the weights is refused, naming the file; one in the optimizer state, which a LoRA base
    never reads, is not hashed (under ``parallel.ep`` each rank likewise hashes only the files it reads)."""
    from mindspore import Parameter

    from mindmoe.train.checkpoints.checkpoint import CorruptCheckpointError, save_checkpoint
    from mindmoe.train.init_model import build_model
    from tests.helpers.base_checkpoint import save_tiny_base_checkpoint
    from tests.helpers.runs import compose_config

    _, base, _ = save_tiny_base_checkpoint(tmp_path / "first", 1)
    moments = [Parameter(np.ones(3, np.float32), name="adam_m.embed_tokens.weight")]
    state = {"model_config": dataclasses.asdict(base.config)}
    saved = save_checkpoint(tmp_path / "base", 1, list(base.get_parameters()), moments, state, keep_last=1)
    cfg = compose_config([f"lora.base_checkpoint={saved}", "lora.enabled=true", "lora.r=2", "lora.base_dtype=fp32"])

    def flip_a_byte(name):
        path = saved / name
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))

    flip_a_byte("optimizer.safetensors")
    build_model(cfg, vocab_size=64, expert_dispatcher=SecondHalf())
    flip_a_byte("model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors does not match its recorded sha256"):
        build_model(cfg, vocab_size=64, expert_dispatcher=SecondHalf())
