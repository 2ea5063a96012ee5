"""Counting skipped steps, and stopping a run whose steps keep going bad (``train.max_bad_steps``).

A step is skipped (no parameter or moment changes) when its loss or gradient norm is not finite.
Two kinds of skips differ in what they mean:

- a bad step: the fp32 loss or the unscaled gradient is not finite. The model or the data is
  broken; ``train.max_bad_steps`` of them in a row stop the run.
- a loss-scale overflow (fp16 with dynamic loss scaling, ``StepStats.overflow``): the loss is
  finite, only the scaled gradients overflowed, and the scale has been halved. It is the scaler
  searching for its range, so it neither counts toward the limit nor ends a run of bad steps.
"""

import logging

log = logging.getLogger("mindmoe.train")


class BadStepCounter:
    """``skipped`` counts every skipped update (for the metrics), ``in_row`` the consecutive bad steps."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.in_row = 0
        self.skipped = 0

    def record(self, step: int, stats) -> None:
        """Count ``stats`` (a ``StepStats``) of ``step``; raises once ``max_bad_steps`` bad steps came in a row."""
        if not stats.skipped:
            self.in_row = 0
            return
        self.skipped += 1
        if stats.overflow:
            log.info(
                "step %d: fp16 gradients overflowed; update skipped, loss scale lowered to %g", step, stats.loss_scale
            )
            return
        self.in_row += 1
        log.warning(
            "step %d: non-finite loss %.4g or gradient norm %.4g; update skipped (%d in a row)",
            step,
            stats.loss,
            stats.grad_norm,
            self.in_row,
        )
        if self.in_row >= self.max_bad_steps:
            raise FloatingPointError(
                f"{self.in_row} consecutive steps up to step {step} had a non-finite loss or gradient "
                f"(train.max_bad_steps={self.max_bad_steps}); last loss {stats.loss}, gradient norm "
                f"{stats.grad_norm}. Lower train.lr, check the data, or resume from an earlier checkpoint."
            )
