"""The host runtime policy per device target (``model/kernels/host_runtime.py``): single-threaded dispatch on
CPU unless the user chose otherwise, kernel threads split between the workers of a node, nothing on Ascend."""

import json
import os
import subprocess
import sys

import pytest

from mindmoe.model.kernels.host_runtime import (
    BLOCKING_RUN_ENV,
    LOCAL_WORKERS_ENV,
    configure_host_runtime,
    describe,
    host_settings,
)


def test_cpu_gets_single_threaded_dispatch_and_keeps_the_default_pool_for_one_worker():
    settings = host_settings("CPU", {}, cores=2)
    assert settings == {"environ": {BLOCKING_RUN_ENV: "1"}, "kernel_threads": None}


def test_a_value_the_user_exported_is_kept():
    assert host_settings("CPU", {BLOCKING_RUN_ENV: "0"}, cores=2)["environ"] == {}


@pytest.mark.parametrize("cores, workers, threads", [(2, 2, 1), (8, 2, 4), (64, 8, 8), (2, 4, 1), (7, 2, 3)])
def test_workers_of_one_node_share_its_cores(cores, workers, threads):
    assert host_settings("CPU", {LOCAL_WORKERS_ENV: str(workers)}, cores)["kernel_threads"] == threads


def test_ascend_keeps_mindspores_defaults():
    assert host_settings("Ascend", {LOCAL_WORKERS_ENV: "8"}, cores=192) == {"environ": {}, "kernel_threads": None}


@pytest.mark.parametrize("raw", ["two", "0", "-1"])
def test_a_bad_worker_count_names_the_variable(raw):
    with pytest.raises(ValueError, match=LOCAL_WORKERS_ENV):
        host_settings("CPU", {LOCAL_WORKERS_ENV: raw}, cores=2)


def test_this_test_process_runs_as_every_entry_point_does():
    """conftest configured the session like the trainer: the switch is in the environment MindSpore reads."""
    settings = configure_host_runtime("CPU")
    assert os.environ.get(BLOCKING_RUN_ENV) == settings["blocking_run"]
    assert "CPU" in describe(settings) and BLOCKING_RUN_ENV in describe(settings)


def test_the_launcher_exports_the_variable_the_workers_read():
    from mindmoe.launch import msrun

    assert msrun.LOCAL_WORKERS_ENV == LOCAL_WORKERS_ENV


def test_a_worker_sharing_its_node_limits_numpy_blas_threads_as_mindspores():
    """The CPU grouped matmul runs in NumPy's BLAS, whose thread pool would otherwise take every core of the node."""
    code = (
        "import json\n"
        "from threadpoolctl import threadpool_info\n"
        "from mindmoe.model.kernels.host_runtime import configure_host_runtime\n"
        "settings = configure_host_runtime('CPU')\n"
        "blas = [p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas' and 'numpy' in p['filepath']]\n"
        "print(json.dumps([settings['kernel_threads'], blas]))\n"
    )
    env = dict(os.environ, **{LOCAL_WORKERS_ENV: "64"})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    threads, blas = json.loads(done.stdout.strip().splitlines()[-1])
    assert threads == 1 and blas and set(blas) == {1}
