"""One-process reference runs shared by every multi-process test of a session: each configuration trains once,
in whichever pytest-xdist worker asks for it first, and every test comparing to it reads that run.

The runs live in a directory all workers of the session see, one per configuration (named by a hash of its
overrides), each behind a file lock: a worker asking for a run another is training waits for it instead of
training it again. A run is used only once it finished (a ``done`` file); a failed one is trained again by the
next test asking for it, which then reports the failure.
"""

import fcntl
import hashlib
import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

from tests.helpers.launches import LAUNCH_RUN, single_process_losses_side_by_side


def session_directory(tmp_path_factory, name: str) -> Path:
    """``name`` in the session's base temporary directory, which every worker of the session sees: under
    pytest-xdist the parent of the workers' own ones, the session's alone (pytest's numbered ``pytest-N``);
    without xdist this process's, never shared."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    directory.mkdir(exist_ok=True)
    return directory


def configuration_key(extra) -> str:
    return hashlib.sha256(json.dumps([*LAUNCH_RUN, *extra]).encode()).hexdigest()[:16]


def reference_runs(tmp_path_factory, data_cache, runs: dict) -> dict:
    """``{name: run directory}`` of one-process ``mindmoe-train`` runs of ``LAUNCH_RUN`` with the extra overrides
    ``{name: extra}`` (``tests/helpers/launches.py``), each trained once per session; the missing ones are trained
    side by side so that their graph compiles overlap. A run directory is read-only for its users: resume from
    its checkpoints into a run directory of your own."""
    root = session_directory(tmp_path_factory, "shared_reference_runs")
    directories = {name: root / configuration_key(extra) for name, extra in runs.items()}
    with ExitStack() as locks:
        for directory in sorted(set(directories.values())):
            handle = locks.enter_context(open(f"{directory}.lock", "w"))
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        missing = {}
        for name, directory in directories.items():
            if not (directory / "done").exists() and directory not in missing.values():
                missing[name] = directory
        for directory in missing.values():
            shutil.rmtree(directory, ignore_errors=True)  # a run that failed or was interrupted: start afresh
            directory.mkdir()
        single_process_losses_side_by_side(
            data_cache, {name: (directory / "run", runs[name]) for name, directory in missing.items()}
        )
        for directory in missing.values():
            (directory / "done").touch()
    return {name: directory / "run" for name, directory in directories.items()}
