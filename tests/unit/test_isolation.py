"""Gradient isolation of locked experts (README, "Routing"), both modes.

``token_grad``: the gradient of expert e's weights is the per-token sum of the contributions of the
tokens routed (and kept) to e, each locked token's term multiplied by lambda — computed here with
torch autograd (float64) from the per-token definition — while the input and router gradients are
those of the unisolated layer.

``expert_update``: after one AdamW step, expert e's parameter change is ``1 - (1 - lambda) f_e`` times
the change without isolation, with ``f_e`` = locked share of e's kept assignments computed from a
NumPy re-routing of the captured MoE inputs (natural top-k, brute-force locking, capacity dropping).
"""

import dataclasses

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Tensor, ops

from mindmoe.model.attention import document_causal_mask
from mindmoe.model.config import ModelConfig
from mindmoe.model.moe import MoELayer
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.transformer import MoETransformer
from tests.helpers.moe import EXPERTS, TOP_K, build_layer, layer_weights, split_fields
from tests.unit.test_locking import (
    BATCH,
    SEQ,
    copy_parameters_by_name,
    lock_layer_config,
    naive_locked_moe,
    np_capacity_kept,
    np_lock_routing,
    runs_input,
)

DECAY = 0.3

# ---- token_grad: gradients of one layer vs torch autograd -------------------------------------


def torch_reference_grads(x, doc_ids, probe, weights, cfg, moe, capacity):
    """Gradients of ``sum(out * probe)`` for the locked layer (architecture ``cfg``, policy ``moe``), by
    torch autograd in float64.

    Input, router and shared-expert gradients come from the plain loss. Expert gradients come from the
    per-token definition: ``sum_t scale_t * sum_k w_tk * <SwiGLU_{e_tk}(x_t), probe_t>`` with the
    combine weights and the input held constant (they do not depend on expert weights) and
    ``scale_t = lambda`` for locked tokens. Also returns the expert gradients with every scale 1.
    """
    _, _, routed, locked, kept, _ = naive_locked_moe(x, doc_ids, weights, cfg, moe, capacity)
    t = {
        name: torch.tensor(value, dtype=torch.float64, requires_grad=True)
        for name, value in weights.items()
        if name != "router.e_score_correction_bias"
    }
    x_TH = torch.tensor(x.reshape(-1, x.shape[-1]), dtype=torch.float64, requires_grad=True)
    probe_TH = torch.tensor(probe.reshape(x_TH.shape), dtype=torch.float64)
    routed_TK = torch.from_numpy(routed)
    kept_TK = torch.from_numpy(kept.astype(np.float64))

    def swiglu(h, gate, up, down):
        return (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T

    def routed_output(inputs, combine_TK, scale_T):
        out = torch.zeros_like(inputs)
        for token in range(inputs.shape[0]):
            for k in range(cfg.top_k):
                e = int(routed_TK[token, k])
                expert_out = swiglu(
                    inputs[token], t["experts.gate_proj"][e], t["experts.up_proj"][e], t["experts.down_proj"][e]
                )
                out[token] += scale_T[token] * kept_TK[token, k] * combine_TK[token, k] * expert_out
        return out

    scores = torch.sigmoid(x_TH @ t["router.weight"].T)
    combine = torch.gather(scores, 1, routed_TK)
    combine = combine / combine.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    shared = swiglu(
        x_TH,
        t["shared_experts.gate_proj.weight"],
        t["shared_experts.up_proj.weight"],
        t["shared_experts.down_proj.weight"],
    )
    ones = torch.ones(x_TH.shape[0], dtype=torch.float64)
    loss = ((routed_output(x_TH, combine, ones) + shared) * probe_TH).sum()
    names = list(t)
    plain_grads = torch.autograd.grad(loss, [t[n] for n in names] + [x_TH])
    plain = dict(zip(names, plain_grads[:-1]))
    dx = plain_grads[-1].numpy().reshape(x.shape)

    expert_names = ["experts.gate_proj", "experts.up_proj", "experts.down_proj"]
    scale_T = torch.from_numpy(np.where(locked, moe.isolation_decay, 1.0))
    isolated_loss = (routed_output(x_TH.detach(), combine.detach(), scale_T) * probe_TH).sum()
    isolated = dict(zip(expert_names, torch.autograd.grad(isolated_loss, [t[n] for n in expert_names])))
    grads = {name: g.numpy() for name, g in plain.items()}
    grads.update({name: g.numpy() for name, g in isolated.items()})
    return grads, dx, {name: plain[name].numpy() for name in expert_names}, locked, kept


def layer_grads(layer, x, doc_ids, probe):
    """``d sum(out * probe)`` w.r.t. x and every trainable parameter (by name), compiled."""
    names = {id(p): name for name, p in layer.parameters_and_names()}
    params = layer.trainable_params()

    def loss_fn(x_BSH, doc_ids_BS, probe_BSH):
        return (layer(x_BSH, doc_ids_BS)[0] * probe_BSH).sum()

    grad_fn = ms.value_and_grad(loss_fn, 0, params)

    @ms.jit
    def step(x_BSH, doc_ids_BS, probe_BSH):
        return grad_fn(x_BSH, doc_ids_BS, probe_BSH)

    _, (dx, dparams) = step(Tensor(x), Tensor(doc_ids), Tensor(probe))
    return dx.asnumpy(), {names[id(p)]: g.asnumpy() for p, g in zip(params, dparams)}


@pytest.mark.parametrize("dispatch,capacity_factor", [("dropless", 1.0), ("capacity", 0.75)])
def test_token_grad_scales_locked_tokens_expert_gradients_and_leaves_input_and_router_gradients(
    dispatch, capacity_factor
):
    cfg, moe = lock_layer_config(dispatch, capacity_factor, isolation_mode="token_grad", isolation_decay=DECAY)
    layer = build_layer(cfg, moe, seed=5)
    x, doc_ids = runs_input()
    probe = np.random.default_rng(29).normal(size=x.shape).astype(np.float32)
    capacity = None if dispatch == "dropless" else int(np.ceil(capacity_factor * BATCH * SEQ * TOP_K / EXPERTS))
    ref, ref_dx, ref_unscaled, locked, kept = torch_reference_grads(
        x, doc_ids, probe, layer_weights(layer), cfg, moe, capacity
    )
    assert 0.2 < locked.mean() < 0.8
    if capacity is not None:
        assert (~kept).any(), "the capacity case must drop some assignments"

    dx, dparams = layer_grads(layer, x, doc_ids, probe)
    assert set(dparams) == set(ref)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
    for name, grad in dparams.items():
        assert np.abs(ref[name]).max() > 1e-3, f"{name}: reference gradient is zero"
        np.testing.assert_allclose(grad, ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # Teeth: isolation changed every expert tensor's gradient noticeably.
    for name, unscaled in ref_unscaled.items():
        assert np.abs(unscaled - ref[name]).max() > 0.05 * np.abs(unscaled).max(), name

    if dispatch == "dropless":
        # The same layer without token-grad isolation (equivalently lambda = 1): identical input and
        # router gradients, expert gradients equal to the unscaled per-token sum.
        plain_moe = dataclasses.replace(moe, isolation_mode="expert_update")
        plain = MoELayer(cfg, np.random.default_rng(1), moe=plain_moe)
        copy_parameters_by_name(layer, plain)
        plain_dx, plain_dparams = layer_grads(plain, x, doc_ids, probe)
        np.testing.assert_allclose(dx, plain_dx, rtol=1e-6, atol=1e-7)
        for name in dparams:
            if name.startswith("experts."):
                np.testing.assert_allclose(plain_dparams[name], ref_unscaled[name], rtol=1e-4, atol=1e-5)
            else:
                np.testing.assert_allclose(dparams[name], plain_dparams[name], rtol=1e-6, atol=1e-7, err_msg=name)


# ---- expert_update: one AdamW step of a tiny transformer ------------------------------------------

VOCAB, STEP_BATCH, STEP_SEQ = 32, 2, 16


def transformer_config(**overrides):
    """``(ModelConfig, MoEConfig)`` of a tiny all-MoE transformer; ``overrides`` may name keys of either."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_layers=2,
        first_k_dense=0,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=8,
        num_shared_experts=1,
        score_func="sigmoid",
        dispatch="capacity",
        capacity_factor=0.75,
        max_position_embeddings=64,
        expert_lock=True,
        lock_run_length=2,
        lock_span=4,
        isolation_mode="expert_update",
        isolation_decay=DECAY,
        aux_loss="switch",
        aux_loss_coeff=1e-2,
        z_loss_coeff=1e-3,
    )
    fields.update(overrides)
    model_fields, moe_fields = split_fields(fields)
    return ModelConfig(**model_fields), MoEConfig(**moe_fields)


def repeated_token_window():
    """Packed ``seq_len + 1`` windows with runs of repeated tokens, so routing repeats and locks."""
    rows = [
        [5, 5, 5, 5, 9, 3, 12, 7, 7, 7, 7, 1, 20, 20, 20, 4, 8],
        [2, 2, 2, 30, 30, 30, 30, 11, 6, 6, 6, 6, 6, 17, 0, 0, 0],
    ]
    doc_ids = [[0] * 17, [0] * 9 + [1] * 8]
    return {"input_ids": np.array(rows, np.int64), "doc_ids": np.array(doc_ids, np.int64)}


def captured_moe_inputs(model, input_ids, doc_ids):
    """Inputs of every MoE block, by running the decoder's pieces in order (pre-norm residual blocks).
    The routing statistics the model reports are then checked against these, which validates the capture."""

    @ms.jit
    def capture(input_ids_BS, doc_ids_BS):
        cos, sin = model.rotary_emb(ops.arange(input_ids_BS.shape[1], dtype=ms.int32))
        mask = document_causal_mask(doc_ids_BS)
        x = model.embed_tokens(input_ids_BS)
        inputs = []
        for layer in model.layers:
            h = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask)
            moe_in = layer.post_attention_layernorm(h)
            inputs.append(moe_in)
            x = h + layer.mlp(moe_in, doc_ids_BS)[0]
        return tuple(inputs)

    return [moe_input.asnumpy() for moe_input in capture(input_ids, doc_ids)]


def np_step_routing(moe_input_BSH, router_weight, bias, doc_ids_BS, cfg, moe):
    """Routing of one MoE layer in NumPy (sigmoid router): natural top-k of ``scores + bias``, locking
    if configured, capacity dropping; returns per-expert ``[chosen, kept, locked_kept]`` and the smallest
    gap at the top-k boundary (to rule out float32-vs-float64 near-ties)."""
    batch, seq_len, hidden = moe_input_BSH.shape
    logits = moe_input_BSH.reshape(-1, hidden).astype(np.float64) @ router_weight.T
    choice = 1.0 / (1.0 + np.exp(-logits)) + bias
    order = np.argsort(-choice, -1, kind="stable")
    ranked = np.take_along_axis(choice, order, -1)
    margin = (ranked[:, cfg.top_k - 1] - ranked[:, cfg.top_k]).min()
    routed = order[:, : cfg.top_k]
    locked = np.zeros(routed.shape, bool)
    if moe.expert_lock:
        locked, routed = np_lock_routing(
            routed.reshape(batch, seq_len, -1), doc_ids_BS, moe.lock_run_length, moe.lock_span
        )
        routed = routed.reshape(-1, cfg.top_k)
        locked = np.broadcast_to(locked.reshape(-1, 1), routed.shape)
    capacity = None
    if moe.dispatch == "capacity":
        capacity = int(np.ceil(moe.capacity_factor * batch * seq_len * cfg.top_k / cfg.num_experts))
    kept = np_capacity_kept(routed, cfg.num_experts, capacity)

    def per_expert(mask):
        return np.bincount(routed[mask], minlength=cfg.num_experts)

    return np.stack([per_expert(np.ones_like(kept)), per_expert(kept), per_expert(kept & locked)]), margin


def np_model_routing(model, cfg, moe, input_ids, doc_ids):
    """``[L, 3, E]`` routing statistics of a model whose layers are all MoE layers, from captured inputs."""
    assert all(layer.is_moe for layer in model.layers)
    stats = []
    for layer, moe_input in zip(model.layers, captured_moe_inputs(model, input_ids, Tensor(doc_ids))):
        router = layer.mlp.router
        bias = router.e_score_correction_bias.asnumpy().astype(np.float64) if cfg.expert_bias else 0.0
        layer_stats, margin = np_step_routing(
            moe_input, router.weight.asnumpy().astype(np.float64), bias, doc_ids, cfg, moe
        )
        assert margin > 1e-6, "top-k boundary too close to a tie for a float32/float64 comparison"
        stats.append(layer_stats)
    return np.stack(stats)


def parameter_values(params):
    return {p.name: p.asnumpy().astype(np.float64) for p in params}


def restore(params, values):
    """Write saved values back through a compiled assign: ``Parameter.set_data`` after a graph has
    updated the parameter is not seen by graphs compiled before it (MindSpore 2.9, CPU)."""

    @ms.jit
    def assign_all(*new_values):
        for param, value in zip(params, new_values):
            ops.assign(param, value)
        return ops.zeros((), ms.float32)

    dtypes = {ms.float32: np.float32, ms.int32: np.int32}
    assign_all(*[Tensor(values[p.name].astype(dtypes[p.dtype])) for p in params])
    restored = parameter_values(params)
    assert all(np.array_equal(restored[name], values[name]) for name in values)


def test_expert_update_scales_each_experts_adamw_update_by_one_minus_decay_times_locked_share():
    from mindmoe.train.config import TrainConfig
    from mindmoe.train.optim import build_optimizer
    from mindmoe.train.routing import RouterStepUpdates
    from mindmoe.train.step import CompiledStep

    cfg, moe = transformer_config()
    model = MoETransformer(cfg, seed=0, moe=moe)
    assert model.moe_config == moe
    optimizer = build_optimizer(
        model.trainable_params(), TrainConfig(lr=1e-2, warmup_ratio=0.0, max_steps=10, grad_clip=0.0)
    )
    trainer = CompiledStep(model, optimizer, 0.0, 1, RouterStepUpdates(model, cfg))
    window = repeated_token_window()
    input_ids = Tensor(window["input_ids"][:, :-1].astype(np.int32))
    doc_ids = window["doc_ids"][:, :-1].astype(np.int32)

    # Independent routing statistics: NumPy re-routing of the captured MoE inputs.
    expected_stats = np_model_routing(model, cfg, moe, input_ids, doc_ids)
    locked_share = expected_stats[:, 2] / np.maximum(expected_stats[:, 1], 1)
    multiplier = 1.0 - (1.0 - DECAY) * locked_share  # [L, E]
    assert ((locked_share > 0) & (locked_share < 1)).any() and (locked_share > 0).sum() >= 3
    assert (expected_stats[:, 0] > expected_stats[:, 1]).any(), "some assignments must be dropped"

    # Run 1 with expert_update isolation; run 2 from the identical state with lambda = 1.
    state = (
        list(model.get_parameters()) + list(optimizer.exp_avg) + list(optimizer.exp_avg_sq) + [optimizer.global_step]
    )
    before = parameter_values(state)
    isolated_stats = trainer.step([window])
    isolated = parameter_values(model.get_parameters())
    restore(state, before)
    # The step updates read the policy from the model; lambda only scales updates outside the layers' graph.
    model.moe_config = dataclasses.replace(moe, isolation_decay=1.0)
    trainer.router_updates = RouterStepUpdates(model, cfg)
    plain_stats = trainer.step([window])
    plain = parameter_values(model.get_parameters())

    np.testing.assert_array_equal(isolated_stats.routing_stats, expected_stats)
    np.testing.assert_array_equal(plain_stats.routing_stats, expected_stats)
    assert isolated_stats.loss == plain_stats.loss

    expert_names = set()
    for layer_idx, layer in enumerate(model.layers):
        for param in layer.mlp.experts.get_parameters():
            expert_names.add(param.name)
            plain_update = plain[param.name] - before[param.name]
            isolated_update = isolated[param.name] - before[param.name]
            expected = multiplier[layer_idx].reshape(-1, 1, 1) * plain_update
            assert np.abs(plain_update).min(axis=(1, 2)).max() > 1e-4
            np.testing.assert_allclose(isolated_update, expected, rtol=1e-6, atol=5e-8, err_msg=param.name)
    assert len(expert_names) == 3 * cfg.num_layers
    moved = 0
    for param in model.trainable_params():
        if param.name not in expert_names:
            np.testing.assert_array_equal(isolated[param.name], plain[param.name], err_msg=param.name)
            moved += bool(np.abs(plain[param.name] - before[param.name]).max() > 0)
    assert moved > 10
