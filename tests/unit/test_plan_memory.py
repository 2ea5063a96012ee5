"""mindmoe-plan's memory model of the trainer against hand arithmetic: full training, LoRA in its base dtype,
recompute, both expert dispatchers, blockwise attention, the chunked loss, MLA, the DSA indexer, MTP depths; and
the layouts it may propose."""

import dataclasses
import re

import pytest

from mindmoe.launch.config import PlanConfig
from mindmoe.launch.plan import Batch, Layout, Setup, candidate_layouts, layout_errors, plan_layout
from mindmoe.launch.plan_cli import run_setup
from mindmoe.launch.plan_params import lora_trained
from mindmoe.model.config import ModelConfig
from mindmoe.model.lora import LoraConfig
from mindmoe.model.moe_config import MoEConfig
from tests.helpers.runs import compose_config

# Hand-worked example: h=8, 2 layers (layer 0 dense, layer 1 MoE), 4 query heads / 2 KV heads of
# width 2 (q = 8, kv = 4), QK-norm, q/k/v bias, dense FFN 16, 4 experts of width 4, top-2, one shared
# expert, a correction bias, vocab 100, untied, dropless; seq 16, micro-batch 2 (T = 32 tokens), global
# batch 8. Full training: every parameter fp32 (4 B), gradients 4 B, AdamW m and v 8 B.
HAND = dict(
    vocab_size=100,
    hidden_size=8,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    intermediate_size=16,
    first_k_dense=1,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=4,
    num_shared_experts=1,
    qkv_bias=True,
    qk_norm=True,
    expert_bias=True,
    score_func="sigmoid",
    tie_word_embeddings=False,
)
DROPLESS = MoEConfig(dispatch="dropless")
HAND_BATCH = Batch(seq_len=16, micro_batch=2, global_batch=8)
T = 32
MATRICES = 100 * 8 * 2 + 2 * (8 * 8 + 8 * 4 * 2 + 8 * 8) + 3 * 8 * 16 + 3 * 8 * 4  # embed+head, attn, dense, shared
EXPERTS = 4 * 3 * 8 * 4  # 384, split over ep
SMALL = 2 * (8 + 4 + 4) + (2 * (8 + 8 + 2 + 2) + 8) + 4 * 8  # q/k/v biases 32, norms 48, router 32
BUFFER = 4  # e_score_correction_bias, fp32, not trained
# Activation bytes per token, fp32 (c = 4): attention c(2h + 2q + 2kv) + c(q + kv) qk-norm + stored softmax c*a*s
ATTN = 4 * (16 + 16 + 8) + 4 * 12 + 4 * 4 * 16  # 464
DENSE = ATTN + 4 * (2 * 8 + 3 * 16)  # 720
MOE_K2 = ATTN + 4 * 2 * 8 + 8 * 4 + 2 * 4 * (2 * 8 + 3 * 4) + 3 * 4 * 4  # 832: r = top_k = 2
MASK = 4 * 4 * 16  # fp32 [B, a, s, s] once
FINAL_NORM = 4 * 8
KEPT = 4 * 8 * T + 4 * 100 * 8  # the gradients the loss computes in its forward: rows [T, h], head [V, h]
LOSS = 7 * 4 * 100 * T + KEPT  # one chunk holds all T: its buffers + the kept gradients


def hand_setup(device="CPU", **fields):
    """The trainer's setup of the hand-worked model: its MoE layers dropless (``moe.dispatch``)."""
    return Setup(device=device, moe=DROPLESS, **fields)


def hand_plan(layout, setup=None, batch=HAND_BATCH, **model):
    setup = setup or hand_setup()
    return plan_layout(ModelConfig(**{**HAND, **model}), layout, batch, PlanConfig(), setup)


def test_full_training_memory_matches_hand_arithmetic():
    memory = hand_plan(Layout(dp=2, ep=2, dispatcher="allgather")).memory  # 4 ranks, 2 micro-batches each
    held = MATRICES + SMALL + EXPERTS / 2
    assert memory.weights == 4 * (held + BUFFER)
    assert memory.grads == 4 * held
    assert memory.optimizer == 8 * held  # no ZeRO in the trainer: every rank keeps its moments
    assert memory.accumulation == 4 * held  # 2 micro-batches per step
    assert memory.update == 2 * 4 * held  # the copy of the sums and the clipped copy
    assert memory.activations == T * (DENSE + MOE_K2 + MASK + MOE_K2 + FINAL_NORM)  # + backward of the largest
    assert memory.loss == LOSS
    assert memory.comm == 4 * held + 2 * 2 * T * 8 * 4  # reduced gradients, expert outputs of T*K rows


def test_recompute_alltoall_blockwise_and_zero():
    recompute = hand_plan(Layout(dp=1, recompute=True)).memory
    assert recompute.activations == T * (2 * 4 * 8 + MOE_K2 + MASK + MOE_K2 + FINAL_NORM)
    assert recompute.comm == 0 and recompute.accumulation == 4 * (MATRICES + SMALL + EXPERTS)  # 4 micro-batches
    # alltoall, ep=2: each rank receives a worst-case slot from both ranks, ep * min(K, E/ep) = 4 rows a token
    routed = hand_plan(Layout(dp=2, ep=2, dispatcher="alltoall")).memory
    moe_r4 = MOE_K2 + 2 * 4 * (2 * 8 + 3 * 4)
    assert routed.activations == T * (DENSE + moe_r4 + MASK + moe_r4 + FINAL_NORM)
    # Ascend past 512 positions: blockwise attention keeps an fp32 log-sum-exp per head, no mask
    long = Batch(seq_len=1024, micro_batch=1, global_batch=1)
    tokens, attn = 1024, 4 * (16 + 16 + 8) + 4 * 12 + 4 * 4
    moe = attn + 4 * 2 * 8 + 8 * 4 + 2 * 4 * (2 * 8 + 3 * 4) + 3 * 4 * 4
    blockwise = hand_plan(Layout(dp=1), hand_setup(device="Ascend"), long).memory
    assert blockwise.activations == tokens * (attn + 4 * (2 * 8 + 3 * 16) + moe + moe + FINAL_NORM)
    full = hand_plan(Layout(dp=1), hand_setup(device="CPU"), long).memory
    assert full.activations > blockwise.activations + tokens * 4 * 4 * 1024  # the mask alone
    # parallel.zero=1: m, v and the working copy of the owned ranges, over the ranks holding the same tensors
    sharded = hand_plan(Layout(dp=2, ep=2, dispatcher="alltoall", zero=1)).memory
    owned = (MATRICES + SMALL) / 2 + EXPERTS / 2 / 1
    # the update reads the reduce-scattered ranges, and scales one range at a time (at most the embedding's 800)
    assert sharded.optimizer == 12 * owned and sharded.update == 4 * owned + 4 * 800
    # allgather: the replicated tensors are split over all 4 devices, the experts over their 2 replicas
    grouped = hand_plan(Layout(dp=2, ep=2, dispatcher="allgather", zero=1)).memory
    assert grouped.optimizer == 12 * ((MATRICES + SMALL) / 4 + EXPERTS / 2 / 2)


# Trained elements of the hand model by layer: layer 0 = attention 192 (q 64, k 32, v 32, o 64), q/k/v biases 16,
# QK-norms 4, its two norms 16, dense FFN 384; layer 1 = the same 228 without the FFN, router 32, shared expert 96,
# routed experts 384 (over ep); outside: embedding 800, head 800, final norm 8.
LAYER_1 = 228 + 32 + 96
EMBEDDING = 800
TRAINED = MATRICES + SMALL + EXPERTS


def test_zero2_and_zero3_state_and_gathered_weights_match_hand_arithmetic():
    assert 612 + LAYER_1 + EXPERTS + 2 * EMBEDDING + 8 == TRAINED == 2960
    # ZeRO-3 on 4 ranks, one micro-batch each: the weights, moments and update copy are the owned quarters; whole
    # gradients exist for the largest tensor group (the embedding or the head, 800 > layer 1's 740) besides them.
    three = hand_plan(Layout(dp=4, zero=3)).memory
    owned = TRAINED / 4
    assert three.weights == 4 * BUFFER + 4 * owned
    assert three.grads == 4 * EMBEDDING + 4 * owned and three.comm == 4 * EMBEDDING
    assert three.optimizer == 8 * owned and three.accumulation == 0 and three.update == 4 * EMBEDDING / 4
    assert three.gathered == 4 * TRAINED  # without recompute every all-gathered weight is kept for the backward
    # With recompute: one layer (two on Ascend) and the embedding or head, in the dtype the weights are stored in.
    kept_one = hand_plan(Layout(dp=4, zero=3, recompute=True)).memory
    assert kept_one.gathered == 4 * (LAYER_1 + EXPERTS + EMBEDDING)
    ascend = hand_plan(Layout(dp=4, zero=3, recompute=True), hand_setup("Ascend", compute_dtype="bf16")).memory
    assert ascend.gathered == 2 * (2 * (LAYER_1 + EXPERTS) + EMBEDDING)
    # Half-precision weights (fp16 on CPU): stored ranges of 2 bytes, fp32 masters beside the moments, gathered in
    # fp16; several ranks without ZeRO are refused, as the trainer refuses them.
    half = hand_setup(compute_dtype="fp16")
    halves = hand_plan(Layout(dp=4, zero=3, recompute=True), half)
    assert halves.memory.weights == 4 * BUFFER + 2 * owned and halves.memory.optimizer == 12 * owned
    assert halves.memory.gathered == 2 * (LAYER_1 + EXPERTS + EMBEDDING)
    assert halves.comm.all_gather == 2 * 2 * TRAINED  # fp16 weights, gathered again for the recomputed backward
    with pytest.raises(ValueError, match="train.dtype=fp16 keeps fp32 masters in ZeRO ranges"):
        hand_plan(Layout(dp=2), half)
    assert hand_plan(Layout(dp=1), half).memory.optimizer == 12 * TRAINED  # one process: whole masters
    # ZeRO-2 on 2 ranks, 2 micro-batches each: whole weights; ranges for the moments, working copies, sums, copies.
    two = hand_plan(Layout(dp=2, zero=2)).memory
    owned = TRAINED / 2
    assert two.weights == 4 * (TRAINED + BUFFER) and two.grads == 4 * EMBEDDING + 4 * owned
    # the sums are read in place; one scaled range at a time (the embedding's half)
    assert two.optimizer == 12 * owned and two.accumulation == 4 * owned and two.update == 4 * EMBEDDING / 2
    assert two.gathered == 0


def test_hybrid_sharding_and_communication_volume_match_hand_arithmetic():
    # 4 ranks, ep=2 alltoall, ranges over shard groups of 2: the replicated tensors split in 2; a shard group is one
    # expert group, whose 2 ranks hold different experts, so the expert tensors are not split (replicated 2 times).
    layout = Layout(dp=4, ep=2, dispatcher="alltoall", zero=3, shard_size=2)
    plan = hand_plan(layout)
    held = TRAINED - EXPERTS / 2
    owned = (TRAINED - EXPERTS) / 2 + EXPERTS / 2
    assert plan.memory.optimizer == 8 * owned and plan.micro_batches == 1
    volume = plan.comm
    assert volume.reduce_scatter == 4 * held and volume.all_gather == 4 * held  # once each: one micro-batch
    assert volume.all_reduce == 4 * owned  # the ranges, across the 2 shard groups
    # dispatch and combine, forward and backward, of ep * min(K, E/ep) = 4 rows a token, in the one MoE layer
    assert volume.all_to_all == 2 * 2 * 4 * T * 8 * 4
    # ZeRO-3 with recompute gathers again in the backward; ZeRO-2 all-gathers once a step, reduces every micro-batch
    again = hand_plan(Layout(dp=2, zero=3, recompute=True)).comm
    assert again.all_gather == 2 * 2 * 4 * TRAINED and again.reduce_scatter == 2 * 4 * TRAINED
    two = hand_plan(Layout(dp=2, zero=2)).comm
    assert two.all_gather == 4 * TRAINED and two.reduce_scatter == 2 * 4 * TRAINED and two.all_reduce == 0
    assert hand_plan(Layout(dp=2)).comm.all_reduce == 4 * TRAINED
    # allgather, one replica of 2 ranks and 4 micro-batches: the group's 2 x 32 token rows gathered and the outputs
    # reduce-scattered, forward and backward; no gradient is reduced (the group is one replica).
    grouped = hand_plan(Layout(dp=1, ep=2, dispatcher="allgather")).comm
    assert grouped.all_gather == grouped.reduce_scatter == 2 * 2 * T * 8 * 4 * 4 and grouped.all_reduce == 0


def test_lower_bound_is_sixteen_bytes_per_parameter_over_the_usable_bytes():
    from mindmoe.launch.plan_state import lower_bound_devices

    assert lower_bound_devices(743_911_199_232, 60 * 2**30) == 185  # GLM-5 on 64 GiB devices, 4 reserved
    assert lower_bound_devices(106_852_245_504, 60 * 2**30) == 27  # GLM-4.5-Air
    assert lower_bound_devices(10, 1000) == 1


def test_chunked_loss_keeps_no_full_logits():
    """GLM-4.5's vocabulary: 32 MiB chunks of 55 rows; the loss of 4,096 tokens holds 7 of them, what it keeps for the
    backward (the rows' and the head's gradients) and the head gradient's running sum."""
    memory = hand_plan(Layout(dp=1), batch=Batch(4096, 1, 1), vocab_size=151_552).memory
    rows = 32 * 2**20 // (4 * 151_552)
    assert rows == 55
    assert memory.loss == 7 * 4 * 151_552 * rows + 4 * 8 * 4096 + 3 * 4 * 151_552 * 8
    assert memory.loss < 4 * 151_552 * 4096 / 3


# LoRA r=2 on the default targets (q, k, v, o, gate, up, down; dense, shared and routed experts).
ADAPTERS = 2 * (2 * (8 + 8) + 2 * 2 * (8 + 4) + 2 * (8 + 8)) + 3 * 2 * (8 + 16) + 3 * 2 * (8 + 4)  # 440, not experts
EXPERT_ADAPTERS = 4 * 3 * 2 * (8 + 4)  # 288, split over ep


@pytest.mark.parametrize(
    "device, base_dtype, base_bytes", [("Ascend", "auto", 2), ("CPU", "auto", 2), ("CPU", "fp32", 4)]
)
def test_lora_memory_frozen_base_in_base_dtype_and_only_adapters_trained(device, base_dtype, base_bytes):
    model = ModelConfig(**HAND)
    trained = lora_trained(model, LoraConfig(enabled=True, r=2, base_dtype=base_dtype), device)
    assert trained.base_dtype == {("Ascend", "auto"): "bf16", ("CPU", "auto"): "fp16"}.get((device, base_dtype), "fp32")
    memory = hand_plan(Layout(dp=1, ep=2), hand_setup(device=device, trained=trained), batch=Batch(16, 2, 2)).memory
    adapters = ADAPTERS + EXPERT_ADAPTERS / 2
    assert memory.weights == base_bytes * (MATRICES + EXPERTS / 2) + 4 * (SMALL + BUFFER) + 4 * adapters
    assert memory.grads == 4 * adapters and memory.optimizer == 8 * adapters
    assert memory.accumulation == 0  # one micro-batch per step
    assert memory.update == 4 * adapters  # the clipped copy
    assert memory.loss == 7 * 4 * 100 * T + 4 * 8 * T  # a frozen head: the loss keeps the rows' gradient only
    unclipped = hand_plan(Layout(dp=1, ep=2), hand_setup(device=device, trained=trained, clip=False), Batch(16, 2, 2))
    assert unclipped.memory.update == 0


def test_lora_keeps_refusing_bias_updates():
    cfg = compose_config(["lora.enabled=true", "moe.bias_update_rate=0.001"])
    with pytest.raises(ValueError, match=re.escape("moe.bias_update_rate=0.001: LoRA keeps the base")):
        run_setup(cfg, ModelConfig(**HAND), PlanConfig(device="Ascend"))


def test_the_runs_moe_keys_reach_the_planned_setup():
    """Capacity dispatch keeps top_k * capacity_factor expert rows a token (3 here) where dropless keeps top_k."""
    cfg = compose_config(["moe.dispatch=capacity", "moe.capacity_factor=1.5"])
    setup = run_setup(cfg, ModelConfig(**HAND), PlanConfig(device="CPU"))
    assert setup.moe == MoEConfig(dispatch="capacity", capacity_factor=1.5)
    moe_r3 = MOE_K2 + 4 * (2 * 8 + 3 * 4)
    assert hand_plan(Layout(dp=1), setup).memory.activations == T * (DENSE + moe_r3 + MASK + moe_r3 + FINAL_NORM)
    # moe.dispatch=auto: capacity for a model initialised here, dropless for weights trained elsewhere
    assert run_setup(compose_config([]), ModelConfig(**HAND), PlanConfig(device="CPU")).moe.dispatch == "capacity"
    pretrained = run_setup(compose_config(["model.pretrained=hf_dir"]), ModelConfig(**HAND), PlanConfig(device="CPU"))
    assert pretrained.moe == DROPLESS
    with pytest.raises(ValueError, match=re.escape("moe.bias_update_rate=0.001: needs model.expert_bias=true")):
        run_setup(
            compose_config(["moe.bias_update_rate=0.001"]), ModelConfig(**{**HAND, "expert_bias": False}), PlanConfig()
        )


def test_layout_errors_are_the_trainers():
    cfg = ModelConfig(**HAND)
    assert layout_errors(cfg, Layout(dp=2, ep=3), HAND_BATCH) == ["parallel.ep=3 must divide model.num_experts=4"]
    [error] = layout_errors(cfg, Layout(dp=3, ep=1), HAND_BATCH)
    assert error.startswith("data.global_batch_size=8 must be a positive multiple")
    with pytest.raises(ValueError, match="parallel.ep=3 must divide"):
        hand_plan(Layout(dp=2, ep=3))


def test_candidates_are_the_trainers_layouts_only():
    layouts = candidate_layouts(ModelConfig(**HAND), 8)
    assert {(lay.ep, lay.dispatcher) for lay in layouts} == {
        (1, "allgather"),
        (2, "allgather"),
        (2, "alltoall"),
        (4, "allgather"),
        (4, "alltoall"),
    }
    assert all(lay.devices == 8 for lay in layouts)
    assert not any(hasattr(lay, "tp") or hasattr(lay, "pp") for lay in layouts)


def test_copied_trainer_constants_equal_the_models():
    from mindmoe.launch import plan
    from mindmoe.model import attention, lm_loss

    assert plan.BLOCK_SIZE == attention.BLOCK_SIZE
    assert plan.BLOCKWISE_DEVICES == attention.BLOCKWISE_DEVICES
    assert plan.LOSS_CHUNK_BYTES == lm_loss.CHUNK_BYTES


def test_cpu_plans_add_the_runtimes_named_terms_and_ascend_plans_none():
    """On CPU: runtime buffers of 100 fp32 hidden rows per token and kept layer, compiled graphs of 0.12 GiB +
    0.125 GiB per layer, 0.35 GiB of optimizer library; the rest of the plan is the same as Ascend's."""
    gib = 2**30
    cpu = hand_plan(Layout(dp=1)).memory
    assert cpu.runtime_buffers == T * 2 * 4 * 100 * 8
    assert cpu.graphs == 0.12 * gib + 2 * 0.125 * gib
    assert cpu.library == 0.35 * gib
    ascend = hand_plan(Layout(dp=1), hand_setup(device="Ascend")).memory
    assert ascend.runtime_buffers == ascend.graphs == ascend.library == 0
    assert cpu.total - ascend.total == cpu.runtime_buffers + cpu.graphs + cpu.library
    recompute = hand_plan(Layout(dp=1, recompute=True)).memory
    assert recompute.runtime_buffers == T * 1 * 4 * 100 * 8  # the one layer rebuilt at a time
    assert recompute.graphs == cpu.graphs


def test_cpu_runtime_terms_are_printed_on_their_own_lines_for_cpu_only():
    from mindmoe.launch.plan_report import memory_lines

    model = ModelConfig(**HAND)
    labels = ("CPU runtime buffers", "CPU compiled graphs", "CPU optimizer library")
    for device, shown in (("CPU", True), ("Ascend", False)):
        setup = hand_setup(device=device)
        plan = plan_layout(model, Layout(dp=1), HAND_BATCH, PlanConfig(), setup)
        lines = memory_lines(model, plan, HAND_BATCH, setup, PlanConfig())
        for label in labels:
            assert any(line.strip().startswith(label) for line in lines) == shown


# MLA on the same model: q_lora_rank 6, kv_lora_rank 4, per head 2 no-RoPE + 2 RoPE query/key channels (d_qk = 4)
# and 3 value channels; 4 heads. HAND's GQA keys (kv heads, head_dim, QK-norm, q/k/v bias) are not read by MLA.
MLA = dict(
    HAND, attention_type="mla", q_lora_rank=6, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3
)
# Per layer: q_a_proj 6x8, q_b_proj 16x6, kv_a_proj_with_mqa (4 + 2)x8, kv_b_proj 4*(2 + 3)x4, o_proj 8x12.
MLA_MATRICES = 100 * 8 * 2 + 2 * (6 * 8 + 16 * 6 + 6 * 8 + 20 * 4 + 8 * 12) + 3 * 8 * 16 + 3 * 8 * 4
MLA_SMALL = 2 * (6 + 4) + (2 * (8 + 8) + 8) + 4 * 8  # q_a / kv_a layernorms 20, layer and final norms 40, router 32
# fp32 bytes per token: norm input and normed input 2h; q_a_layernorm input and q_b_proj input 2 * 6; kv_a_layernorm
# input and kv_b_proj input 2 * 4; queries and keys 4 heads x 4 each; values and o_proj input 4 heads x 3 each;
# the stored softmax c*a*s
MLA_ATTN = 4 * (2 * 8 + 2 * 6 + 2 * 4 + 4 * 4 + 4 * 4 + 4 * 3 + 4 * 3) + 4 * 4 * 16  # 624
MLA_DENSE = MLA_ATTN + 4 * (2 * 8 + 3 * 16)  # 880
MLA_MOE = MLA_ATTN + 4 * 2 * 8 + 8 * 4 + 2 * 4 * (2 * 8 + 3 * 4) + 3 * 4 * 4  # 992


def test_mla_memory_uses_the_latent_widths_not_the_gqa_ones():
    memory = hand_plan(Layout(dp=1), **MLA).memory  # one rank, 4 micro-batches
    assert memory.weights == 4 * (MLA_MATRICES + MLA_SMALL + EXPERTS + BUFFER)
    assert memory.grads == 4 * (MLA_MATRICES + MLA_SMALL + EXPERTS)
    assert memory.activations == T * (MLA_DENSE + MLA_MOE + MASK + MLA_MOE + FINAL_NORM)
    # q_lora_rank null: one q_proj reads the normed input, no q latent is kept (2 * 6 elements less a layer)
    plain = hand_plan(Layout(dp=1), **{**MLA, "q_lora_rank": None}).memory
    assert plain.activations == T * (MLA_DENSE + MLA_MOE + MASK + MLA_MOE + FINAL_NORM - 3 * 4 * 2 * 6)
    # Ascend past 512 positions: blockwise, an fp32 log-sum-exp per head instead of the softmax, no mask
    tokens, blockwise_attn = 1024, MLA_ATTN - 4 * 4 * 16 + 4 * 4
    long = hand_plan(Layout(dp=1), hand_setup(device="Ascend"), Batch(1024, 1, 1), **MLA).memory
    moe = blockwise_attn + MLA_MOE - MLA_ATTN
    assert long.activations == tokens * (blockwise_attn + MLA_DENSE - MLA_ATTN + moe + moe + FINAL_NORM)


# A DSA indexer on the MLA model: 2 indexer heads of width 4, index_topk 4 (it does not change the kept bytes).
DSA = dict(MLA, dsa=dict(index_n_heads=2, index_head_dim=4, index_topk=4))
# Per layer: wq_b 8x6, wk 4x8, weights_proj 2x8 (matrices), k_norm weight and bias 4 + 4.
INDEXER_MATRICES, INDEXER_SMALL = 2 * (8 * 6 + 4 * 8 + 2 * 8), 2 * (4 + 4)
# fp32 bytes per token and layer: query 2 heads x 4, key before and after its LayerNorm/RoPE 2 x 4, head weights 2;
# the ReLU'd products of the 2 indexer heads over the s = 16 keys; fp32 rows over the keys: index scores, selection
# mask, the KL loss's softmax
INDEXER = 4 * (2 * 4 + 2 * 4 + 2) + 4 * 2 * 16 + 4 * 16 + 4 * 16 + 4 * 16  # 392


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_dsa_indexer_memory_matches_hand_arithmetic(stage):
    memory = hand_plan(Layout(dp=1), dataclasses.replace(hand_setup(), dsa_stage=stage), **DSA).memory
    held = MLA_MATRICES + INDEXER_MATRICES + MLA_SMALL + INDEXER_SMALL + EXPERTS
    assert memory.weights == 4 * (held + BUFFER) and memory.grads == 4 * held
    per_layer = MLA_DENSE + INDEXER + MLA_MOE + INDEXER
    assert memory.activations == T * (per_layer + MASK + MLA_MOE + INDEXER + FINAL_NORM)
    # stage off: the indexer's weights are stored and trained, but it does not run
    off = hand_plan(Layout(dp=1), dataclasses.replace(hand_setup(), dsa_stage="off"), **DSA).memory
    assert off.weights == memory.weights
    assert off.activations == T * (MLA_DENSE + MLA_MOE + MASK + MLA_MOE + FINAL_NORM)


@pytest.mark.parametrize("device", ["Ascend", "CPU"])
def test_dsa_past_the_block_size_keeps_no_row_over_the_keys_and_lora_keeps_the_indexer_frozen(device):
    # Past 512 positions DSA layers run the indexed_attention kernel on every device: no softmax, no mask, no
    # indexer products or rows; the indexer's vectors only. Its backward holds one block of 512 queries against
    # all s keys once: 3 fp32 tensors per attention head (4) and 4 per indexer head (2), micro-batch 2.
    s, micro = 1024, 2
    tokens = s * micro
    attn = MLA_ATTN - 4 * 4 * 16 + 4 * (2 * 4 + 2 * 4 + 2)
    block = 4 * micro * 512 * s * (3 * 4 + 4 * 2)
    long = hand_plan(Layout(dp=1), hand_setup(device=device), Batch(s, micro, micro), **DSA).memory
    moe = attn + MLA_MOE - MLA_ATTN
    assert long.activations == tokens * (attn + MLA_DENSE - MLA_ATTN + moe + moe + FINAL_NORM) + block
    # at 512 positions the whole mask and every row over the keys again (no block is past BLOCK_SIZE)
    short = hand_plan(Layout(dp=1), hand_setup(device=device), Batch(512, 1, 1), **DSA).memory
    s = 512
    attn = MLA_ATTN - 4 * 4 * 16 + 4 * 4 * s + 4 * (2 * 4 + 2 * 4 + 2) + 4 * 2 * s + 3 * 4 * s
    moe = attn + MLA_MOE - MLA_ATTN
    assert short.activations == s * (attn + MLA_DENSE - MLA_ATTN + moe + 4 * 4 * s + moe + FINAL_NORM)
    # LoRA: no adapter on the indexer; its matrices frozen in bf16, its LayerNorm fp32
    lora = LoraConfig(enabled=True, r=2)
    setups = [
        hand_setup(device="Ascend", trained=lora_trained(ModelConfig(**cfg), lora, "Ascend")) for cfg in (DSA, MLA)
    ]
    assert not any("indexer" in name for name in setups[0].trained.adapted)
    with_indexer, without = (
        hand_plan(Layout(dp=1), setup, Batch(16, 2, 2), **cfg).memory for setup, cfg in zip(setups, (DSA, MLA))
    )
    assert with_indexer.weights - without.weights == 2 * INDEXER_MATRICES + 4 * INDEXER_SMALL
    assert with_indexer.grads == without.grads


# One MTP depth on HAND: its MoE decoder layer (GQA attention, router, 4 experts, shared expert) and enorm, hnorm,
# eh_proj [8, 16], shared_head.norm.
MTP_MATRICES = (8 * 8 + 8 * 4 * 2 + 8 * 8) + 3 * 8 * 4 + 8 * 16  # attention 192, shared expert 96, eh_proj 128
MTP_SMALL = (8 + 4 + 4) + (8 + 8 + 2 + 2) + (8 + 8 + 8) + 4 * 8  # q/k/v biases, layer norms, MTP norms, router: 92
# fp32 bytes per token: the MoE layer, + the embedding enorm reads h, eh_proj's input 2h, the block output h, the
# depth's loss input h; once the main model's normed rows (depth 1's hnorm input) h
MTP_DEPTH = MOE_K2 + 4 * (8 + 2 * 8 + 8 + 8)
MTP_ONCE = 4 * 8


def test_mtp_depth_memory_matches_hand_arithmetic():
    memory = hand_plan(Layout(dp=2, ep=2, dispatcher="allgather"), mtp_layers=1).memory
    held = MATRICES + SMALL + EXPERTS / 2 + MTP_MATRICES + MTP_SMALL + EXPERTS / 2  # the depth's experts split too
    assert memory.weights == 4 * (held + 2 * BUFFER)
    assert memory.grads == 4 * held and memory.optimizer == 8 * held
    assert memory.activations == T * (DENSE + MOE_K2 + MASK + MOE_K2 + FINAL_NORM + MTP_DEPTH + MTP_ONCE)
    assert memory.loss == LOSS + KEPT  # one set of chunk buffers; the depth keeps its own gradients
    assert memory.comm == 4 * held + 2 * 2 * T * 8 * 4
    # train.recompute rebuilds the main layers only: the depth stays whole
    recompute = hand_plan(Layout(dp=1, recompute=True), mtp_layers=1).memory
    assert recompute.activations == T * (2 * 4 * 8 + MOE_K2 + MASK + MOE_K2 + FINAL_NORM + MTP_DEPTH + MTP_ONCE)
    # CPU: the depth is one more kept layer of runtime buffers and one more compiled layer
    assert recompute.runtime_buffers == T * (1 + 1) * 4 * 100 * 8
    assert recompute.graphs == 0.12 * 2**30 + (2 + 1) * 0.125 * 2**30
    two = hand_plan(Layout(dp=1), mtp_layers=2).memory
    assert two.activations == T * (DENSE + MOE_K2 + MASK + MOE_K2 + FINAL_NORM + 2 * MTP_DEPTH + MTP_ONCE)
    assert two.loss == LOSS + 2 * KEPT


def test_mtp_layers_are_reported_as_planned():
    from mindmoe.launch.plan_cli import count_lines

    without, with_mtp = count_lines(ModelConfig(**HAND)), count_lines(ModelConfig(**HAND, mtp_layers=1))
    depth = MTP_MATRICES + MTP_SMALL + EXPERTS
    assert any(
        f"an MTP layer (model.mtp_layers=1 trains it; the memory plan then includes it) adds {depth} " in line
        for line in without
    )
    assert any(f"1 MTP layer(s) of {depth} " in line and "in the memory plan below" in line for line in with_mtp)
    assert not any("not planned" in line for line in without + with_mtp)


def test_plan_vs_measured_check_fails_outside_its_tolerance():
    from mindmoe.bench.plan_vs_measured import compare

    assert compare(1.2, 1.0, 0.25)["within"] and compare(0.8, 1.0, 0.25)["within"]
    assert not compare(1.3, 1.0, 0.25)["within"] and not compare(0.5, 1.0, 0.25)["within"]
