"""The project's own CPU kernels in C++ (``native/*.cc``), compiled on the machine that runs them.

MindSpore 2.9 runs a CPU graph as one kernel per op, and element-wise chains such as RMSNorm's forward and written-out
backward become a dozen passes over the tensor (and a dozen launches). The kernels of ``native/`` do such a chain in
one pass; MindSpore calls them as ``ops.Custom(..., func_type="aot")`` ops (:mod:`.cpu_native`).

:func:`library` compiles the sources into one library once per machine with the C++ compiler (``$CXX``, else
``g++``), ``-O3 -march=native``, into ``native/`` of the project's cache (``$MINDMOE_CACHE``, else
``~/.cache/mindmoe``), named by a hash of the sources, the flags, the compiler's version and the CPU (model and
feature flags): a home directory shared by machines of different CPUs gets one library per CPU, never one built for
another. Workers of one node compiling at once wait on one file lock and the first one's library; a library is
written beside its final name and renamed, so no process loads a partial file. A compile takes a few seconds.

Without a compiler, or when it fails, :func:`library` returns None and says why (:func:`status`, logged once as a
warning): the CPU kernels then run the MindSpore graph formulas (``cpu.py``) they replace, which compute the same
function. ``MINDMOE_NATIVE_KERNELS=0`` chooses those without trying.
"""

import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

from filelock import FileLock

log = logging.getLogger("mindmoe.kernels")

#: The library's sources: every ``.cc`` file is compiled; the headers are part of the library's name too.
SOURCES = tuple(sorted(Path(__file__).with_name("native").glob("*.cc"))) + tuple(
    sorted(Path(__file__).with_name("native").glob("*.h"))
)
SWITCH_ENV = "MINDMOE_NATIVE_KERNELS"
#: Every flag is part of the library's name. No fast-math: the kernels keep IEEE semantics (NaN and inf propagate,
#: which the trainer's finite-gradient check relies on). ``-fno-trapping-math`` (nothing here enables floating-point
#: traps) lets the compiler turn the clamps of ``exp_poly`` into vector selects; ``-fopenmp-simd`` only honours the
#: loops' ``omp simd`` reductions (no OpenMP runtime, no threads).
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp-simd",
    "-std=c++17",
    "-shared",
    "-fPIC",
)

_state = {}


def cache_root() -> Path:
    """``native/`` of the project's cache (``$MINDMOE_CACHE``, else ``~/.cache/mindmoe``, as the data cache)."""
    return Path(os.environ.get("MINDMOE_CACHE") or "~/.cache/mindmoe").expanduser() / "native"


def cpu_identity() -> str:
    """The processor's model name and feature flags (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:  # the first processor is enough
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|" + "|".join(f"{k}={fields[k]}" for k in sorted(fields))


def compiler() -> str:
    """The C++ compiler's path, or "" when there is none."""
    return shutil.which(os.environ.get("CXX") or "g++") or ""


def build(sources=SOURCES, root: Path = None, cxx: str = None) -> Path:
    """Compile ``sources`` (a path or several: the ``.cc`` files compiled, every file hashed) into a shared library
    under ``root`` (default :func:`cache_root`), or return the one built before; raises ``RuntimeError`` naming the
    compiler and its message when it cannot."""
    sources = [Path(sources)] if isinstance(sources, (str, Path)) else [Path(path) for path in sources]
    cxx = compiler() if cxx is None else cxx
    if not cxx:
        raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX') or 'g++'} is not on PATH (set CXX to one)")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"{cxx} --version failed: {error}") from None
    texts = [path.name.encode() + b"\0" + path.read_bytes() for path in sources]
    key = hashlib.sha256(b"\0".join([*texts, " ".join(FLAGS).encode(), version.encode(), cpu_identity().encode()]))
    root = cache_root() if root is None else Path(root)
    directory = root / key.hexdigest()[:20]
    target = directory / "libmindmoe_cpu.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory) + ".lock"):
        if target.exists():  # another process built it while this one waited
            return target
        partial = directory / f".libmindmoe_cpu.{os.getpid()}.so"
        command = [cxx, *FLAGS, "-o", str(partial), *(str(path) for path in sources if path.suffix == ".cc")]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                message = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
                raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{message}")
            os.replace(partial, target)
        except (OSError, subprocess.SubprocessError) as error:
            raise RuntimeError(f"{' '.join(command)} failed: {error}") from None
        finally:
            partial.unlink(missing_ok=True)  # a failed or timed-out compile's output; gone once renamed
    return target


def library():
    """The compiled library's path (a str, for ``ops.Custom``), or None: disabled, no compiler, or it failed (the
    reason in :func:`status`, logged once). Built at the first call of a process."""
    if "path" not in _state:
        _state["path"], _state["status"] = _load()
        if _state["path"] is None and not _switched_off():
            log.warning("native CPU kernels not used, the graph formulas run instead: %s", _state["status"])
    return _state["path"]


def status() -> str:
    """One line: which library the CPU kernels use, or why none."""
    library()
    return _state["status"]


def _switched_off() -> bool:
    return os.environ.get(SWITCH_ENV, "").strip() == "0"


def _load():
    if _switched_off():
        return None, f"native CPU kernels off ({SWITCH_ENV}=0): the graph formulas run"
    try:
        path = build()
    except (RuntimeError, OSError) as error:
        return None, str(error)
    return str(path), f"native CPU kernels: {path}"


def reset() -> None:
    """Forget this process's choice (tests; the next :func:`library` call decides again)."""
    _state.clear()
