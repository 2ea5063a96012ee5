"""The files of a checkpoint: what each holds (files) and tensors read by parts (shards)."""
