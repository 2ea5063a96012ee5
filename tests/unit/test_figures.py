"""Figures that say what they measure: training FLOPs per token (MFU's numerator), the per-layer
routing metrics, and the parameter count the docs quote for the default tiny model.

The FLOPs are counted by hand below for one tiny config: 2 FLOPs per weight element and token
forward, 2 for the gradient of the weight's input, 2 more for the weight's own gradient only when
the weight trains (LoRA freezes the base), plus the causal attention term.
"""

import re
from pathlib import Path

import numpy as np

from mindmoe.data.config import DataConfig
from mindmoe.model.config import ModelConfig
from mindmoe.model.lora import LoraConfig
from mindmoe.model.lora.plan import plan_adapters
from mindmoe.model.param_count import count_parameters
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.metrics import param_table, per_layer_metrics, train_flops_per_token

REPO = Path(__file__).resolve().parents[2]
SEQ = 8
# H 16, N 4, G 2, D 4; layer 0 dense (FFN 24), layer 1 MoE: 4 experts of width 8, top-2, 1 shared.
CFG = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    num_layers=2,
    first_k_dense=1,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=24,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=8,
    num_shared_experts=1,
    max_position_embeddings=32,
)
# Weight elements one token multiplies through (by hand, biases/norms/embedding lookup excluded):
ATTENTION = 2 * (16 * 16 + 16 * 8 + 16 * 8 + 16 * 16)  # q, k, v, o in both layers = 1536
DENSE_FFN = 3 * 16 * 24  # 1152
ROUTER = 4 * 16  # 64
ROUTED = 2 * 3 * 16 * 8  # top-2 of the experts: 768
SHARED = 3 * 16 * 8  # 384
LM_HEAD = 32 * 16  # 512
# Causal attention: 6 * layers * S * heads * head_dim.
SCORES = 6 * 2 * SEQ * 4 * 4  # 1536


def test_full_training_counts_six_flops_per_weight_element():
    weights = ATTENTION + DENSE_FFN + ROUTER + ROUTED + SHARED + LM_HEAD
    expected = 6 * weights + SCORES
    table = param_table(MoETransformer(CFG, seed=0))
    assert train_flops_per_token(CFG, SEQ, table) == expected
    assert train_flops_per_token(CFG, SEQ) == expected  # None = every parameter trains


def test_lora_counts_four_per_frozen_weight_and_six_per_adapter_element():
    lora = LoraConfig(enabled=True, r=2, target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"])
    model = MoETransformer(CFG, seed=0, lora=plan_adapters(CFG, lora, seed=0))
    # Adapter elements per token, r = 2: A [r, in] + B [out, r].
    adapters = (
        2 * (2 * 16 + 16 * 2)  # q_proj 16 -> 16, both layers
        + 2 * (2 * 16 + 8 * 2)  # v_proj 16 -> 8, both layers
        + (2 * 24 + 16 * 2)  # dense down_proj 24 -> 16
        + (2 * 8 + 16 * 2)  # shared expert down_proj 8 -> 16
        + 2 * (2 * 8 + 16 * 2)  # routed experts' down_proj, 2 of 4 per token
    )
    assert adapters == 448
    frozen = ATTENTION + DENSE_FFN + ROUTER + ROUTED + SHARED
    expected = 4 * frozen + 6 * LM_HEAD + 6 * adapters + SCORES  # lm_head is a module_to_save: trained
    assert train_flops_per_token(CFG, SEQ, param_table(model)) == expected
    assert expected < train_flops_per_token(CFG, SEQ)


def test_routed_expert_shards_count_per_token_like_the_whole_layer():
    """Under expert parallelism a process holds E/ep experts; a token still passes through top_k."""
    table = param_table(MoETransformer(CFG, seed=0))
    sharded = {
        name: ((shape[0] // 2,) + shape[1:], trained) if ".mlp.experts." in name else (shape, trained)
        for name, (shape, trained) in table.items()
    }
    assert train_flops_per_token(CFG, SEQ, sharded) == train_flops_per_token(CFG, SEQ, table)


def test_dropped_assignments_count_token_expert_pairs_per_layer():
    # Two MoE layers, 3 experts: chosen vs kept assignments per expert.
    chosen_LE = np.array([[4, 2, 2], [3, 3, 2]])
    kept_LE = np.array([[3, 2, 2], [3, 1, 2]])
    routing_L3E = np.stack([chosen_LE, kept_LE, np.zeros_like(chosen_LE)], axis=1)
    row = per_layer_metrics(routing_L3E, np.zeros((2, 5)))
    assert row["dropped_assignments"] == [1.0, 2.0]
    assert "dropped_tokens" not in row


def test_documented_tiny_model_size_is_the_parameter_count():
    """The default model at the default tokenizer size: docs/configuration.md (the default recipe) and
    conf/model/tiny_moe.yaml quote it."""
    total = count_parameters(ModelConfig(vocab_size=DataConfig().vocab_size)).total
    assert total == 4_259_520
    figure = f"{total:,}"
    yaml_text = (REPO / "conf/model/tiny_moe.yaml").read_text()
    configuration = (REPO / "docs/configuration.md").read_text()
    assert f"{figure} parameters" in yaml_text
    assert f"{figure} parameters" in configuration
    # No other figure for the default model survives, in the README or any docs page.
    docs = "".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    stale = re.findall(r"(?:3\.3|4\.26) ?M parameters", docs + yaml_text)
    assert not stale, stale


def test_bench_activation_memory_comes_from_the_kept_shapes():
    """The quick bench's dense model, by hand: H 64, 2 layers, N 4, G 2, D 16, FFN 64, V 256, S 32."""
    from mindmoe.bench.specs import QUICK, activation_bytes, model_config

    cfg = model_config(QUICK, "dense")
    keys = 32  # S 32 is one causal chunk: every query's row of the score matrix is computed
    attention = 4 * 64 + (64 + 2 * 32) + (64 + 32) + 4 * keys + 64  # norms, qkv, q/k roped, probs, out
    ffn = 4 * 64  # gate, up, silu(gate), product
    once = 64 + 2 * 64 + 2 * 256 + 4 * keys  # embedding, final norm, logits + softmax, mask
    per_token = 2 * (attention + ffn) + once
    assert activation_bytes(cfg, 2, 32) == 4 * per_token * 2 * 32
    assert activation_bytes(cfg, 4, 32) == 2 * activation_bytes(cfg, 2, 32)  # linear in the batch
