"""``mindmoe-eval``: long-context evaluation of a checkpoint."""
