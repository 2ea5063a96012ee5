"""The optimizer of train.optim (mindformers AdamW, fused update) against torch.optim.AdamW."""

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import Parameter, Tensor

from mindmoe.train.config import TrainConfig
from mindmoe.train.optim import build_lr_schedule, build_optimizer


@pytest.mark.parametrize("warmup_ratio", [0.0, 0.5])
def test_fused_adamw_matches_torch_adamw_with_decay_groups(warmup_ratio):
    rng = np.random.default_rng(0)
    shapes = {"layer.weight": (6, 5), "layer.bias": (6,), "norm.weight": (5,), "experts.up_proj": (3, 4, 5)}
    initial = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    steps = 4
    grads = [{name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()} for _ in range(steps)]
    # With warmup the first step has lr 0 (nothing may move, nothing may turn NaN); torch gets the
    # same per-step learning rates from the schedule.
    cfg = TrainConfig(
        max_steps=steps,
        lr=1e-2,
        warmup_ratio=warmup_ratio,
        min_lr_ratio=1.0,
        weight_decay=0.1,
        betas=[0.9, 0.95],
        eps=1e-6,
    )
    schedule = build_lr_schedule(cfg)
    lrs = [float(schedule(Tensor(np.array([step], np.int32))).asnumpy().reshape(-1)[0]) for step in range(steps)]
    assert (lrs[0] == 0.0) == (warmup_ratio > 0)

    params = [Parameter(Tensor(value.copy()), name=name) for name, value in initial.items()]
    optimizer = build_optimizer(params, cfg)
    # The undecayed group passes the number 0, so its update has no decay multiply (train/fused_adamw.py).
    undecayed = [isinstance(decay, float) and decay == 0.0 for decay in optimizer.static_weight_decay]
    assert undecayed == [len(shapes[p.name]) == 1 for p in optimizer.parameters]

    @ms.jit
    def update(gradients):
        return optimizer(gradients)

    torch_params = {name: torch.nn.Parameter(torch.from_numpy(value.copy())) for name, value in initial.items()}
    decayed = [p for name, p in torch_params.items() if len(shapes[name]) > 1]
    not_decayed = [p for name, p in torch_params.items() if len(shapes[name]) == 1]
    reference = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": not_decayed, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-6,
    )
    for lr, step_grads in zip(lrs, grads):
        update(tuple(Tensor(step_grads[p.name]) for p in params))
        for group in reference.param_groups:
            group["lr"] = lr
        for name, p in torch_params.items():
            p.grad = torch.from_numpy(step_grads[name])
        reference.step()

    for p in params:
        expected = torch_params[p.name].detach().numpy()
        assert not np.allclose(expected, initial[p.name], atol=1e-3), p.name
        np.testing.assert_allclose(p.asnumpy(), expected, rtol=1e-5, atol=1e-6, err_msg=p.name)
    # The moments are kept as mindformers keeps them (checkpoints hold them), and equal torch's.
    for p, exp_avg, exp_avg_sq in zip(optimizer.parameters, optimizer.exp_avg, optimizer.exp_avg_sq):
        state = reference.state[torch_params[p.name]]
        np.testing.assert_allclose(exp_avg.asnumpy(), state["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(exp_avg_sq.asnumpy(), state["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-9)
    assert int(optimizer.global_step.asnumpy().reshape(-1)[0]) == steps


def test_update_scales_multiply_each_rows_adamw_update_decay_included_and_leave_the_moments_unscaled():
    """``optimizer(grads, update_scales)``: an ``[E, 1, 1]`` scale multiplies the whole update of each row of a
    3-D tensor (weight decay included) against torch's AdamW; a None scale and the moments are unaffected."""
    rng = np.random.default_rng(1)
    shapes = {"experts.up_proj": (4, 3, 5), "layer.weight": (6, 5)}
    initial = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    scale_E = np.array([0.3, 1.0, 0.55, 0.0], np.float32)
    cfg = TrainConfig(
        max_steps=3, lr=1e-2, warmup_ratio=0.0, min_lr_ratio=1.0, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8
    )
    params = [Parameter(Tensor(value.copy()), name=name) for name, value in initial.items()]
    optimizer = build_optimizer(params, cfg)

    @ms.jit
    def update(gradients, scale):
        return optimizer(gradients, (scale, None))

    torch_params = {name: torch.nn.Parameter(torch.from_numpy(value.copy())) for name, value in initial.items()}
    reference = torch.optim.AdamW(list(torch_params.values()), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(2):
        before = {p.name: p.asnumpy().astype(np.float64) for p in params}
        torch_before = {name: p.detach().numpy().astype(np.float64) for name, p in torch_params.items()}
        grads = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
        update(tuple(Tensor(grads[p.name]) for p in params), Tensor(scale_E.reshape(-1, 1, 1)))
        for name, p in torch_params.items():
            p.grad = torch.from_numpy(grads[name])
        reference.step()
        # The reference update of this step from the same weights: torch's moved from torch's weights,
        # which stay unscaled; scale it row by row and compare the updates.
        for p in params:
            torch_update = torch_params[p.name].detach().numpy() - torch_before[p.name]
            expected = torch_update * (scale_E.reshape(-1, 1, 1) if p.name.startswith("experts.") else 1.0)
            np.testing.assert_allclose(p.asnumpy() - before[p.name], expected, rtol=1e-4, atol=1e-7, err_msg=p.name)
        # Keep torch's weights equal to ours, so the next step's updates start from the same point.
        with torch.no_grad():
            for p in params:
                torch_params[p.name].copy_(torch.from_numpy(p.asnumpy()))
    for p, exp_avg, exp_avg_sq in zip(optimizer.parameters, optimizer.exp_avg, optimizer.exp_avg_sq):
        state = reference.state[torch_params[p.name]]
        np.testing.assert_allclose(exp_avg.asnumpy(), state["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(exp_avg_sq.asnumpy(), state["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-9)
