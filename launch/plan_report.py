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
from mindmoe.model.config import ModelConfig

#: What the trainer does not have, so no layout uses it.
NOT_IMPLEMENTED = "tensor parallelism, pipeline parallelism"


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:8.2f}"


def weight_note(setup: Setup) -> str:
    trained = setup.trained
    if not trained.lora:
        return "fp32, every parameter trained"
    return f"LoRA: frozen base {trained.base_dtype}, norms/router/biases and adapters (r={trained.rank}) fp32"


def optimizer_note(setup: Setup) -> str:
    if setup.zero:
        return "AdamW m, v and a working copy, fp32, of the owned ranges only (ZeRO-1, parallel.zero=1)"
    return "AdamW m, v fp32, trained tensors only; not split (parallel.zero=0)"


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
    rows = [
        ("weights", memory.weights, weight_note(setup)),
        ("gradients", memory.grads, "fp32, trained tensors only"),
        ("optimizer", memory.optimizer, optimizer_note(setup)),
        ("accumulation", memory.accumulation, accumulation),
        ("update", memory.update, "fp32 gradient copies the step reads (clipped, summed)"),
        ("activations", memory.activations, activation_note(model, plan, batch, setup)),
        ("loss", memory.loss, loss_note(model)),
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
