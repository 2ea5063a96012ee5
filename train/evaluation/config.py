"""Long-context evaluation section of the run config (``eval.*`` keys, read by ``mindmoe-eval``)."""

from dataclasses import dataclass, field
from typing import List, Optional

from mindmoe.model.rope_scaling import ROPE_SCALING_TYPES


@dataclass
class EvalConfig:
    """Validation perplexity of one checkpoint at several context lengths under each RoPE scaling type."""

    #: Context lengths L to evaluate; the validation files are packed into windows of L + 1 tokens.
    context_lengths: List[int] = field(default_factory=lambda: [128, 512, 1024])
    #: RoPE scaling types to compare (rows of the table), each applied to the same weights.
    scaling_types: List[str] = field(default_factory=lambda: list(ROPE_SCALING_TYPES))
    #: Scaling factor of every type but none; 0 = per column, L / trained length (at least 1).
    factor: float = 0.0
    #: Context length the checkpoint was trained at (L_orig of dynamic_ntk and yarn);
    #: 0 = ``data.seq_len`` of the run's ``resolved_config.yaml`` beside ``checkpoints/``.
    trained_length: int = 0
    #: false: tokens attend only within their own document, as in training. true: the whole window
    #: is one document for attention, so context really reaches L; the scored labels are the same.
    cross_document: bool = False
    #: MoE dispatch at evaluation: dropless (no token dropped, so a token's loss does not depend on
    #: where it sits in the batch) or capacity (as in training, capacity grows with the window).
    dispatch: str = "dropless"
    #: Windows per forward pass; every (type, length) pair compiles one graph of this batch.
    #: Activation memory grows with batch_size * L^2 (about 1.3 GB at 2 x 1024 for the tiny model).
    batch_size: int = 2
    #: Cap on validation windows per length (0 = all), rounded up to whole batches; the unigram
    #: baseline row of the table always covers every window.
    max_windows: int = 0
    #: Directory for ``long_context.json`` and ``long_context.md``; null = the Hydra run dir.
    out: Optional[str] = None


def validate_eval_config(cfg: EvalConfig) -> None:
    """Raise ValueError naming the ``eval.*`` key whose value cannot work."""

    def fail(key: str, why: str):
        raise ValueError(f"eval.{key}={getattr(cfg, key)!r}: {why}")

    lengths = list(cfg.context_lengths)
    if not lengths or any(length < 2 for length in lengths):
        fail("context_lengths", "must list at least one context length, each >= 2")
    if len(set(lengths)) != len(lengths):
        fail("context_lengths", "lists a length twice")
    types = list(cfg.scaling_types)
    unknown = [name for name in types if name not in ROPE_SCALING_TYPES]
    if not types or unknown:
        fail("scaling_types", f"must be a non-empty list of {ROPE_SCALING_TYPES}")
    if len(set(types)) != len(types):
        fail("scaling_types", "lists a type twice")
    if cfg.factor != 0 and cfg.factor < 1:
        fail("factor", "must be 0 (L / trained length per column) or >= 1")
    if cfg.trained_length < 0:
        fail("trained_length", "must be >= 0 (0 = read data.seq_len of the checkpoint's run)")
    if cfg.dispatch not in ("capacity", "dropless"):
        fail("dispatch", "must be one of ('capacity', 'dropless')")
    if cfg.batch_size < 1:
        fail("batch_size", "must be >= 1")
    if cfg.max_windows < 0:
        fail("max_windows", "must be >= 0 (0 = every validation window)")
