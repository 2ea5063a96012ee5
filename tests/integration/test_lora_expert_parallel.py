"""LoRA with expert parallelism: 2 workers with ``parallel.ep=2`` must train the routed experts' adapters
exactly as one process accumulating the same micro-batches, and write the same PEFT adapter files.

``parallel.ep_dispatcher=allgather``: the 2 ranks form one replica reading the same micro-batches; each
builds only the adapter rows of its 2 of the 4 experts, trains them from its rows of the gathered expert
outputs, and the checkpoint and its PEFT copy gather all 4. The dense adapters are replicated.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers.launches import finish, launch_command, start, train_command
from tests.helpers.processes import free_port
from tests.helpers.runs import REPO, metrics_rows

STEPS = 4
# LoRA needs a frozen router bias (moe.bias_update_rate=0); the default target_modules adapt the attention,
# the dense MLP and every routed expert's projections. A large learning rate makes the adapters matter.
LORA = [
    "moe.bias_update_rate=0",
    "lora.enabled=true",
    "lora.r=4",
    "train.lr=0.01",
    f"train.max_steps={STEPS}",
    f"train.save_every={STEPS}",
]
ADAPTER = Path("checkpoints") / f"step_{STEPS:06d}" / "adapter" / "adapter_model.safetensors"
EXPERT_KEY = "base_model.model.model.layers.1.mlp.experts.{e}.{proj}.lora_{factor}.weight"


def single_process_run(run_dir, data_cache):
    # The same overrides, one process accumulating both micro-batches.
    subprocess.run(train_command(run_dir, data_cache, *LORA), cwd=REPO, check=True, capture_output=True, timeout=900)


def by_step(run_dir, key):
    return {row["step"]: row[key] for row in metrics_rows(run_dir) if key in row}


def assert_same_by_step(single_dir, ep_dir, keys, steps):
    """Every step's ``keys`` logged by both runs, equal to 1e-5 relative."""
    for key in keys:
        expected, actual = by_step(single_dir, key), by_step(ep_dir, key)
        assert sorted(actual) == sorted(expected) == list(range(1, steps + 1)), key
        for step, value in expected.items():
            assert abs(actual[step] - value) <= 1e-5 * abs(value), f"{key} step {step}: {actual[step]} vs {value}"


@pytest.mark.msrun
def test_lora_with_expert_parallel_workers_reproduces_one_process_and_its_adapter(tmp_path, data_cache, processes):
    single_dir, ep_dir = tmp_path / "single", tmp_path / "ep2"
    launcher = start(
        processes,
        launch_command(
            ep_dir,
            data_cache,
            *LORA,
            "launch.procs_per_node=2",
            "parallel.ep=2",
            "parallel.ep_dispatcher=allgather",
            f"launch.master_port={free_port()}",
        ),
    )
    single_process_run(single_dir, data_cache)  # while the workers compile
    code, stdout, stderr = finish(launcher)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "data parallel 1, accumulation 2" in stdout
    assert_same_by_step(single_dir, ep_dir, ("loss", "grad_norm"), STEPS)

    expected, actual = load_file(str(single_dir / ADAPTER)), load_file(str(ep_dir / ADAPTER))
    assert sorted(actual) == sorted(expected)
    assert_byte_equal(expected, actual)  # the same float32 operations in the same order
    # Every expert's adapter, the ones rank 1 held included, was trained (B starts at zero) and written.
    for e in range(4):
        assert np.abs(actual[EXPERT_KEY.format(e=e, proj="down_proj", factor="B")]).max() > 0, e
    assert actual[EXPERT_KEY.format(e=3, proj="gate_proj", factor="A")].shape == (4, 64)


RECIPE_STEPS = 3
RECIPE = [
    "recipe=lora_business",  # the bundled HF base (dropless experts, 4 routed), SFT data, dropout 0.05
    "data.global_batch_size=4",
    "data.micro_batch_size=2",
    f"train.max_steps={RECIPE_STEPS}",
    "train.log_every=1",
    f"train.save_every={RECIPE_STEPS}",
    "train.eval_every=0",
    "train.progress_bar=false",
    "data.valid_files=[]",  # the losses and adapters are compared: no validation graph to compile
]


def recipe_command(module, run_dir, data_cache, *extra):
    return [sys.executable, "-m", module, f"hydra.run.dir={run_dir}", f"data.cache_dir={data_cache}", *RECIPE, *extra]


def recipe_runs(tmp_path, data_cache, processes, common=(), layout=()) -> tuple:
    """``recipe=lora_business`` (``RECIPE`` and ``common``) on 2 launched workers with ``parallel.ep=2`` and
    ``layout``, and in one process meanwhile; ``(one process's run dir, the workers', the launcher's stdout,
    both PEFT adapter files)``."""
    single_dir, ep_dir = tmp_path / "single", tmp_path / "ep2"
    workers = ("launch.procs_per_node=2", "parallel.ep=2", *layout, f"launch.master_port={free_port()}")
    launcher = start(processes, recipe_command("mindmoe.launch.cli", ep_dir, data_cache, *common, *workers))
    one = recipe_command("mindmoe.train.cli", single_dir, data_cache, *common)
    # With the kernel threads of each of the 2 workers on this node: MindSpore's CPU kernels split their work by
    # thread, and a product or sum split otherwise rounds otherwise (README, "LoRA fine-tuning").
    env = dict(os.environ, MINDMOE_LOCAL_WORKERS="2")
    subprocess.run(one, cwd=REPO, check=True, capture_output=True, timeout=900, env=env)
    code, stdout, stderr = finish(launcher)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    adapter = Path("checkpoints") / f"step_{RECIPE_STEPS:06d}" / "adapter" / "adapter_model.safetensors"
    files = load_file(str(single_dir / adapter)), load_file(str(ep_dir / adapter))
    assert sorted(files[1]) == sorted(files[0])
    return single_dir, ep_dir, stdout, files


@pytest.mark.msrun
def test_the_lora_business_recipe_on_two_expert_parallel_workers_reproduces_one_process(
    tmp_path, data_cache, processes
):
    """The README's fine-tune as a user runs it with ``parallel.ep=2``: the imported base's dropless experts
    split over 2 workers, adapter dropout masks and all, give one process's losses and PEFT adapter file, byte for
    byte (the one process at the workers' kernel threads)."""
    single_dir, ep_dir, _, (expected_files, actual_files) = recipe_runs(tmp_path, data_cache, processes)
    assert_same_by_step(single_dir, ep_dir, ("loss", "grad_norm"), RECIPE_STEPS)
    assert_byte_equal(expected_files, actual_files)


@pytest.mark.msrun
def test_lora_on_token_routed_workers_reproduces_one_process_accumulating_their_micro_batches(
    tmp_path, data_cache, processes
):
    """``parallel.ep_dispatcher=alltoall``: each worker reads its own micro-batch of 2 conversations, the 2 ranks
    gather each other's tokens, run their own experts' assignments from tokens to tokens and sum the outputs back
    (train.parallel.token_gather); one process accumulates the same 2 micro-batches. Without adapter dropout:
    data-parallel ranks draw their own masks."""
    single_dir, ep_dir, stdout, (expected_files, actual_files) = recipe_runs(
        tmp_path, data_cache, processes, ("lora.dropout=0",), ("parallel.ep_dispatcher=alltoall",)
    )
    assert "data parallel 2, accumulation 1" in stdout
    assert_same_by_step(single_dir, ep_dir, ("loss", "grad_norm"), RECIPE_STEPS)
    # Each worker's kernel multiplies its experts' rows of each rank's tokens apart, and the gradient norm sums every
    # expert row's square in one order whatever rank holds it: the same float32 operations as the one process's.
    assert_byte_equal(expected_files, actual_files)


def assert_byte_equal(expected_files, actual_files):
    for name, tensor in expected_files.items():
        assert actual_files[name].dtype == tensor.dtype and actual_files[name].tobytes() == tensor.tobytes(), name
