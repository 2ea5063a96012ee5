"""``mindmoe-export`` and ``mindmoe-generate``: serving graphs and HF directories from a checkpoint."""
