"""Overrides of the smallest useful training run (plain data: importing it loads nothing)."""

# A run that compiles in seconds on one CPU core: 2 layers (the first dense), 4 experts, 64-token windows, no
# validation.
TINY_RUN = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=128",
    "model.moe_intermediate_size=32",
    "model.num_experts=4",
    "data.seq_len=64",
    "data.global_batch_size=8",
    "data.micro_batch_size=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress_bar=false",
    # No validation split: no evaluation graph to compile (about a fifth of the run); a test of validation
    # gives its own data.valid_files.
    "data.valid_files=[]",
]
