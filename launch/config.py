"""Parallel layout of a run (``parallel.*`` keys)."""
from dataclasses import dataclass


@dataclass
class ParallelConfig:
    """How the work is split over processes. The single-process layout is ``dp=1, ep=1``."""

    #: Data-parallel replicas.
    dp: int = 1
    #: Expert-parallel group size (the experts of each MoE layer are split over ``ep`` ranks).
    ep: int = 1
