"""``mindmoe-plan``: parameter counts and per-device training memory from the config alone.

    mindmoe-plan model=glm45 data.seq_len=4096 data.micro_batch_size=1 data.global_batch_size=4096 \\
        parallel.dp=128 parallel.ep=32 plan.pp=8 plan.devices=1024

The first two lines are always ``total parameters: N`` and ``active parameters: N``; then the
breakdown, the memory of the layout ``parallel.dp`` x ``plan.tp`` x ``plan.pp`` (``parallel.ep``)
and the smallest layouts that fit on ``plan.devices``. No weights are allocated and no files are
written. Exit 0 whenever a plan was made (also when nothing fits), 2 for a config it cannot plan.
"""

import sys
from typing import List

import hydra
from omegaconf import OmegaConf

from mindmoe.conf.exit_codes import reports_errors
from mindmoe.conf.quiet import quiet_framework_logs
from mindmoe.conf.schema import register_configs
from mindmoe.launch.plan import GIB, Batch, Layout, Plan, PlanConfig, plan_layout, search_layouts, validate_plan_config
from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.param_count import CATEGORIES, count_parameters, mtp_layer_parameters

register_configs()

#: A plan writes nothing: no run directory, no ``.hydra`` copy, no log file.
QUIET_HYDRA = {
    "hydra.run.dir": ".",
    "hydra.output_subdir": "null",
    "hydra/job_logging": "disabled",
    "hydra/hydra_logging": "disabled",
}

CATEGORY_LABELS = {
    "embeddings": "embeddings (input + LM head)",
    "attention": "attention",
    "dense_ffn": "dense FFN",
    "experts": "routed experts",
    "shared_experts": "shared experts",
    "router": "router",
    "norms": "norms",
}


def billions(count: float) -> str:
    """``352.80 B``, ``4.26 M``: published sizes are quoted in billions; tiny models need millions."""
    return f"{count / 1e9:.2f} B" if count >= 1e8 else f"{count / 1e6:.2f} M"


def count_lines(cfg: ModelConfig) -> List[str]:
    counts = count_parameters(cfg)
    mtp = mtp_layer_parameters(cfg)
    tied = "tied, counted once" if cfg.tie_word_embeddings else "untied"
    lines = [
        f"total parameters: {counts.total}",
        f"active parameters: {counts.active}",
        f"  total  = {billions(counts.total)}: every trained parameter, input embedding and LM head included "
        f"({tied}); MTP layer not included (not modelled); router correction bias not included (a buffer). "
        "Equals HF num_parameters().",
        f"  active = {billions(counts.active)} per token: input embedding and LM head excluded, "
        f"{cfg.top_k} of {cfg.num_experts} routed experts per MoE layer.",
        f"  active incl. LM head: {counts.active_with_lm_head} ({billions(counts.active_with_lm_head)})",
        f"  an MTP layer (not modelled) would add {mtp} ({billions(mtp)}): total incl. one MTP layer "
        f"{counts.total + mtp} ({billions(counts.total + mtp)})",
        "",
        f"  {'parameters':<34}{'total':>18}{'active per token':>18}",
    ]
    for category in CATEGORIES:
        total = counts.categories[category]
        if category == "embeddings":
            active = 0
        elif category == "experts":
            active = total // cfg.num_experts * cfg.top_k
        else:
            active = total
        lines.append(f"  {CATEGORY_LABELS[category]:<34}{total:>18,}{active:>18,}")
    lines.append(f"  {'sum':<34}{counts.total:>18,}{counts.active:>18,}")
    if counts.buffers:
        lines.append(f"  {'(buffer) e_score_correction_bias':<34}{counts.buffers:>18,}   not counted")
    return lines


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:8.2f}"


def layout_name(layout: Layout) -> str:
    return (
        f"dp={layout.dp} tp={layout.tp} pp={layout.pp} ep={layout.ep} (edp={layout.edp}), "
        f"zero={layout.zero}, recompute={'on' if layout.recompute else 'off'}"
    )


def memory_lines(plan: Plan, plan_cfg: PlanConfig, grad_dtype: str) -> List[str]:
    worst = plan.worst
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    optimizer = "fp32 master + Adam m, v" + (f", ZeRO-{plan.layout.zero}" if plan.layout.zero else ", replicated")
    usable = (
        f"of {plan.budget / GIB:.1f} usable ({plan_cfg.device_memory_gb:g} GiB - "
        f"{plan_cfg.reserved_gb:g} reserved): {verdict}"
    )
    rows = [
        ("weights", worst.weights, "bf16"),
        ("gradients", worst.grads, grad_dtype),
        ("optimizer", worst.optimizer, optimizer),
        ("activations", worst.activations, "recomputed per layer" if plan.layout.recompute else "all kept"),
        ("communication buffers", worst.comm, "estimate"),
        ("total", worst.total, usable),
    ]
    lines = [
        f"layout: {layout_name(plan.layout)} on {plan.layout.devices} devices",
        f"  tokens per step: {plan.tokens_per_step:,}; micro-batches per step per data-parallel rank: "
        f"{plan.micro_batches}; 1F1B pipeline bubble {100 * plan.bubble:.1f}%",
        f"  per-device memory, GiB (worst: pipeline stage {worst.stage} of {len(plan.stages)}, {worst.layers} layers):",
    ]
    lines += [f"    {label:<23}{gib(value)}   {note}" for label, value, note in rows]
    if len(plan.stages) > 1:
        lines.append("  per stage (GiB): " + " ".join(f"{stage.total / GIB:.1f}" for stage in plan.stages))
    return lines


def search_lines(fitting: List[Plan], devices: int, plan_cfg: PlanConfig) -> List[str]:
    header = (
        f"smallest layouts that fit on {devices} devices of {plan_cfg.device_memory_gb:g} GiB "
        f"(zero={plan_cfg.zero}, tp <= {plan_cfg.max_tp}): {len(fitting)} fit"
    )
    if not fitting:
        return [
            header,
            "  none: add devices, raise plan.zero, lower data.micro_batch_size, or check that "
            "data.global_batch_size is a multiple of dp * data.micro_batch_size",
        ]
    lines = [
        header,
        f"  {'tp':>3} {'pp':>3} {'ep':>4} {'dp':>5} {'edp':>5} {'recompute':>9} {'GiB/device':>10} {'bubble':>7}",
    ]
    for plan in fitting[: plan_cfg.show_layouts]:
        layout = plan.layout
        lines.append(
            f"  {layout.tp:>3} {layout.pp:>3} {layout.ep:>4} {layout.dp:>5} {layout.edp:>5} "
            f"{'on' if layout.recompute else 'off':>9} {plan.worst.total / GIB:>10.2f} "
            f"{100 * plan.bubble:>6.1f}%"
        )
    return lines


def resolve_vocab(model: ModelConfig, data) -> List[str]:
    """The trainer takes vocab_size 0 from the tokenizer; the planner can only do that for one it trains."""
    if model.vocab_size:
        return []
    if data.tokenizer:
        raise ValueError(
            f"model.vocab_size=0 means 'from the tokenizer' ({data.tokenizer}); the planner "
            "does not load tokenizers: set model.vocab_size"
        )
    model.vocab_size = data.vocab_size
    return [f"(model.vocab_size=0: using data.vocab_size={data.vocab_size}, the tokenizer trained here)"]


def report(cfg) -> List[str]:
    model: ModelConfig = OmegaConf.to_object(cfg.model)
    plan_cfg: PlanConfig = OmegaConf.to_object(cfg.plan)
    notes = resolve_vocab(model, cfg.data)
    validate_model_config(model)
    validate_plan_config(plan_cfg)
    batch = Batch(
        seq_len=cfg.data.seq_len, micro_batch=cfg.data.micro_batch_size, global_batch=cfg.data.global_batch_size
    )
    layout = Layout(
        dp=cfg.parallel.dp or 1,
        tp=plan_cfg.tp,
        pp=plan_cfg.pp,
        ep=cfg.parallel.ep,
        zero=plan_cfg.zero,
        recompute=plan_cfg.recompute,
    )
    planned = plan_layout(model, layout, batch, plan_cfg)
    devices = plan_cfg.devices or layout.devices
    lines = count_lines(model) + notes + [""]
    lines += memory_lines(planned, plan_cfg, plan_cfg.grad_dtype) + [""]
    lines += search_lines(search_layouts(model, devices, batch, plan_cfg), devices, plan_cfg)
    return lines


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
@reports_errors("mindmoe-plan")
def _main(cfg) -> None:
    print("\n".join(report(cfg)))


def main() -> None:
    quiet_framework_logs()
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in sys.argv[1:]}
    sys.argv[1:1] = [f"{key}={value}" for key, value in QUIET_HYDRA.items() if key not in given]
    _main()


if __name__ == "__main__":
    main()
