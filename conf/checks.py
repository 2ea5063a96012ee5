"""Checks across config sections, the ones a single dataclass cannot express; each error names the key.

Per-section checks live beside their dataclass (``validate_model_config`` in ``model/config.py``,
``validate_train_config`` in ``train/config.py``, ``validate_launch_config`` in ``launch/config.py``,
...). This module combines them with the rules that read several sections or the device, and imports
no MindSpore and nothing of the trainer, so ``mindmoe-launch`` checks a layout before any worker starts:

- :func:`validate_run_config`: every ``mindmoe-train`` run, before anything is built;
- :func:`resolve_layout`: how the processes divide into data and expert parallelism;
- :func:`check_launch_config`: everything ``mindmoe-launch`` can check before it starts msrun.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from mindmoe.conf.explicit_keys import explicit_keys, model_fields
from mindmoe.conf.key_effects import warn_keys_without_effect
from mindmoe.conf.policy import run_dsa_training, run_moe_config
from mindmoe.conf.ranges import check_ranges
from mindmoe.data.config import validate_batch_sizes
from mindmoe.launch.config import validate_launch_config, world_size
from mindmoe.model.config import validate_model_config
from mindmoe.train.config import COMPUTE_DTYPE_NAMES, validate_train_config


def validate_precision(train, device_target: Optional[str]) -> None:
    """``train.dtype`` and ``train.cell_reuse`` against the device MindSpore runs on (``device_target`` None: only the
    device-independent part); the loss scale's domain is declared on its field (:mod:`conf.ranges`)."""
    if train.dtype not in COMPUTE_DTYPE_NAMES:
        raise ValueError(f"train.dtype={train.dtype!r} must be one of {', '.join(COMPUTE_DTYPE_NAMES)}")
    if train.dtype == "bf16" and device_target == "CPU":
        raise ValueError(
            "train.dtype=bf16: the CPU backend has no bf16 kernels for MatMul/Softmax/TopK; use train.dtype=fp32 "
            "(or fp16, which runs but slower than fp32) on CPU and bf16 on Ascend"
        )
    if train.cell_reuse and device_target == "CPU":
        raise ValueError(
            "train.cell_reuse=true: MindSpore's lazy_inline cell reuse needs the Ascend backend; the "
            'CPU backend of MindSpore 2.9 fails on the reused-layer graph ("Input[0] must be a Primitive '
            'ValueNode"). Use train.cell_reuse=false on CPU'
        )


def validate_run_config(cfg, device_target: Optional[str]) -> None:
    """The checks of a whole run config that need neither the data nor the model's vocabulary.

    ``device_target``: MindSpore's ``device_target`` ("CPU", "Ascend"); None skips the checks that
    depend on it (the workers repeat them once MindSpore runs). Every numeric ``train.*`` / ``data.*``
    value outside its domain is reported first, all in one error (:mod:`conf.ranges`).
    """
    check_ranges(cfg)
    validate_batch_sizes(cfg.data)
    validate_train_config(cfg.train)
    validate_precision(cfg.train, device_target)
    run_moe_config(cfg)
    run_dsa_training(cfg)
    if device_target == "CPU" and cfg.lora.enabled and cfg.lora.base_dtype == "bf16":
        raise ValueError(
            "lora.base_dtype=bf16: the CPU backend of MindSpore 2.9 has no bf16 kernel for the copies the train "
            "step makes of the embedding table (TensorMove), nor bf16 MatMul; use lora.base_dtype=auto (fp16 on "
            "CPU, bf16 on Ascend) or fp16 / fp32 on CPU"
        )


@dataclass(frozen=True)
class Layout:
    """How ``world_size`` processes are used, and the gradient accumulation it implies."""

    world_size: int
    dp: int
    ep: int
    accumulation: int
    # parallel.ep_dispatcher: with alltoall every rank is a data-parallel replica (dp == world_size).
    ep_dispatcher: str = "allgather"
    # parallel.shard_size resolved: the consecutive ranks a ZeRO range is split over (world_size without hybrid
    # sharding); the ranges are replicated world_size / shard_size times.
    shard_size: int = 0

    @property
    def shard_replicas(self) -> int:
        return self.world_size // (self.shard_size or self.world_size)

    @property
    def replicas_per_group(self) -> int:
        """Data-parallel replicas inside one expert group: 1 (allgather: the group is one replica) or ``ep``."""
        return self.ep if self.ep_dispatcher == "alltoall" else 1


#: Values of ``parallel.ep_dispatcher``.
EP_DISPATCHERS = ("allgather", "alltoall")


def resolve_layout(
    world_size: int,
    dp: int,
    ep: int,
    num_experts: int,
    global_batch_size: int,
    micro_batch_size: int,
    has_moe_layers: bool = True,
    ep_dispatcher: str = "allgather",
    shard_size: int = 0,
    zero: int = 0,
) -> Layout:
    """Check that ``world_size`` processes divide as configured; errors name the keys to change.

    ``dp = 0`` means ``world_size / ep`` (``ep_dispatcher="alltoall"``: ``world_size``, every rank reads its
    own micro-batches). Used by ``mindmoe-launch`` before any worker starts and by every worker before it
    compiles.
    """
    if ep_dispatcher not in EP_DISPATCHERS:
        raise ValueError(f"parallel.ep_dispatcher={ep_dispatcher!r} must be one of {', '.join(EP_DISPATCHERS)}")
    if ep < 1:
        raise ValueError(f"parallel.ep={ep} must be >= 1")
    if dp < 0:
        raise ValueError(f"parallel.dp={dp} must be >= 1, or 0 for (number of processes) / parallel.ep")
    if ep > 1:
        if not has_moe_layers:
            raise ValueError(f"parallel.ep={ep}: the model has no MoE layer to split; use parallel.ep=1")
        if num_experts % ep:
            raise ValueError(f"parallel.ep={ep} must divide model.num_experts={num_experts}")
        if world_size % ep:
            raise ValueError(
                f"parallel.ep={ep} must divide the number of processes {world_size} "
                "(launch.nodes x launch.procs_per_node)"
            )
    routed = ep_dispatcher == "alltoall" and ep > 1
    resolved_dp = dp or (world_size if routed else world_size // ep)
    if routed and resolved_dp != world_size:
        raise ValueError(
            f"parallel.dp={dp} with parallel.ep_dispatcher=alltoall: every one of the {world_size} processes "
            f"(launch.nodes x launch.procs_per_node) is a data-parallel replica; set parallel.dp=0 or {world_size}"
        )
    if not routed and resolved_dp * ep != world_size:
        raise ValueError(
            f"parallel.dp={dp} x parallel.ep={ep} = {resolved_dp * ep} processes, but {world_size} "
            f"{'are' if world_size > 1 else 'is'} started (launch.nodes x launch.procs_per_node); "
            "set parallel.dp=0 to use them all"
        )
    if micro_batch_size < 1 or global_batch_size % (micro_batch_size * resolved_dp):
        raise ValueError(
            f"data.global_batch_size={global_batch_size} must be a positive multiple of "
            f"data.micro_batch_size={micro_batch_size} x data-parallel size {resolved_dp} "
            f"(= {micro_batch_size * resolved_dp})"
        )
    if shard_size:
        if not zero:
            raise ValueError(
                f"parallel.shard_size={shard_size} shards ZeRO ranges: set parallel.zero to 1, 2 or 3, "
                "or parallel.shard_size=0"
            )
        if world_size % shard_size or shard_size % ep:
            raise ValueError(
                f"parallel.shard_size={shard_size} must divide the number of processes {world_size} "
                f"(launch.nodes x launch.procs_per_node) and be a multiple of parallel.ep={ep}"
            )
    return Layout(
        world_size=world_size,
        dp=resolved_dp,
        ep=ep,
        accumulation=global_batch_size // (micro_batch_size * resolved_dp),
        ep_dispatcher=ep_dispatcher if ep > 1 else "allgather",
        shard_size=shard_size or world_size,
    )


def check_launch_config(
    cfg, hydra_overrides, task_overrides=(), device_target: Optional[str] = None, runtime=None
) -> Layout:
    """Everything that can be wrong before a worker starts, naming the key to change; returns the layout.
    Warns once about explicit keys without effect (:mod:`conf.key_effects`), as every worker will.

    ``hydra_overrides`` / ``task_overrides``: Hydra's ``overrides.hydra`` and ``overrides.task``;
    ``device_target``: as in :func:`validate_run_config`; ``runtime``: Hydra's ``hydra.runtime`` (the
    chosen group options, see :func:`conf.explicit_keys.explicit_keys`).
    """
    # Reads config.json of model.pretrained as data; no MindSpore.
    from mindmoe.train.init_model import planned_model_config

    launch = cfg.launch
    validate_launch_config(launch)
    if launch.nodes > 1 and not any(o.startswith("hydra.run.dir=") for o in hydra_overrides):
        raise ValueError(
            f"launch.nodes={launch.nodes}: give every node the same shared run dir with "
            "hydra.run.dir=/shared/path (the default is a timestamp of each node's own clock)"
        )
    validate_run_config(cfg, device_target)
    # With model.pretrained the architecture is the directory's config.json (read here, as data) with
    # the explicit model.* keys: the command line's, the recipe's, a non-default model group's.
    keys = explicit_keys(task_overrides, runtime)
    model = planned_model_config(cfg, model_fields(keys))
    # The real vocabulary comes from the tokenizer; any positive size checks the other keys.
    validate_model_config(dataclasses.replace(model, vocab_size=model.vocab_size or cfg.data.vocab_size))
    layout = resolve_layout(
        world_size(launch),
        cfg.parallel.dp,
        cfg.parallel.ep,
        model.num_experts,
        cfg.data.global_batch_size,
        cfg.data.micro_batch_size,
        model.num_layers > model.first_k_dense,
        cfg.parallel.ep_dispatcher,
        cfg.parallel.shard_size,
        cfg.parallel.zero,
    )
    warn_keys_without_effect(keys, cfg, model)
    return layout
