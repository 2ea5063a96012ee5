"""How MindSpore's host side runs a compiled graph, per device target: set once per process, before its first
graph runs (every entry point calls :func:`configure_host_runtime` right after ``set_context``).

CPU (measured on 2-core machines with the tiny model; figures in BENCHMARKS.md):

- **Single-threaded dispatch** (``MS_DEV_HOST_BLOCKING_RUN=1``, MindSpore's documented switch). By default a
  graph's kernels are handed through a pipeline of queue threads that busy-wait for work; on CPU those threads
  compete with the kernels for the same cores (about half of a worker's CPU samples were in the queue's wait),
  and one process trains about 3x slower. On Ascend the asynchronous pipeline overlaps the host with the device,
  so nothing is changed there.
- **Kernel threads per worker.** MindSpore sizes each process's kernel thread pool for the whole machine, so W
  workers on one node oversubscribe its cores W times. ``mindmoe-launch`` tells each worker how many share its
  node (``MINDMOE_LOCAL_WORKERS``); with more than one, each gets ``max(1, cores // W)`` threads, and so does
  NumPy's BLAS, in which the CPU grouped matmul runs (``cpu_grouped.py``; OpenBLAS also starts a thread per core).

A value the user already exported wins: ``MS_DEV_HOST_BLOCKING_RUN=0`` keeps MindSpore's default dispatch.
"""

import ctypes
import os

#: Set by ``mindmoe-launch`` for every worker: the number of workers on this node (``launch.procs_per_node``).
LOCAL_WORKERS_ENV = "MINDMOE_LOCAL_WORKERS"
BLOCKING_RUN_ENV = "MS_DEV_HOST_BLOCKING_RUN"

_configured = None
_numpy_blas = {}


def host_settings(device_target: str, environ, cores: int) -> dict:
    """What :func:`configure_host_runtime` sets for ``device_target`` (pure, for tests): ``{"environ": {name:
    value} to add, "kernel_threads": int or None}``. ``environ``: the process environment; ``cores``: usable
    cores of this process."""
    if device_target != "CPU":
        return {"environ": {}, "kernel_threads": None}
    added = {} if BLOCKING_RUN_ENV in environ else {BLOCKING_RUN_ENV: "1"}
    raw = environ.get(LOCAL_WORKERS_ENV, "")
    try:
        workers = int(raw) if raw else 1
    except ValueError:
        raise ValueError(f"{LOCAL_WORKERS_ENV}={raw!r} must be the number of workers on this node") from None
    if workers < 1:
        raise ValueError(f"{LOCAL_WORKERS_ENV}={raw!r} must be the number of workers on this node (>= 1)")
    threads = max(1, cores // workers) if workers > 1 else None
    return {"environ": added, "kernel_threads": threads}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def numpy_openblas():
    """``(set, get)`` of the thread count of NumPy's OpenBLAS, called through ctypes, or None (another BLAS); looked
    up once per process.

    The one way this project changes a BLAS thread count (the worker's limit here and the host kernels' one thread in
    ``host_threads``). Not threadpoolctl's limits: since 3.x it lets only the first Python thread that limits an
    OpenBLAS change it afterwards and ignores the others (measured: after a kernel in MindSpore's runtime thread had
    limited it, the main thread's limits did nothing), and the kernels run in whichever thread MindSpore launches them
    from."""
    if "calls" not in _numpy_blas:
        _numpy_blas["calls"] = _find_numpy_openblas()
    return _numpy_blas["calls"]


def _find_numpy_openblas():
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info["internal_api"] != "openblas" or "numpy" not in info["filepath"]:
            continue
        lib = ctypes.CDLL(info["filepath"])
        for prefix, suffix in (("", ""), ("", "64_"), ("scipy_", "64_"), ("scipy_", "")):
            setter = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
            getter = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
            if setter is not None and getter is not None:
                return setter, getter
    return None


def configure_host_runtime(device_target: str = None) -> dict:
    """Apply :func:`host_settings` to this process (the first call; later calls return the same settings).

    ``device_target`` defaults to the MindSpore context's."""
    global _configured
    if _configured is not None:
        return _configured
    import mindspore as ms

    device = device_target or ms.get_context("device_target")
    settings = host_settings(device, os.environ, usable_cores())
    os.environ.update(settings["environ"])
    if settings["kernel_threads"] is not None:
        blas = numpy_openblas()
        if blas is not None:
            set_threads, _ = blas
            set_threads(settings["kernel_threads"])
        else:  # NumPy on another BLAS: threadpoolctl's limit, from this (the main) thread, before any kernel runs
            from threadpoolctl import threadpool_limits

            threadpool_limits(settings["kernel_threads"], user_api="blas")
        try:
            ms.device_context.cpu.op_tuning.threads_num(settings["kernel_threads"])
        except RuntimeError:  # the process set it already ("can not be set repeatedly"): its choice stays
            settings = dict(settings, kernel_threads=None)
    _configured = dict(settings, device_target=device, blocking_run=os.environ.get(BLOCKING_RUN_ENV))
    return _configured


def describe(settings: dict) -> str:
    """One log line of what :func:`configure_host_runtime` chose."""
    if settings["device_target"] != "CPU":
        return f"host runtime: {settings['device_target']} defaults"
    dispatch = "single-threaded" if settings["blocking_run"] == "1" else "MindSpore's pipelined"
    threads = settings["kernel_threads"]
    pool = f"{threads} kernel thread(s) per worker" if threads else "MindSpore's default kernel thread pool"
    return f"host runtime: CPU, {dispatch} dispatch ({BLOCKING_RUN_ENV}={settings['blocking_run']}), {pool}"
