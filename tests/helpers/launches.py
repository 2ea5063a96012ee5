"""Multi-process runs through the real ``mindmoe-launch`` entry point, and the one-process runs they must reproduce.

A test keeps its launchers in the ``processes`` fixture (``tests/conftest.py``), which kills each one with every
worker below it on teardown.
"""

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.processes import kill_tree
from tests.helpers.runs import REPO, losses_by_step

# Tiny model, seq 64: each worker compiles its own graphs on 2 cores. The aux-loss-free recipe makes
# the next step depend on expert-load counts, which must be summed over ranks to stay identical.
# 8 steps, checkpoints at 4 and 8: a resume from step 4 still runs 4 steps. No validation split: these runs
# compare training losses, and the evaluation graph's compile would add a fifth to each process.
LAUNCH_RUN = [
    "recipe=pretrain_tiny_aux_free",
    "moe.bias_update_rate=0.01",
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
    "train.max_steps=8",
    "train.log_every=1",
    "train.save_every=4",
    "train.eval_every=0",
    "train.progress_bar=false",
    "train.peak_gflops=100",
    "data.valid_files=[]",
]
RELATIVE_TOLERANCE = 1e-5
#: Micro-batches of 2 with grouped dropless dispatch: the 4-worker layouts (each rank or group reads 2 or 4 of them).
DROPLESS_MB2 = ("data.micro_batch_size=2", "moe.dispatch=dropless")


def launch_command(run_dir, data_cache, *extra):
    """``mindmoe-launch`` of LAUNCH_RUN with ``extra`` overrides (later ones win)."""
    return [
        sys.executable,
        "-m",
        "mindmoe.launch.cli",
        f"hydra.run.dir={run_dir}",
        f"data.cache_dir={data_cache}",
        *LAUNCH_RUN,
        *extra,
    ]


def train_command(run_dir, data_cache, *extra):
    """The same overrides through ``mindmoe-train``: one process accumulating every micro-batch of a step."""
    command = launch_command(run_dir, data_cache, *extra)
    command[2] = "mindmoe.train.cli"
    return command


def start(processes, command):
    process = subprocess.Popen(
        command, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    processes.append(process)
    return process


def finish(process, timeout=900):
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, stdout, stderr


def single_process_losses_side_by_side(data_cache, runs: dict) -> dict:
    """``{name: losses}`` of one-process references ``{name: (run_dir, extra overrides)}`` (no msrun, accumulating
    the micro-batches of each step), trained at the same time so that their graph compiles overlap."""
    started = {}
    try:
        for name, (run_dir, extra) in runs.items():
            log = Path(run_dir).parent / f"{Path(run_dir).name}.log"
            with log.open("w") as sink:  # a file: a pipe nobody reads could fill and stall the run
                command = train_command(run_dir, data_cache, *extra)
                started[name] = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT), log
        for name, (process, log) in started.items():
            assert process.wait(timeout=900) == 0, f"reference {name}:\n{log.read_text()[-3000:]}"
    finally:
        for process, _ in started.values():
            kill_tree(process)
    return {name: losses_by_step(run_dir) for name, (run_dir, _) in runs.items()}


def assert_same_losses(actual: dict, expected: dict, steps):
    for step in steps:
        assert abs(actual[step] - expected[step]) <= RELATIVE_TOLERANCE * abs(expected[step]), (
            f"step {step}: {actual[step]} vs single process {expected[step]}"
        )
