"""Numeric domains of config keys, written on their dataclass fields and checked before a run builds.

Hydra's structured config checks types only, so ``train.lr=-0.001`` would train the model away from the
data with exit 0. A section's dataclass declares each numeric key's domain where it declares the key
(``lr: float = bounded(3e-3, above(0))``); :func:`range_errors` lists every value of the ``train.*``,
``data.*`` and ``parallel.*`` sections outside its domain (all of them, not only the first) and
:func:`check_ranges` raises one error naming each key, its value and the allowed range. ``moe.*`` is
checked with its other rules (:func:`model.moe_config.validate_moe_config`). A test keeps every numeric
field of those dataclasses bounded. This module imports nothing of mindmoe (every section's module uses it).
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

#: The ``metadata`` key of a dataclass field that holds its :class:`Range`.
RANGE = "range"


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

    def bound(self) -> str:
        """``>= 1``, ``> 0``, ``in [0, 1)``: the domain without its note."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return (
            f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
            f"{')' if self.high_open else ']'}"
        )

    def text(self) -> str:
        return self.bound() + (f" ({self.note})" if self.note else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def at_least(low: float, note: str = "") -> Range:
    return Range(low, note=note)


def above(low: float, note: str = "") -> Range:
    return Range(low, low_open=True, note=note)


def bounded(default=dataclasses.MISSING, domain: Range = None, default_factory=dataclasses.MISSING):
    """A dataclass field whose value must lie in ``domain`` (a list field: each of its values)."""
    return field(default=default, default_factory=default_factory, metadata={RANGE: domain})


def field_ranges(cls) -> dict:
    """``{field name: Range}`` of the bounded fields of dataclass ``cls`` (or of an instance, or a structured
    OmegaConf node of one); ``{}`` for anything else."""
    if not dataclasses.is_dataclass(cls):
        from omegaconf import OmegaConf  # here: conf.moved_keys reaches this module and must stay light

        cls = OmegaConf.get_type(cls) if OmegaConf.is_config(cls) else None
    if not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: f.metadata[RANGE] for f in dataclasses.fields(cls) if RANGE in f.metadata}


def _betas_errors(betas, domain: Range) -> list:
    values = list(betas)
    if len(values) != 2 or not all(domain.contains(value) for value in values):
        return [f"train.betas={values} must be two values (beta1, beta2), each {domain.text()}"]
    return []


def section_range_errors(section: str, values, keys=None) -> list:
    """``"<section>.<key>=<value> must be <range>"`` for every value of ``values`` (a section's dataclass, or
    its structured node) outside the domain its field declares; ``keys`` limits the check to those keys."""
    errors = []
    for key, domain in field_ranges(values).items():
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
    # A partial config (a caller's own sections) may have no parallel section.
    parallel = getattr(cfg, "parallel", None)
    return errors + (section_range_errors("parallel", parallel) if parallel is not None else [])


def raise_range_errors(errors: list) -> None:
    """One ValueError listing every error of :func:`range_errors` (none: nothing)."""
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError(f"{len(errors)} config values are out of range:\n  " + "\n  ".join(errors))


def check_ranges(cfg) -> None:
    """Raise one ValueError listing every out-of-range ``train.*`` / ``data.*`` value of ``cfg``."""
    raise_range_errors(range_errors(cfg))
