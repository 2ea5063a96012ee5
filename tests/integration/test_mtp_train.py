"""A short training run with multi-token prediction logs ``mtp_loss`` and lowers it."""

import json

from tests.helpers.runs import compose_config
from tests.helpers.tiny_run import TINY_RUN


def test_a_run_with_one_mtp_layer_logs_mtp_loss_and_lowers_it(tmp_path, data_cache):
    from mindmoe.train.loop import run

    run_dir = tmp_path / "run"
    cfg = compose_config(
        [
            *TINY_RUN,
            "model.mtp_layers=1",
            "train.mtp_loss_coeff=0.3",
            "train.max_steps=12",
            "train.save_every=12",
            f"data.cache_dir={data_cache}",
        ]
    )
    run(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if "loss" in row]
    assert all("mtp_loss" in row for row in train_rows)
    first, last = train_rows[0], train_rows[-1]
    assert last["mtp_loss"] < first["mtp_loss"] - 0.1
    total = last["lm_loss"] + last["aux_loss"] + last["z_loss"] + last["mtp_loss"]
    assert abs(last["loss"] - total) < 1e-4
