"""Releasing compiled graphs (train/graph_memory.py): the next graph reuses their memory, a released function
compiles again with the same result, and the trainer knows when no validation comes before the last step."""

import json
import subprocess
import sys

import pytest

from mindmoe.train.graph_memory import validates_before_last_step
from tests.helpers.runs import REPO

# Two graphs of the same kind, each keeping ~700 MiB of host memory while cached: broadcasting
# multiplications of a [6528, 512] fp32 tensor by a column keep 16 bytes per output element on CPU.
SCRIPT = """
import json
import numpy as np
import mindspore as ms
from mindspore import ops, Tensor
from mindmoe.train.graph_memory import release_compiled_graphs

def hwm_mib():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024

def graph(offset):
    def f(x):
        y = x
        for _ in range(12):
            y = y * ops.sigmoid(y[:, :1])
        return y.sum() + offset
    return ms.jit(f)

x = Tensor(np.random.default_rng(0).uniform(0.0, 1.0, size=(6528, 512)).astype(np.float32))
first = graph(1.0)
start = hwm_mib()
value = float(first(x).asnumpy())
after_first = hwm_mib()
if {release}:
    release_compiled_graphs()
second = graph(2.0)
second(x)
after_second = hwm_mib()
again = float(first(x).asnumpy())
print(json.dumps([after_first - start, after_second - after_first, value, again]))
"""


def growths(release: bool, directory):
    script = directory / f"graphs_{release}.py"  # MindSpore compiles functions from a source file only
    script.write_text(SCRIPT.format(release=release))
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_a_released_graph_leaves_its_memory_to_the_next_one_and_compiles_again_alike(tmp_path):
    first, second, value, again = growths(True, tmp_path)
    kept_first, kept_second, _, _ = growths(False, tmp_path)
    assert first > 400 and kept_second > 0.6 * kept_first  # without a release the second graph adds its own
    assert second < 0.25 * first  # with it the second graph fits in the first one's memory
    assert again == value


@pytest.mark.parametrize(
    "eval_every,start_step,max_steps,expected",
    [(0, 0, 10, False), (10, 0, 10, False), (20, 0, 10, False), (5, 0, 10, True), (3, 0, 4, True), (2, 4, 5, False)],
)
def test_validation_before_the_last_step(eval_every, start_step, max_steps, expected):
    assert validates_before_last_step(eval_every, start_step, max_steps) is expected


def test_a_cell_that_dies_during_the_release_is_retried_and_any_other_error_raised(monkeypatch):
    """MindSpore 2.9's ``ms_memory_recycle`` raises "dictionary changed size during iteration" when a cell whose
    graph it frees dies inside it (seen after a process had built many models); called again it goes on."""
    from mindmoe.train import graph_memory

    calls = []

    def recycle_with_two_dying_cells():
        calls.append(None)
        if len(calls) <= 2:
            raise RuntimeError("dictionary changed size during iteration")

    monkeypatch.setattr(graph_memory.ms, "ms_memory_recycle", recycle_with_two_dying_cells)
    graph_memory.release_compiled_graphs()
    assert len(calls) == 3

    def failing():
        raise RuntimeError("device memory pool error")

    monkeypatch.setattr(graph_memory.ms, "ms_memory_recycle", failing)
    with pytest.raises(RuntimeError, match="device memory pool error"):
        graph_memory.release_compiled_graphs()
