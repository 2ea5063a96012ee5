"""Checkpoints and failures: writing, reading by parts, resuming, lineage, one writer per run dir."""
