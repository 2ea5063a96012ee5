"""ZeRO-1 (``parallel.zero=1``) on 2 data-parallel CPU workers (mccl) through ``mindmoe-launch``: the per-step losses
of one process without it, half of the AdamW moments on each rank, and a checkpoint with full moments that one
process without ZeRO resumes on the same loss curve."""

import re
import subprocess

import numpy as np
import pytest

from tests.helpers.launches import LAUNCH_RUN, assert_same_losses, finish, launch_command, start, train_command
from tests.helpers.processes import free_port
from tests.helpers.runs import REPO, losses_by_step
from tests.helpers.shared_runs import reference_runs

STEPS = int(next(o for o in LAUNCH_RUN if o.startswith("train.max_steps=")).split("=")[1])
SAVE_AT = int(next(o for o in LAUNCH_RUN if o.startswith("train.save_every=")).split("=")[1])  # the first checkpoint
MOMENT_LINE = re.compile(r"zero: rank (\d) holds (\d+) of (\d+) AdamW moment elements")


@pytest.mark.msrun
def test_zero1_on_two_workers_gives_the_losses_of_one_process_with_half_the_moments_and_resumes_without_it(
    tmp_path, tmp_path_factory, data_cache, processes
):
    from mindmoe.model.checkpoints.shards import read_tensors

    run_dir = tmp_path / "zero1"
    launcher = start(
        processes,
        launch_command(
            run_dir, data_cache, "parallel.zero=1", "launch.procs_per_node=2", f"launch.master_port={free_port()}"
        ),
    )
    # The session's one-process run of the same overrides (trained now, while the workers compile, if no test
    # asked for it yet).
    single = losses_by_step(reference_runs(tmp_path_factory, data_cache, {"default": ()})["default"])
    code, stdout, stderr = finish(launcher)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert_same_losses(losses_by_step(run_dir), single, range(1, STEPS + 1))

    # Each rank's moments are half of the full ones (a tensor of odd size pads its last range by one element).
    shares = {}
    for rank in (0, 1):
        log = (run_dir / "msrun" / f"worker_{rank}.log").read_text()
        (match,) = [m for m in MOMENT_LINE.finditer(log) if int(m.group(1)) == rank]
        shares[rank] = int(match.group(2)), int(match.group(3))
    checkpoint = run_dir / "checkpoints" / f"step_{SAVE_AT:06d}"
    moments = dict(read_tensors(checkpoint, "optimizer"))
    weights = dict(read_tensors(checkpoint, "model"))
    trained = [name for name in weights if f"adam_m.{name}" in moments]
    full = 2 * sum(weights[name].size for name in trained)
    for held, total in shares.values():
        assert total == full and 0 <= 2 * held - full <= 2 * 2 * len(trained), shares
    # The checkpoint holds the full moments, from both ranks (rank 1 owns the second halves).
    for name in trained:
        assert moments[f"adam_v.{name}"].shape == weights[name].shape
    assert all(np.any(moments[f"adam_v.{name}"].reshape(-1)[-(weights[name].size // 2) :]) for name in trained)

    resumed_dir = tmp_path / "resumed"
    command = train_command(resumed_dir, data_cache, f"train.resume={checkpoint}")
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=900)
    resumed = losses_by_step(resumed_dir)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert_same_losses(resumed, single, range(SAVE_AT + 1, STEPS + 1))
