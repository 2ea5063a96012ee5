"""The CPU host kernels' own threads: the experts of one launch split over this process's cores.

A host kernel (``pyfunc``; ``cpu_token_experts.py``) runs while MindSpore's kernel threads wait for it. Its products
ran in NumPy's OpenBLAS on two threads each and its element-wise work (SwiGLU, gathers, the float64 sums) on one, so
about a quarter of its time used one core of two. Here each thread takes whole experts and runs every product on one
BLAS thread, so the element-wise work runs on every core. Every product then has the same bits whatever the thread
count (OpenBLAS's two-thread products differ from its one-thread ones in the last bits: measured on [512, 512] x
[512, 512]). Same-process A/B on the MoE bench step with ``moe.dispatch=dropless`` (BENCHMARKS.md): 3.07 s against
3.48 s and 3.08 against 3.37 s in two runs.

The thread count is the kernel threads ``host_runtime`` gives a worker (``cores // MINDMOE_LOCAL_WORKERS``), else the
process's cores; with one the work runs in the calling thread.
"""

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from mindmoe.model.kernels.host_runtime import host_settings, numpy_openblas, usable_cores

_lock = threading.Lock()
_pool = {}  # thread count -> executor
_blas = {"users": 0}


def host_threads() -> int:
    """How many threads a host kernel of this process splits its experts over."""
    cores = usable_cores()
    return host_settings("CPU", os.environ, cores)["kernel_threads"] or cores


def split_by_expert(items, rows, parts: int) -> list:
    """``items`` (each ``(expert, ...)``) in at most ``parts`` lists of about equal ``rows(item)`` totals, an expert's
    items together and in their order (the largest experts placed first, each on the lightest list)."""
    experts = {}
    for item in items:
        experts.setdefault(item[0], []).append(item)
    loads, lists = [0] * parts, [[] for _ in range(parts)]
    for load, group in sorted(((sum(map(rows, group)), group) for group in experts.values()), key=lambda lg: -lg[0]):
        lightest = loads.index(min(loads))
        lists[lightest] += group
        loads[lightest] += load
    return [part for part in lists if part]


@contextlib.contextmanager
def one_blas_thread():
    """NumPy's OpenBLAS on one thread while any kernel is inside (the first in limits it, the last out restores it, so
    kernels the runtime starts at once do not restore it under each other); yields whether it could."""
    with _lock:
        calls = numpy_openblas()
        if calls is not None and _blas["users"] == 0:
            _blas["saved"] = calls[1]()
            calls[0](1)
        _blas["users"] += 1
    try:
        yield calls is not None
    finally:
        with _lock:
            _blas["users"] -= 1
            if calls is not None and _blas["users"] == 0:
                calls[0](_blas["saved"])


def map_experts(function, items, rows) -> list:
    """``[function(part) ...]`` over :func:`split_by_expert` parts of ``items``, one per thread (in the calling thread
    when this process has one core for its kernels), with NumPy's BLAS on one thread."""
    threads = host_threads()
    parts = split_by_expert(items, rows, threads)
    with one_blas_thread() as limited:
        if threads == 1 or len(parts) < 2 or not limited:  # another BLAS would run its own threads in each of ours
            return [function(part) for part in parts]
        with _lock:
            if threads not in _pool:
                _pool[threads] = ThreadPoolExecutor(threads, thread_name_prefix="mindmoe-host")
            pool = _pool[threads]
        return list(pool.map(function, parts))
