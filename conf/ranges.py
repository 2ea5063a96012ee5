"""The domain of every numeric ``train.*`` and ``data.*`` key (and ``parallel.zero``), checked before a run builds.

Hydra's structured config checks types only, so ``train.lr=-0.001`` would train the model away from the
data with exit 0. :func:`range_errors` lists every value outside its domain (all of them, not only the
first); :func:`check_ranges` raises one error naming each key, its value and the allowed range.
A test keeps :data:`TRAIN_RANGES` / :data:`DATA_RANGES` covering every numeric field of the dataclasses.
"""

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Range:
    """``low`` / ``high`` bounds (None: unbounded), each inclusive unless ``*_open``; ``note`` says what
    a boundary value means (e.g. ``0 disables clipping``)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def contains(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def text(self) -> str:
        if self.high is None:
            bound = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            bound = (
                f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}"
            )
        return bound + (f" ({self.note})" if self.note else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def at_least(low: float, note: str = "") -> Range:
    return Range(low, note=note)


def above(low: float, note: str = "") -> Range:
    return Range(low, low_open=True, note=note)


#: Domains of the numeric ``train.*`` keys (``train.betas`` holds two values; each has this range).
#: mindformers' AdamW takes betas strictly inside (0, 1).
TRAIN_RANGES = {
    "max_steps": at_least(1),
    "lr": above(0),
    "warmup_ratio": Range(0, 1, high_open=True),
    "min_lr_ratio": Range(0, 1, note="the final learning rate as a share of train.lr"),
    "weight_decay": at_least(0),
    "betas": Range(0, 1, low_open=True, high_open=True),
    "eps": above(0),
    "grad_clip": at_least(0, "0 disables clipping"),
    "log_every": at_least(1),
    "eval_every": at_least(0, "0 = only at the end"),
    "eval_batches": at_least(0, "0 = the whole validation split"),
    "save_every": at_least(1),
    "keep_last": at_least(1),
    "seed": Range(0, 2**32 - 1),
    "max_bad_steps": at_least(1),
    "peak_gflops": at_least(0, "0 = measure at start-up"),
    "loss_scale": above(0),
    "loss_scale_window": at_least(1),
    "mtp_loss_coeff": at_least(0, "the weight of the MTP loss; read only with model.mtp_layers > 0"),
}

#: Domains of the numeric ``data.*`` keys (``data.weights`` is checked with ``data.train_files``).
DATA_RANGES = {
    "seq_len": at_least(1),
    "global_batch_size": at_least(1),
    "micro_batch_size": at_least(1),
    "vocab_size": at_least(1),
    "num_proc": at_least(1),
    "shard_windows": at_least(1),
    "wait_timeout_s": above(0, "seconds"),
}


#: Domains of the numeric ``parallel.*`` keys checked here (``dp`` and ``ep`` are checked against the world size,
#: :func:`conf.checks.resolve_layout`).
PARALLEL_RANGES = {
    "zero": Range(0, 1, note="0 = every rank holds all its AdamW moments, 1 = ZeRO-1: moments split over ranks"),
}


def _betas_errors(betas, domain: Range) -> list:
    values = list(betas)
    if len(values) != 2 or not all(domain.contains(value) for value in values):
        return [f"train.betas={values} must be two values (beta1, beta2), each {domain.text()}"]
    return []


RANGES = {"train": TRAIN_RANGES, "data": DATA_RANGES, "parallel": PARALLEL_RANGES}


def section_range_errors(section: str, values, keys=None) -> list:
    """``"<section>.<key>=<value> must be <range>"`` for every value of ``values`` (a ``train``, ``data`` or
    ``parallel`` section) outside its domain; ``keys`` limits the check to those keys."""
    errors = []
    for key, domain in RANGES[section].items():
        if keys is not None and key not in keys:
            continue
        value = getattr(values, key)
        if key == "betas":
            errors += _betas_errors(value, domain)
        elif not domain.contains(value):
            errors.append(f"{section}.{key}={value} must be {domain.text()}")
    return errors


def range_errors(cfg) -> list:
    """Every out-of-range ``train.*``, ``data.*`` and ``parallel.*`` value of the run config ``cfg``."""
    errors = section_range_errors("train", cfg.train) + section_range_errors("data", cfg.data)
    # A partial config (a caller's own sections) is checked on the parallel.* keys it has.
    parallel = getattr(cfg, "parallel", None)
    keys = [key for key in PARALLEL_RANGES if hasattr(parallel, key)]
    return errors + (section_range_errors("parallel", parallel, keys) if keys else [])


def raise_range_errors(errors: list) -> None:
    """One ValueError listing every error of :func:`range_errors` (none: nothing)."""
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError(f"{len(errors)} config values are out of range:\n  " + "\n  ".join(errors))


def check_ranges(cfg) -> None:
    """Raise one ValueError listing every out-of-range ``train.*`` / ``data.*`` value of ``cfg``."""
    raise_range_errors(range_errors(cfg))
