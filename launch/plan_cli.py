"""``mindmoe-plan``: parameter counts and per-device training memory of the trainer, from the config alone.

    mindmoe-plan model=glm45_air moe.bias_update_rate=0 lora.enabled=true plan.devices=8 plan.device_memory_gb=64

The first two lines are always ``total parameters: N`` and ``active parameters: N``; then the
breakdown and the memory of one layout: the ``parallel.*`` / ``train.recompute`` layout when one is
given, else (with ``plan.devices``) the best layout that fits, whose trainer keys it prints; then every
layout that fits on ``plan.devices``. No weights are allocated and no files are written. Exit 0
whenever a plan was made (also when nothing fits), 2 for a config it cannot plan.
"""

import sys
from typing import List, Optional

import hydra
from omegaconf import OmegaConf

from mindmoe.conf.exit_codes import CONFIG_ERROR, reports_errors
from mindmoe.conf.moved_keys import exit_on_moved_keys
from mindmoe.conf.policy import run_dsa_training, run_moe_config
from mindmoe.conf.quiet import quiet_framework_logs
from mindmoe.conf.schema import register_configs
from mindmoe.launch.plan import (
    COMPUTE_BYTES,
    Batch,
    Layout,
    Plan,
    PlanConfig,
    Setup,
    layout_errors,
    plan_layout,
    planned_candidates,
    validate_plan_config,
)
from mindmoe.launch.plan_params import Trained, lora_trained
from mindmoe.launch.plan_report import bound_lines, comm_lines, memory_lines, search_lines
from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.moe_config import validate_moe_config
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
        f"({tied}); MTP layers not included (HF does not count them); router correction bias not included "
        "(a buffer). "
        "Equals HF num_parameters().",
        f"  active = {billions(counts.active)} per token: input embedding and LM head excluded, "
        f"{cfg.top_k} of {cfg.num_experts} routed experts per MoE layer.",
        f"  active incl. LM head: {counts.active_with_lm_head} ({billions(counts.active_with_lm_head)})",
        mtp_line(cfg, counts.total, mtp),
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


def mtp_line(cfg: ModelConfig, total: int, mtp: int) -> str:
    """The MTP depths' size, outside ``total``; with ``model.mtp_layers`` the memory plan below includes them."""
    if not cfg.mtp_layers:
        return (
            f"  an MTP layer (model.mtp_layers=1 trains it; the memory plan then includes it) adds {mtp} "
            f"({billions(mtp)}): total incl. one MTP layer {total + mtp} ({billions(total + mtp)})"
        )
    depths = cfg.mtp_layers * mtp
    return (
        f"  model.mtp_layers={cfg.mtp_layers}: {cfg.mtp_layers} MTP layer(s) of {mtp} ({billions(mtp)}) add {depths}: "
        f"total incl. them {total + depths} ({billions(total + depths)}); their weights, gradients, optimizer "
        "state and activations are in the memory plan below"
    )


#: ``plan.*`` keys of the old planner that the trainer's own keys replace, or that it does not have.
REMOVED_PLAN_KEYS = {
    "tp": "tensor parallelism is not implemented in the trainer",
    "max_tp": "tensor parallelism is not implemented in the trainer",
    "pp": "pipeline parallelism is not implemented in the trainer",
    "zero": "use parallel.zero (1-3: ZeRO, the optimizer state, gradients and weights split over ranks)",
    "recompute": "use train.recompute",
    "flash_attention": "attention is the trainer's: blockwise on Ascend past 512 positions; set plan.device",
    "grad_dtype": "gradients are fp32 like the parameters; train.dtype sets the compute dtype",
    "grad_bucket_mb": "removed: the trainer reduces gradients without a configurable bucket",
}


def removed_key_error(args) -> Optional[str]:
    """The message for the first removed ``plan.*`` key among command-line ``args``, or None."""
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        name = key[len("plan.") :] if key.startswith("plan.") else ""
        if name in REMOVED_PLAN_KEYS:
            return f"{key}: {REMOVED_PLAN_KEYS[name]}"
    return None


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


def run_setup(cfg, model: ModelConfig, plan_cfg: PlanConfig) -> Setup:
    """The trainer's keys besides the layout: ``train.dtype``, ``lora.*``, ``moe.*``, ``dsa.*``."""
    dtype = cfg.train.dtype
    if dtype not in COMPUTE_BYTES:
        raise ValueError(f"train.dtype={dtype!r} must be one of {', '.join(COMPUTE_BYTES)}")
    if dtype != "fp32" and plan_cfg.device == "CPU":
        raise ValueError(f"train.dtype={dtype} with plan.device=CPU: the trainer runs fp32 on CPU")
    trained = Trained()
    if cfg.lora.enabled:
        trained = lora_trained(model, OmegaConf.to_object(cfg.lora), plan_cfg.device)
    clip = cfg.train.grad_clip > 0
    moe = run_moe_config(cfg)
    validate_moe_config(moe, model.expert_bias)
    stage = run_dsa_training(cfg).stage
    return Setup(device=plan_cfg.device, compute_dtype=dtype, trained=trained, clip=clip, moe=moe, dsa_stage=stage)


def given_layout(cfg, devices: int) -> Layout:
    """The ``parallel.*`` layout on ``devices`` processes (0: the fewest that layout needs)."""
    parallel = cfg.parallel
    routed = parallel.ep_dispatcher == "alltoall" and parallel.ep > 1
    if not devices:
        devices = (parallel.dp or parallel.ep) if routed else (parallel.dp or 1) * parallel.ep
    dp = parallel.dp or (devices if routed else devices // max(parallel.ep, 1))
    return Layout(
        dp=dp,
        ep=parallel.ep,
        dispatcher=parallel.ep_dispatcher,
        recompute=cfg.train.recompute,
        zero=parallel.zero,
        shard_size=parallel.shard_size,
    )


def layout_errors_of(model: ModelConfig, devices: int, batch: Batch) -> str:
    """Why the plainest layout of ``devices`` ranks (data parallel only) is refused."""
    return "; ".join(layout_errors(model, Layout(dp=devices), batch))


def planned_run(cfg):
    """``(model, plan config, setup, batch, notes)`` of a composed config tree: what every plan of it reads."""
    model: ModelConfig = OmegaConf.to_object(cfg.model)
    plan_cfg: PlanConfig = OmegaConf.to_object(cfg.plan)
    notes = resolve_vocab(model, cfg.data)
    validate_model_config(model)
    validate_plan_config(plan_cfg)
    setup = run_setup(cfg, model, plan_cfg)
    batch = Batch(
        seq_len=cfg.data.seq_len, micro_batch=cfg.data.micro_batch_size, global_batch=cfg.data.global_batch_size
    )
    return model, plan_cfg, setup, batch, notes


def given_plan(cfg) -> Plan:
    """The plan of the ``parallel.*`` layout of a composed config tree (``plan.devices`` processes, 0: the fewest
    it needs), as ``mindmoe-plan`` prints it for these keys."""
    model, plan_cfg, setup, batch, _ = planned_run(cfg)
    return plan_layout(model, given_layout(cfg, plan_cfg.devices), batch, plan_cfg, setup)


def report(cfg) -> List[str]:
    model, plan_cfg, setup, batch, notes = planned_run(cfg)
    layout_given = cfg.parallel.dp != 0 or cfg.parallel.ep != 1
    recompute_options = (True,) if cfg.train.recompute else (False, True)
    # parallel.zero / parallel.shard_size at their defaults: the search tries every stage and shard size.
    zero_options = (cfg.parallel.zero,) if cfg.parallel.zero else (0, 1, 2, 3)
    shard_options = (cfg.parallel.shard_size,) if cfg.parallel.shard_size else None
    devices = plan_cfg.devices
    lines = count_lines(model) + notes + [""]
    candidates = []
    if devices:
        options = (recompute_options, zero_options, shard_options)
        candidates = planned_candidates(model, devices, batch, plan_cfg, setup, *options)
    fitting = [p for p in candidates if p.fits]
    if devices and not layout_given:
        if not candidates:
            raise ValueError(f"no layout of plan.devices={devices} is valid: {layout_errors_of(model, devices, batch)}")
        planned = fitting[0] if fitting else min(candidates, key=lambda p: p.memory.total)
        lines.append(
            f"best layout that fits on {devices} devices (give these keys to mindmoe-launch):"
            if planned.fits
            else f"no layout fits on {devices} devices; the one needing the least memory:"
        )
    else:
        planned = plan_layout(model, given_layout(cfg, devices), batch, plan_cfg, setup)
    lines += memory_lines(model, planned, batch, setup, plan_cfg)
    lines += comm_lines(planned) + ([] if setup.trained.lora else bound_lines(model, planned))
    if devices:
        lines += [""] + search_lines(fitting, devices, plan_cfg)
    return lines


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
@reports_errors("mindmoe-plan")
def _main(cfg) -> None:
    print("\n".join(report(cfg)))


def main() -> None:
    quiet_framework_logs()
    exit_on_moved_keys("mindmoe-plan", sys.argv[1:])
    removed = removed_key_error(sys.argv[1:])
    if removed:
        print(f"mindmoe-plan: error: {removed}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in sys.argv[1:]}
    sys.argv[1:1] = [f"{key}={value}" for key, value in QUIET_HYDRA.items() if key not in given]
    _main()


if __name__ == "__main__":
    main()
