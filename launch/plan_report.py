"""The printed memory table and layout list of ``mindmoe-plan`` (the numbers are :mod:`launch.plan`'s)."""

from typing import List

from mindmoe.launch.config import PlanConfig
from mindmoe.launch.plan import (
    CPU_GRAPH_BASE_BYTES,
    CPU_GRAPH_BYTES_PER_LAYER,
    CPU_RUNTIME_HIDDEN_ROWS,
    GIB,
    Batch,
    Plan,
    Setup,
    cpu_kept_layers,
    dsa_active,
    full_mask,
    routed_rows_per_token,
)
from mindmoe.launch.plan_state import LOWER_BOUND_BYTES_PER_PARAMETER, lower_bound_devices
from mindmoe.model.config import ModelConfig
from mindmoe.model.param_count import count_parameters, mtp_layer_parameters

#: What the trainer does not have, so no layout uses it.
NOT_IMPLEMENTED = "tensor parallelism, pipeline parallelism"


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:8.2f}"


def gradient_note(layout) -> str:
    if layout.zero >= 2:
        return "fp32: the owned ranges, and one layer's whole gradients until their reduce-scatter in the backward"
    return "fp32, trained tensors only"


def weight_note(setup: Setup) -> str:
    trained, dtype = setup.trained, setup.compute_dtype
    stored = "fp32" if dtype == "fp32" else f"{dtype} (fp32 masters: optimizer)"
    if not trained.lora:
        return f"{stored}, every parameter trained"
    return f"LoRA: frozen base {trained.base_dtype}, norms/router/biases and adapters (r={trained.rank}) {stored}"


def optimizer_note(layout, setup: Setup) -> str:
    copy = "fp32 master" if setup.compute_dtype != "fp32" else "working copy"
    if layout.zero == 3 and setup.compute_dtype == "fp32":
        return "AdamW m, v fp32 of the owned ranges (ZeRO-3: the weight range is its own master)"
    if layout.zero:
        return f"AdamW m, v and the {copy}, fp32, of the owned ranges only (ZeRO-{layout.zero})"
    if setup.compute_dtype != "fp32":
        return "AdamW m, v and the fp32 masters of the trained tensors (one process)"
    return "AdamW m, v fp32, trained tensors only; not split (parallel.zero=0)"


def weights_note(setup: Setup, layout) -> str:
    note = weight_note(setup)
    return f"{note}; ZeRO-3: the owned ranges" if layout.zero == 3 else note


def gathered_note(layout) -> str:
    if layout.zero != 3:
        return "none (weights held whole)"
    if layout.recompute:
        return "ZeRO-3: one layer's whole weights (two on Ascend: the next all-gather overlaps), embedding or head"
    return "ZeRO-3 without train.recompute: every layer's whole weights, kept for the backward"


def activation_note(model: ModelConfig, plan: Plan, batch: Batch, setup: Setup) -> str:
    kept = "recomputed per layer" if plan.layout.recompute else "all kept"
    if full_mask(model, batch.seq_len, setup):
        attention = "full S x S scores"
    else:
        attention = "blockwise DSA (indexed_attention)" if dsa_active(model, setup) else "blockwise attention"
    rows = routed_rows_per_token(model, plan.layout, setup.moe)
    mtp = f"; {model.mtp_layers} MTP depth(s) kept whole" if model.mtp_layers else ""
    return f"{kept}; {attention}; {rows:g} expert rows per token{mtp}, train.dtype={setup.compute_dtype}"


def loss_note(model: ModelConfig) -> str:
    depths = f" (the LM loss and {model.mtp_layers} MTP loss(es))" if model.mtp_layers else ""
    return f"chunked{depths}: no [T, V] fp32 tensor beyond one chunk"


def cpu_runtime_rows(model: ModelConfig, plan: Plan, setup: Setup) -> List[tuple]:
    """The terms MindSpore's CPU runtime adds (launch/plan.py docstring), one row each; none on Ascend."""
    if setup.device != "CPU":
        return []
    memory = plan.memory
    layers = cpu_kept_layers(model, plan.layout)
    return [
        (
            "CPU runtime buffers",
            memory.runtime_buffers,
            f"measured: {CPU_RUNTIME_HIDDEN_ROWS} fp32 hidden rows per token in each of {layers} layer(s)",
        ),
        (
            "CPU compiled graphs",
            memory.graphs,
            f"measured: {CPU_GRAPH_BASE_BYTES / GIB:g} GiB + {CPU_GRAPH_BYTES_PER_LAYER / GIB:g} GiB per layer "
            f"({model.num_layers + model.mtp_layers})",
        ),
        ("CPU optimizer library", memory.library, "measured, fixed: mindformers imported by the optimizer"),
    ]


def memory_lines(model: ModelConfig, plan: Plan, batch: Batch, setup: Setup, plan_cfg: PlanConfig) -> List[str]:
    memory, layout = plan.memory, plan.layout
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    usable = (
        f"of {plan.budget / GIB:.1f} usable ({plan_cfg.device_memory_gb:g} GiB - "
        f"{plan_cfg.reserved_gb:g} reserved): {verdict}"
    )
    accumulation = f"fp32 gradient sums of {plan.micro_batches} micro-batches" if plan.micro_batches > 1 else "none"
    if plan.micro_batches > 1 and layout.zero >= 2:
        accumulation += ", owned ranges only"
    rows = [
        ("weights", memory.weights, weights_note(setup, layout)),
        ("gradients", memory.grads, gradient_note(layout)),
        ("optimizer", memory.optimizer, optimizer_note(layout, setup)),
        ("accumulation", memory.accumulation, accumulation),
        ("update", memory.update, "fp32 gradient copies the step reads (clipped, summed)"),
        ("activations", memory.activations, activation_note(model, plan, batch, setup)),
        ("loss", memory.loss, loss_note(model)),
        ("gathered weights", memory.gathered, gathered_note(layout)),
        ("communication buffers", memory.comm, "estimate"),
        *cpu_runtime_rows(model, plan, setup),
        ("total", memory.total, usable),
    ]
    lines = [
        f"layout: {layout.keys()} on {layout.devices} devices (launch.nodes x launch.procs_per_node)",
        f"  tokens per step: {plan.tokens_per_step:,}; micro-batches per step per data-parallel replica: "
        f"{plan.micro_batches}; planned for {setup.device}",
        f"  not implemented in the trainer, so not planned: {NOT_IMPLEMENTED}",
        "  per-device memory, GiB:",
    ]
    return lines + [f"    {label:<23}{gib(value)}   {note}" for label, value, note in rows]


def search_lines(fitting: List[Plan], devices: int, plan_cfg: PlanConfig) -> List[str]:
    header = (
        f"layouts that fit on {devices} devices of {plan_cfg.device_memory_gb:g} GiB: {len(fitting)} fit (best first)"
    )
    if not fitting:
        return [
            header,
            "  none: add devices, use LoRA (lora.enabled=true), lower data.micro_batch_size or data.seq_len, "
            "or check that data.global_batch_size is a multiple of the data-parallel size x data.micro_batch_size",
        ]
    lines = [header, f"  {'GiB/device':>10}  keys"]
    for plan in fitting[: plan_cfg.show_layouts]:
        lines.append(f"  {plan.memory.total / GIB:>10.2f}  {plan.layout.keys()}")
    return lines


def comm_lines(plan: Plan) -> List[str]:
    """The bytes one rank's collectives carry per step (:func:`launch.plan_state.comm_volume`)."""
    volume = plan.comm
    parts = ", ".join(
        f"{name.replace('_', '-')} {getattr(volume, name) / GIB:.2f}"
        for name in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    )
    return [f"  communication per step per rank, GiB (tensor sizes): {parts}"]


def bound_lines(model: ModelConfig, plan: Plan) -> List[str]:
    """The 16-bytes-per-parameter lower bound in devices, and this layout's devices against it."""
    total = count_parameters(model).total + model.mtp_layers * mtp_layer_parameters(model)
    bound = lower_bound_devices(total, plan.budget)
    return [
        f"  lower bound: {bound} devices of {plan.budget / GIB:.1f} usable GiB hold {LOWER_BOUND_BYTES_PER_PARAMETER} "
        f"bytes per parameter ({billions_of(total)} parameters, MTP included) once; this layout uses "
        f"{plan.layout.devices} = {plan.layout.devices / bound:.2f}x that"
    ]


def billions_of(count: float) -> str:
    return f"{count / 1e9:.1f} B" if count >= 1e8 else f"{count / 1e6:.2f} M"
