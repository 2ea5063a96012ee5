"""RoPE scaling against HF transformers 4.57.1: rotated queries and keys (``Glm4MoeRotaryEmbedding`` with its
``dynamic_rope_update``, ``glm4_moe.apply_rotary_pos_emb`` for rotate_half, ``glm.apply_rotary_pos_emb`` for
interleaved), dynamic NTK inside compiled graphs, and the whole model (``Glm4MoeForCausalLM``).
"""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor, nn, ops
from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as hf_apply_interleaved
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeForCausalLM,
    Glm4MoeRotaryEmbedding,
)
from transformers.models.glm4_moe.modeling_glm4_moe import (
    apply_rotary_pos_emb as hf_apply_rotate_half,
)

from mindmoe.model.rope import RotaryEmbedding, apply_rope, rope_tables
from mindmoe.model.rope_scaling import (
    RopeScalingConfig,
    default_inv_freq,
)
from mindmoe.model.transformer import MoETransformer
from tests.helpers.rope_scaling import BASE, FACTOR, HEAD_DIM, ROTARY_DIM, RopeTables, hf_rope_config
from tests.unit.test_transformer_hf import (
    DROPLESS,
    VOCAB,
    hf_config,
    hf_logits,
    ours_config,
    randomize,
    to_hf_state_dict,
)

TABLE_POSITIONS = 1024
DYNAMIC_ORIG = 16
SPACED = np.arange(0, 300, 7)  # crosses yarn's original context of 256
# name: (ours, HF rope_scaling, HF max_position_embeddings, positions)
ROTATION_CASES = {
    "linear": (RopeScalingConfig("linear", 4.0), {"rope_type": "linear", "factor": 4.0}, TABLE_POSITIONS, SPACED),
    # HF 4.57.1 "dynamic" takes L_orig from max_position_embeddings; ours from original_max_position.
    "dynamic_below_original": (
        RopeScalingConfig("dynamic_ntk", 4.0, original_max_position=DYNAMIC_ORIG),
        {"rope_type": "dynamic", "factor": 4.0},
        DYNAMIC_ORIG,
        np.arange(12),
    ),
    "dynamic_above_original": (
        RopeScalingConfig("dynamic_ntk", 4.0, original_max_position=DYNAMIC_ORIG),
        {"rope_type": "dynamic", "factor": 4.0},
        DYNAMIC_ORIG,
        np.arange(40),
    ),
    "yarn": (
        RopeScalingConfig("yarn", 4.0, original_max_position=256),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        TABLE_POSITIONS,
        SPACED,
    ),
    # No original_max_position: both fall back to max_position_embeddings.
    "yarn_custom_betas_and_attention_factor": (
        RopeScalingConfig("yarn", 8.0, beta_fast=16.0, beta_slow=2.0, attention_factor=1.5),
        {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.5},
        TABLE_POSITIONS,
        SPACED,
    ),
}


def hf_rotated(rope_scaling, max_positions, q, k, positions, interleaved):
    # A fresh rotary module per call: HF's dynamic frequencies are cached state.
    rotary = Glm4MoeRotaryEmbedding(hf_rope_config(rope_scaling, max_positions))
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(positions.astype(np.int64))[None])
    apply = hf_apply_interleaved if interleaved else hf_apply_rotate_half
    hf_q, hf_k = apply(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    return hf_q.numpy(), hf_k.numpy()


class RotatedQK(nn.Cell):
    """The model's path: positions -> RotaryEmbedding -> apply_rope on q and k (compiled, GRAPH_MODE)."""

    def __init__(self, rope, interleaved):
        super().__init__()
        self.rope = rope
        self.interleaved = interleaved

    def construct(self, q_BNSD, k_BGSD, positions_S):
        cos, sin = self.rope(positions_S)
        return apply_rope(q_BNSD, cos, sin, self.interleaved), apply_rope(k_BGSD, cos, sin, self.interleaved)


class RotatedQ(nn.Cell):
    """As the model does it: positions 0..S-1 taken from the input's (possibly dynamic) shape."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def construct(self, q_BNSD):
        cos, sin = self.rope(ops.arange(q_BNSD.shape[2], dtype=ms.int32))
        return apply_rope(q_BNSD, cos, sin, False)


def random_qk(seq_len, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(2, 4, seq_len, HEAD_DIM)).astype(np.float32),
        rng.normal(size=(2, 2, seq_len, HEAD_DIM)).astype(np.float32),
    )


def dynamic_rope(original=DYNAMIC_ORIG, interleaved=False):
    return RotaryEmbedding(
        ROTARY_DIM,
        BASE,
        TABLE_POSITIONS,
        RopeScalingConfig("dynamic_ntk", FACTOR, original_max_position=original),
        interleaved,
    )


def hf_dynamic_rotated_q(q):
    positions = np.arange(q.shape[2])
    return hf_rotated({"rope_type": "dynamic", "factor": FACTOR}, DYNAMIC_ORIG, q, q[:, :2], positions, False)[0]


# ---------------------------------------------------------------- rotated q/k vs HF rotary helpers


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("case", sorted(ROTATION_CASES))
def test_rotated_query_and_key_match_hf_rotary_helpers(case, interleaved):
    ours_cfg, hf_scaling, hf_max_positions, positions = ROTATION_CASES[case]
    q, k = random_qk(len(positions))
    hf_q, hf_k = hf_rotated(hf_scaling, hf_max_positions, q, k, positions, interleaved)
    rope = RotaryEmbedding(ROTARY_DIM, BASE, TABLE_POSITIONS, ours_cfg, interleaved)
    ours_q, ours_k = RotatedQK(rope, interleaved)(Tensor(q), Tensor(k), Tensor(positions.astype(np.int32)))
    np.testing.assert_allclose(ours_q.asnumpy(), hf_q, atol=2e-5, rtol=0)
    np.testing.assert_allclose(ours_k.asnumpy(), hf_k, atol=2e-5, rtol=0)
    # Channels past the rotary dim pass through.
    np.testing.assert_array_equal(ours_q.asnumpy()[..., ROTARY_DIM:], q[..., ROTARY_DIM:])


# ---------------------------------------------------------------- dynamic NTK inside compiled graphs


def test_dynamic_ntk_in_ms_jit_follows_the_runtime_length_below_and_above_the_original():
    rope = dynamic_rope()

    @ms.jit
    def rotate_query(q_BNSD):
        cos, sin = rope(ops.arange(q_BNSD.shape[2], dtype=ms.int32))
        return apply_rope(q_BNSD, cos, sin, False)

    for seq_len in (12, 40):  # below and above DYNAMIC_ORIG; the same jitted function
        q, _ = random_qk(seq_len)
        np.testing.assert_allclose(rotate_query(Tensor(q)).asnumpy(), hf_dynamic_rotated_q(q), atol=2e-5, rtol=0)


def test_dynamic_ntk_one_graph_with_dynamic_shapes_serves_every_length():
    net = RotatedQ(dynamic_rope())
    net.set_inputs(Tensor(shape=[None, None, None, HEAD_DIM], dtype=ms.float32))
    for seq_len in (40, 12, 25):
        q, _ = random_qk(seq_len)
        np.testing.assert_allclose(net(Tensor(q)).asnumpy(), hf_dynamic_rotated_q(q), atol=2e-5, rtol=0)
    assert len(net.compile_cache) == 1, "one compiled graph must serve all three lengths"


def test_dynamic_ntk_with_enable_dynamic_jit_follows_the_runtime_length():
    rope = dynamic_rope()

    @ms.enable_dynamic(q_BNSD=Tensor(shape=[None, None, None, HEAD_DIM], dtype=ms.float32))
    @ms.jit
    def rotate_query(q_BNSD):
        cos, sin = rope(ops.arange(q_BNSD.shape[2], dtype=ms.int32))
        return apply_rope(q_BNSD, cos, sin, False)

    for seq_len in (12, 40):
        q, _ = random_qk(seq_len)
        np.testing.assert_allclose(rotate_query(Tensor(q)).asnumpy(), hf_dynamic_rotated_q(q), atol=2e-5, rtol=0)


def test_dynamic_ntk_exported_mindir_with_dynamic_shapes_follows_the_runtime_length(tmp_path):
    ms.export(
        RotatedQ(dynamic_rope()),
        Tensor(shape=[None, None, None, HEAD_DIM], dtype=ms.float32),
        file_name=str(tmp_path / "rope"),
        file_format="MINDIR",
    )
    graph = nn.GraphCell(ms.load(str(tmp_path / "rope.mindir")))
    for seq_len in (12, 40):
        q, _ = random_qk(seq_len)
        np.testing.assert_allclose(graph(Tensor(q)).asnumpy(), hf_dynamic_rotated_q(q), atol=2e-5, rtol=0)


def test_dynamic_ntk_equals_plain_rope_up_to_the_original_length():
    cos, sin = RopeTables(dynamic_rope(original=64))(Tensor(np.arange(64, dtype=np.int32)))
    plain_cos, plain_sin = rope_tables(default_inv_freq(ROTARY_DIM, BASE), 64, interleaved=False)
    np.testing.assert_allclose(cos.asnumpy(), plain_cos.asnumpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(sin.asnumpy(), plain_sin.asnumpy(), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- whole model vs HF Glm4MoeForCausalLM

MODEL_LAYERS, MODEL_HEAD_DIM, MODEL_TABLES = 2, 16, 64  # one dense and one MoE layer
MODEL_CASES = {
    # name: (ours, HF rope_scaling, HF max_position_embeddings, sequence lengths)
    "linear": (RopeScalingConfig("linear", 4.0), {"rope_type": "linear", "factor": 4.0}, MODEL_TABLES, (24,)),
    "dynamic": (
        RopeScalingConfig("dynamic_ntk", 4.0, original_max_position=8),
        {"rope_type": "dynamic", "factor": 4.0},
        8,
        (24, 6),
    ),
    "yarn": (
        RopeScalingConfig("yarn", 4.0, original_max_position=16),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        MODEL_TABLES,
        (24,),
    ),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_logits_match_hf_glm4_moe_with_the_same_rope_scaling(case):
    scaling, hf_scaling, hf_max_positions, seq_lens = MODEL_CASES[case]
    cfg = ours_config(
        num_layers=MODEL_LAYERS, head_dim=MODEL_HEAD_DIM, max_position_embeddings=MODEL_TABLES, rope_scaling=scaling
    )
    ours = MoETransformer(cfg, seed=0, moe=DROPLESS)  # HF's MoE layers drop no token
    randomize(ours, seed=4)
    if case == "dynamic":
        # One graph for every length, as in an exported MindIR: the frequencies follow the input.
        ours.set_inputs(Tensor(shape=[None, None], dtype=ms.int32), Tensor(shape=[None, None], dtype=ms.int32))
    config = hf_config(cfg)
    config.head_dim = MODEL_HEAD_DIM
    config.max_position_embeddings = hf_max_positions
    config.rope_scaling = hf_scaling
    hf = Glm4MoeForCausalLM(config).eval()
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    plain_config = hf_config(
        ours_config(num_layers=MODEL_LAYERS, head_dim=MODEL_HEAD_DIM, max_position_embeddings=MODEL_TABLES)
    )
    plain_config.head_dim = MODEL_HEAD_DIM
    plain_hf = Glm4MoeForCausalLM(plain_config).eval()
    plain_hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    # dynamic: 24 tokens stretch the frequencies past the original 8, then 6 tokens use plain RoPE again.
    for seq_len in seq_lens:
        ids = np.random.default_rng(seq_len).integers(0, VOCAB, size=(2, seq_len)).astype(np.int32)
        logits = ours(Tensor(ids), Tensor(np.zeros_like(ids)))[0].asnumpy()
        expected = hf_logits(hf, ids)
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
        scaled = seq_len > 8 or case != "dynamic"
        assert scaled != np.allclose(expected, hf_logits(plain_hf, ids), atol=1e-3), (
            "the scaling must change the logits exactly where it applies"
        )
    if case == "dynamic":
        assert len(ours.compile_cache) == 1
