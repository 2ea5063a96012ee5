"""Shared test setup: every MindSpore test runs in GRAPH_MODE on CPU (the production mode).

Shared tiny configs and builders live in ``tests/helpers/`` (plain functions that take arguments); the
fixtures below are the ones a test asks for by name.
"""

import os

import mindspore as ms
import pytest

from mindmoe.model.kernels.host_runtime import configure_host_runtime
from tests.helpers.processes import kill_tree
from tests.helpers.shared_runs import session_directory
from tests.helpers.tiny_run import TINY_RUN

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
configure_host_runtime("CPU")  # as every entry point: single-threaded dispatch on CPU


# A worker's share of memory: two workers used up to 19 GiB of a 23.5 GiB machine. A multi-process test peaks at
# about 11 GiB (the Air-shaped LoRA test's two workers with their pytest process), and a worker's process grows to
# 4-5 GiB over the in-process tests of a run.
MEMORY_PER_WORKER = 11 * 2**30


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one pytest-xdist worker per core this process may run on, at most one per
    ``MEMORY_PER_WORKER`` of the machine's memory. Most tests compile on one core, so 2 workers on 2 cores took
    the suite from 61 to 41 minutes. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` or ``-n N`` sets it; ``-n 0`` runs in this
    process (for a debugger)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(len(os.sched_getaffinity(0)), memory // MEMORY_PER_WORKER))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenizer/MindRecord cache for the whole session, all its workers included, never the user's: each
    entry is built once, under a file lock that the other workers wait on (``data/cache_entry.py``)."""
    return str(session_directory(tmp_path_factory, "mindmoe_cache"))


@pytest.fixture
def tiny_run():
    """Overrides of a run that compiles in seconds (2 layers, 4 experts, 64-token windows, no evaluation)."""
    return list(TINY_RUN)


@pytest.fixture
def processes():
    """``Popen`` objects a test appends; on teardown each one and all its descendants are killed by pid."""
    started = []
    yield started
    for process in started:
        kill_tree(process)


@pytest.fixture(scope="session")
def tf5_reference():
    """transformers 5.23 (``tests/helpers/tf5_reference.py``) in its own cached venv, created on first use.
    Without it (no package index) a test skips here and fails in CI (``CI`` set), where it must run."""
    from tests.helpers.tf5_reference import Reference, ReferenceUnavailable, ensure_venv, venv_dir

    try:
        return Reference(ensure_venv())
    except ReferenceUnavailable as err:
        in_ci = os.environ.get("CI", "").lower() not in ("", "0", "false")
        message = f"the transformers 5 reference venv ({venv_dir()}) cannot be created: {err}"
        if in_ci:
            pytest.fail(message + "\nCI needs it; check that the package index is reachable", pytrace=False)
        pytest.skip(message)


@pytest.fixture(params=["host kernel", "gathered weights"])
def static_path(request, monkeypatch):
    """Both ways the CPU training graph runs a static-shape grouped matmul, whatever the experts' size: the
    host kernel (chosen for large experts) and the gathered block weights in one BatchMatMul (small ones)."""
    from mindmoe.model.kernels import cpu_grouped

    gathered = request.param == "gathered weights"
    monkeypatch.setattr(cpu_grouped, "GATHER_RATIO", 10**6 if gathered else 0)
    monkeypatch.setattr(cpu_grouped, "GATHER_MIN_WIDTH", 0)
    return request.param
