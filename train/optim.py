"""AdamW and the warmup + cosine schedule, both from mindformers.

Weight decay skips every 1-D parameter (RMSNorm weights, biases) and router biases: decaying
a norm gain or a bias towards zero only fights the model.
"""

import os

from mindmoe.conf.ranges import raise_range_errors, section_range_errors
from mindmoe.train.config import TrainConfig
from mindmoe.train.precision import COMPUTE_DTYPES

# Checked here too (mindmoe-train checks every key earlier, conf.checks.validate_run_config), so a direct
# caller gets the train.* key named rather than mindformers' own argument names (beta1, weight_decay).
OPTIMIZER_KEYS = ("lr", "warmup_ratio", "min_lr_ratio", "weight_decay", "betas", "eps", "max_steps")


def _import_mindformers():
    # mindformers writes its logs to ./output/log unless told otherwise; keep them out of the cwd.
    os.environ.setdefault("LOG_MF_PATH", os.path.join(os.path.expanduser("~"), ".cache", "mindmoe", "mindformers_log"))
    from mindformers.core.lr import CosineWithWarmUpLR

    # The AdamW class itself: mindformers.core.optim.AdamW is a factory whose __new__ returns it.
    from mindformers.core.optim.adamw import AdamW

    from mindmoe.train.fused_adamw import fused_adamw_class

    return CosineWithWarmUpLR, fused_adamw_class(AdamW)


def decays(param) -> bool:
    return len(param.shape) > 1 and "bias" not in param.name.rsplit(".", 1)[-1]


def build_lr_schedule(cfg: TrainConfig):
    CosineWithWarmUpLR, _ = _import_mindformers()
    warmup_steps = int(round(cfg.warmup_ratio * cfg.max_steps))
    return CosineWithWarmUpLR(
        learning_rate=cfg.lr, warmup_steps=warmup_steps, total_steps=cfg.max_steps, lr_end=cfg.lr * cfg.min_lr_ratio
    )


def build_optimizer(
    params, cfg: TrainConfig, dist=None, zero: int = 0, collectives=None, seamed=frozenset(), held=None, masters=None
):
    """mindformers AdamW (fused update, train/fused_adamw.py) over ``params`` with two weight-decay groups.

    ``zero`` (``parallel.zero``) 1-3: the sharded variant (train/parallel/zero.py), moments split over the ranks of
    ``dist`` (None: one process) holding the same parameter, which then checkpoints them through their views;
    ``seamed``: the names of the parameters whose gradients stages 2 and 3 reduce in the backward
    (train/parallel/fsdp.py), ``held`` the specs of those already held as ranges (a rebuilt optimizer);
    ``collectives``: stand-ins for its reduce-scatter and all-gather (tests). ``masters``: the half-precision dtype
    the parameters will be stored in (``train.dtype``): their fp32 masters are the optimizer's ranges, taken from
    ``params`` now; this needs ZeRO on several ranks (one process: ranges of the whole tensors)."""
    raise_range_errors(section_range_errors("train", cfg, OPTIMIZER_KEYS))
    _, AdamW = _import_mindformers()
    params = list(params)
    decay = [p for p in params if decays(p)]
    no_decay = [p for p in params if not decays(p)]
    # MindSpore rejects an empty group (a LoRA run has no 1-D trainable parameter).
    groups = [
        group
        for group in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if group["params"]
    ]
    groups.append({"order_params": params})
    kwargs = dict(
        learning_rate=build_lr_schedule(cfg), betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    world = dist.world_size if dist is not None else 1
    if masters is not None and not zero:
        if world > 1:
            raise ValueError(
                f"train.dtype={cfg.dtype} stores half-precision weights whose fp32 masters live in the optimizer's "
                f"ZeRO ranges: set parallel.zero to 1, 2 or 3 on {world} processes (or train.dtype=fp32)"
            )
        zero = 1  # one process: the ranges are the whole tensors
    if not zero:
        return AdamW(groups, **kwargs)
    from mindmoe.train.parallel.ranges import shard_specs
    from mindmoe.train.parallel.zero import log_moment_share, zero_adamw_class

    reduce_dtype = COMPUTE_DTYPES[cfg.dtype] if cfg.grad_reduce_dtype == "compute" else None
    optimizer = zero_adamw_class(AdamW)(
        groups, shard_specs(params, dist, held), collectives, zero, seamed, masters, reduce_dtype, **kwargs
    )
    log_moment_share(optimizer, 0 if dist is None else dist.rank)
    if dist is not None:
        dist.track_zero(optimizer)
    return optimizer
