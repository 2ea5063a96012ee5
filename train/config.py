"""Training section of the run config (``train.*`` keys)."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from mindmoe.conf.ranges import Range, above, at_least, bounded
from mindmoe.model.config import ModelConfig

#: ``train.dtype`` values; :mod:`train.precision` maps each to its MindSpore dtype.
COMPUTE_DTYPE_NAMES = ("fp32", "bf16", "fp16")
ON_CORRUPT_CHECKPOINT = ("error", "previous")
#: What a resumed run compares with its checkpoint: the whole ``model.*`` but where it came from.
ARCHITECTURE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "pretrained")
#: What ``train.resume_allow_changes`` may list (:mod:`train.checkpoints.resume_checks` checks these on resume).
ALLOWABLE_CHANGES = ("data.seq_len", "train.seed", *(f"model.{name}" for name in ARCHITECTURE_FIELDS))


@dataclass
class TrainConfig:
    """Optimisation, schedule, logging and checkpointing of one run."""

    #: Optimizer steps to run.
    max_steps: int = bounded(200, at_least(1))
    #: Peak learning rate (AdamW).
    lr: float = bounded(3e-3, above(0))
    #: Share of ``max_steps`` spent in linear warmup from 0 to ``lr``.
    warmup_ratio: float = bounded(0.05, Range(0, 1, high_open=True))
    #: Final learning rate of the cosine decay as a share of ``lr``.
    min_lr_ratio: float = bounded(0.1, Range(0, 1, note="the final learning rate as a share of train.lr"))
    #: AdamW decoupled weight decay (never applied to norms, biases or router biases).
    weight_decay: float = bounded(0.1, at_least(0))
    #: AdamW (beta1, beta2).
    betas: List[float] = bounded(default_factory=lambda: [0.9, 0.95], domain=Range(0, 1, low_open=True, high_open=True))
    #: AdamW epsilon.
    eps: float = bounded(1e-8, above(0))
    #: Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip: float = bounded(1.0, at_least(0, "0 disables clipping"))
    #: Write a metrics row (and a TensorBoard point) every this many steps.
    log_every: int = bounded(10, at_least(1))
    #: Validation interval in steps (0 = only at the end).
    eval_every: int = bounded(100, at_least(0, "0 = only at the end"))
    #: Cap on validation micro-batches per evaluation, over all data-parallel ranks (0 = the whole split).
    eval_batches: int = bounded(0, at_least(0, "0 = the whole validation split"))
    #: Checkpoint interval in steps (a checkpoint is always written at the last step).
    save_every: int = bounded(100, at_least(1))
    #: Complete checkpoints of the current lineage kept in ``<run dir>/checkpoints``; older ones are deleted
    #: (incomplete or truncated ones are neither counted nor deleted; :mod:`train.checkpoints.lineage`).
    keep_last: int = bounded(2, at_least(1))
    #: ``auto`` (newest ``step_*`` checkpoint of this run dir, never one under ``abandoned-*``), ``none`` or a
    #: checkpoint directory. Checkpoints of this run dir that the run does not continue are moved to
    #: ``checkpoints/abandoned-<UTC time>/``, never deleted.
    resume: str = "auto"
    #: Keys a resumed run may change from what its checkpoint's ``state.json`` records, e.g.
    #: ``[data.seq_len,model.rope_theta]`` for a long-context continuation: ``data.seq_len``, ``train.seed``
    #: or an architecture key ``model.<name>``. Any other difference is an error naming the key and both
    #: values; the tokenizer (checked by the sha256 of its files) never changes on resume.
    resume_allow_changes: List[str] = field(default_factory=list)
    #: Seed of parameter initialisation and data order.
    seed: int = bounded(1234, Range(0, 2**32 - 1))
    #: Stop with an error after this many consecutive steps with a non-finite loss or gradient
    #: (each such step is skipped: no parameter or optimizer state changes). fp16 loss-scale
    #: overflows (finite loss, scale lowered) are skipped too but do not count.
    max_bad_steps: int = bounded(5, at_least(1))
    #: What resume does with a checkpoint that is incomplete (no ``state.json``, a listed file missing or of
    #: the wrong size) or fails its hash check: ``error`` or ``previous`` (fall back to the newest older
    #: checkpoint that verifies, with a warning).
    on_corrupt_checkpoint: str = "error"
    #: Peak fp32 GFLOP/s used for MFU; 0 = measure a large MatMul at start-up.
    peak_gflops: float = bounded(0.0, at_least(0, "0 = measure at start-up"))
    #: Show a tqdm progress bar.
    progress_bar: bool = True
    #: Precision of the weights the step computes with: ``fp32``, or ``bf16`` (Ascend) / ``fp16``. Half precision
    #: stores the trained weights in that dtype, with fp32 masters in the optimizer's ZeRO ranges (so several
    #: processes need ``parallel.zero`` >= 1); norms, softmax and the loss compute in fp32.
    dtype: str = "fp32"
    #: The dtype gradients are reduce-scattered and all-reduced in under half precision: ``fp32`` (the default:
    #: summing many ranks' bf16 gradients loses their low bits, as torchtitan's and Megatron's defaults avoid) or
    #: ``compute`` (``train.dtype``: half the bytes on the wire).
    grad_reduce_dtype: str = "fp32"
    #: Initial dynamic loss scale, used with ``dtype=fp16`` only (halved on overflow).
    loss_scale: float = bounded(65536.0, above(0))
    #: Finite fp16 steps in a row after which the loss scale doubles.
    loss_scale_window: int = bounded(1000, at_least(1))
    #: Recompute each decoder layer's activations in backward instead of storing them.
    recompute: bool = False
    #: Compile one decoder-layer body and call it for every layer of the same kind (MindSpore's
    #: ``lazy_inline`` cell reuse), so compile time stops growing with depth. Ascend only: the CPU
    #: backend of MindSpore 2.9 cannot run the reused-cell graph.
    cell_reuse: bool = False
    #: Weight of the multi-token-prediction loss (``model.mtp_layers`` > 0): the objective adds
    #: ``mtp_loss_coeff / U * sum_k CE_k`` over the U depths (DeepSeek-V3 §2.2; it used 0.3, then 0.1; GLM-4.5
    #: likewise), logged as ``mtp_loss``. Read only when the model has MTP layers.
    mtp_loss_coeff: float = bounded(0.3, at_least(0, "the weight of the MTP loss; read only with model.mtp_layers > 0"))


def validate_train_config(train: TrainConfig) -> None:
    """Raise ValueError naming the ``train.*`` key whose value cannot work, beyond the numeric domains
    (declared on the fields, checked first: :mod:`conf.ranges`); ``train.dtype`` is checked against the device by
    :func:`conf.checks.validate_precision`."""
    if train.grad_reduce_dtype not in ("fp32", "compute"):
        raise ValueError(f"train.grad_reduce_dtype={train.grad_reduce_dtype!r} must be 'fp32' or 'compute'")
    if train.on_corrupt_checkpoint not in ON_CORRUPT_CHECKPOINT:
        raise ValueError(f"train.on_corrupt_checkpoint={train.on_corrupt_checkpoint!r} must be 'error' or 'previous'")
    if train.resume not in ("auto", "none") and not Path(train.resume).expanduser().exists():
        raise ValueError(f"train.resume={train.resume!r}: not 'auto', 'none' or an existing checkpoint directory")
    for entry in train.resume_allow_changes:
        if entry not in ALLOWABLE_CHANGES:
            raise ValueError(
                f"train.resume_allow_changes: {entry!r} is not a key resume checks (the tokenizer never changes); "
                "allowed: data.seq_len, train.seed or an architecture key model.<name> (e.g. model.rope_theta)"
            )
