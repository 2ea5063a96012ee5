"""``recipe=glm5_tiny`` (DeepSeek Sparse Attention's two stages, train/dsa_stage.py), shrunk to compile fast: the
dense warm-up trains only the indexers and lowers ``indexer_loss``; then every parameter trains with sparse
attention on the same learning-rate schedule; a run resumed inside the warm-up repeats the same steps."""

import shutil

import numpy as np
from safetensors.numpy import load_file

from tests.helpers.runs import compose_config, metrics_rows

WARMUP = 3
STEPS = 6
OVERRIDES = [
    "recipe=glm5_tiny",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.q_lora_rank=32",
    "model.kv_lora_rank=32",
    "model.num_experts=8",
    "model.top_k=2",
    "model.moe_intermediate_size=32",
    "data.seq_len=64",  # index_topk 32: the later queries keep half their keys
    "data.global_batch_size=8",
    "data.micro_batch_size=4",  # two micro-batches: the accumulating step functions
    f"train.max_steps={STEPS}",
    f"dsa.warmup_steps={WARMUP}",
    "train.log_every=1",
    "train.eval_every=0",
    "data.valid_files=[]",  # training losses and weights are checked: no evaluation graph to compile
    "train.save_every=1",
    f"train.keep_last={STEPS}",
    "train.progress_bar=false",
]


def weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def test_glm5_tiny_warms_the_indexers_up_then_trains_sparse_and_resumes_in_the_right_stage(tmp_path, data_cache):
    from mindmoe.train.loop import run

    run_dir = tmp_path / "run"
    run(compose_config([*OVERRIDES, f"data.cache_dir={data_cache}"]), run_dir)
    rows = {row["step"]: row for row in metrics_rows(run_dir) if "loss" in row}
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert rows[WARMUP]["indexer_loss"] < 0.8 * rows[1]["indexer_loss"], "the warm-up must lower indexer_loss"
    for row in rows.values():
        total = row["lm_loss"] + row["aux_loss"] + row["z_loss"] + row["mtp_loss"] + row["indexer_loss"]
        assert abs(row["loss"] - total) < 1e-5 * max(1.0, abs(row["loss"]))  # indexer_loss_coeff 1
    # The schedule goes on at the switch (a new optimizer, its step counter set to the warm-up's end).
    lrs = [rows[step]["lr"] for step in range(1, STEPS + 1)]
    assert all(later < earlier for earlier, later in zip(lrs[1:], lrs[2:])), lrs

    first, warm, last = weights(run_dir, 1), weights(run_dir, WARMUP), weights(run_dir, STEPS)
    indexer = [name for name in first if ".self_attn.indexer." in name]
    assert len(indexer) == 5 * 3  # two layers and the MTP depth
    for name in first:
        if name in indexer:
            assert not np.array_equal(first[name], warm[name]), f"{name} did not train in the warm-up"
        else:  # router correction biases included: no bias update in the warm-up
            np.testing.assert_array_equal(first[name], warm[name], err_msg=f"{name} changed in the warm-up")
    changed = [name for name in first if name not in indexer and not np.array_equal(warm[name], last[name])]
    assert len(changed) > 0.8 * (len(first) - len(indexer)), "sparse training must train the main model"

    # Resumed from step 1's checkpoint: the rest of the warm-up, the switch and the sparse steps again.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step_000001", resumed / "checkpoints" / "step_000001")
    run(compose_config([*OVERRIDES, f"data.cache_dir={data_cache}"]), resumed)
    again = {row["step"]: row for row in metrics_rows(resumed) if "loss" in row}
    for step in range(2, STEPS + 1):
        for key in ("loss", "lm_loss", "indexer_loss"):
            np.testing.assert_allclose(again[step][key], rows[step][key], rtol=1e-5, err_msg=f"{key} of {step}")
