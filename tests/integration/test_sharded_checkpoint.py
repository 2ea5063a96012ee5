"""A checkpoint written by 2 expert-parallel workers (each writes only its experts) resumes in 1 process, and a
1-process checkpoint resumes on 2 workers, both on the loss curve of the uninterrupted run."""

import pytest
from safetensors import safe_open

from mindmoe.model.checkpoints.shards import read_tensors
from tests.helpers.launches import LAUNCH_RUN, assert_same_losses, finish, launch_command, start, train_command
from tests.helpers.processes import free_port
from tests.helpers.runs import losses_by_step
from tests.helpers.shared_runs import reference_runs

STEPS = int(next(o for o in LAUNCH_RUN if o.startswith("train.max_steps=")).split("=")[1])
SAVED = int(next(o for o in LAUNCH_RUN if o.startswith("train.save_every=")).split("=")[1])
EXPERT = "layers.1.mlp.experts.gate_proj"  # [4 experts, 32, 64]: 2 rows per rank with ep=2
MOMENT = "adam_v.layers.1.mlp.experts.down_proj"


def two_workers(run_dir, data_cache, *extra):
    return launch_command(
        run_dir, data_cache, "launch.procs_per_node=2", "parallel.ep=2", f"launch.master_port={free_port()}", *extra
    )


def succeeded(process):
    code, stdout, stderr = finish(process)
    assert code == 0, stdout[-3000:] + stderr[-3000:]


def stored(path, name):
    with safe_open(str(path), framework="numpy") as handle:
        return handle.get_tensor(name) if name in handle.keys() else None


@pytest.mark.msrun
def test_a_two_worker_checkpoint_resumes_in_one_process_and_a_one_process_checkpoint_on_two_workers(
    tmp_path, tmp_path_factory, data_cache, processes
):
    ep2 = tmp_path / "ep2"
    launcher = start(processes, two_workers(ep2, data_cache))
    # The session's one-process run of the same overrides (trained now, while the workers compile, if no test
    # asked for it yet).
    single = reference_runs(tmp_path_factory, data_cache, {"default": ()})["default"]
    succeeded(launcher)
    reference = losses_by_step(single)
    assert_same_losses(losses_by_step(ep2), reference, range(1, STEPS + 1))

    sharded = ep2 / "checkpoints" / f"step_{SAVED:06d}"
    whole = dict(read_tensors(sharded, "model"))[EXPERT]
    assert whole.shape == (4, 32, 64)
    # Each rank's file holds only its two experts (and the optimizer files their moments); rank 0 the rest.
    assert stored(sharded / "model.safetensors", EXPERT).tolist() == whole[:2].tolist()
    assert stored(sharded / "model-rank00001.safetensors", EXPERT).tolist() == whole[2:].tolist()
    assert stored(sharded / "optimizer-rank00001.safetensors", MOMENT).shape == (2, 64, 32)
    assert stored(sharded / "model-rank00001.safetensors", "embed_tokens.weight") is None

    from_sharded, from_single = tmp_path / "ep2_to_1", tmp_path / "single_to_ep2"
    one_process = single / "checkpoints" / f"step_{SAVED:06d}"
    runs = [
        start(processes, train_command(from_sharded, data_cache, f"train.resume={sharded}")),
        start(processes, two_workers(from_single, data_cache, f"train.resume={one_process}")),
    ]
    for process in runs:
        succeeded(process)
    for resumed_dir in (from_sharded, from_single):
        resumed = losses_by_step(resumed_dir)
        assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1)), resumed_dir
        assert_same_losses(resumed, reference, range(SAVED + 1, STEPS + 1))
