"""Parallelism of a training run: data parallelism, ZeRO, expert parallelism and its token exchanges."""
