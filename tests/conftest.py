"""Shared test setup: every MindSpore test runs in GRAPH_MODE on CPU (the production mode).

Shared tiny configs and builders live in ``tests/helpers/`` (plain functions that take arguments); the
fixtures below are the ones a test asks for by name.
"""

import os

import mindspore as ms
import pytest

from mindmoe.model.kernels.host_runtime import configure_host_runtime
from tests.helpers.processes import kill_tree
from tests.helpers.tiny_run import TINY_RUN

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
configure_host_runtime("CPU")  # as every entry point: single-threaded dispatch on CPU


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenizer/MindRecord cache for the whole session, never the user's."""
    return str(tmp_path_factory.mktemp("mindmoe_cache"))


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
