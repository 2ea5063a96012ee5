"""Benchmarks of mindmoe on the machine at hand: ``python -m mindmoe.bench`` / ``mindmoe-bench``.

Every case runs in its own process (so its peak RSS is its own) and prints one JSON object
per line; :mod:`bench.__main__` combines them into the cross-case ratios and BENCHMARKS.md.
"""
