"""Maintainer scripts of the repository, run from its root (``python -m tools.<...>``); not installed."""
