"""Checkpoint lineage: which ``step_*`` directories of a run dir belong to the run that continues there.

    <run dir>/checkpoints/
        step_000002/ step_000003/     the current lineage: the checkpoints this run continues and writes
        abandoned-20260101T120000Z/   checkpoints moved aside when a run did not continue them (never deleted)
            step_000004/ step_000006/
        .step_000008.tmp-4711/        a checkpoint being written by process 4711 (see train/checkpoints/checkpoint.py)

The rule (:func:`off_lineage`), applied once at start by :func:`settle_lineage`:

- a run that resumes from a checkpoint directly under its own ``checkpoints/`` at step ``s`` continues
  that lineage: every ``step_*`` directory there with a step above ``s`` was written by a run it does
  not continue (an abandoned branch, or a newer checkpoint that failed verification under
  ``train.on_corrupt_checkpoint=previous``) and is moved aside; those at or below ``s`` stay;
- any other run (``train.resume=none``, ``auto`` that finds nothing usable, or a checkpoint of another
  directory, including one under ``abandoned-*``) starts a new lineage: every ``step_*`` directory is
  moved aside.

So afterwards every ``step_*`` directory is older than any checkpoint the run writes: pruning by step
number (``train.keep_last``) stays within the lineage, no save ever meets a directory of the same name,
and ``train.resume=auto`` (which looks only at ``step_*`` directly under ``checkpoints/``) continues the
latest lineage. No directory is deleted here, except the temporary directory of a checkpoint whose
writer is no longer running (:func:`remove_stale_temporaries`).
"""

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import List, Optional

from mindmoe.data.scratch import process_running
from mindmoe.model.checkpoints.files import read_state

log = logging.getLogger("mindmoe.train")

STEP_DIR = re.compile(r"^step_(\d{6,})$")
#: ``.step_NNNNNN.tmp-PID``: a checkpoint being assembled by process PID (renamed to ``step_NNNNNN`` when complete).
TEMPORARY_DIR = re.compile(r"^\.step_(\d{6,})\.tmp-(\d+)$")
ABANDONED_PREFIX = "abandoned-"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(Path(path).name).group(1))


def step_dirs(checkpoint_root: Path) -> List[Path]:
    """Every ``step_*`` directory directly under ``checkpoint_root``, complete or not, oldest first."""
    if not checkpoint_root.is_dir():
        return []
    found = [path for path in checkpoint_root.iterdir() if path.is_dir() and STEP_DIR.match(path.name)]
    return sorted(found, key=step_of)


def temporary_dir(checkpoint_root: Path, step: int) -> Path:
    """Where this process assembles the checkpoint of ``step``."""
    return checkpoint_root / f".step_{step:06d}.tmp-{os.getpid()}"


def off_lineage(checkpoint_root: Path, resume_from: Optional[Path]) -> List[Path]:
    """The ``step_*`` directories of ``checkpoint_root`` that a run resuming from ``resume_from`` (None: a
    fresh start) does not continue; the rule is in the module docstring."""
    found = step_dirs(checkpoint_root)
    if resume_from is None or not _same_dir(Path(resume_from).parent, checkpoint_root):
        return found
    resumed_step = int(read_state(resume_from)["step"])
    return [path for path in found if step_of(path) > resumed_step]


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def move_aside(checkpoint_root: Path, directories: List[Path], why: str) -> Optional[Path]:
    """Move ``directories`` into a new ``checkpoint_root/abandoned-<UTC time>/`` (a rename: nothing is
    copied or deleted) with a warning naming them; the directory they went to (None if there were none)."""
    if not directories:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, suffix = checkpoint_root / f"{ABANDONED_PREFIX}{stamp}", 1
    while target.exists():
        target, suffix = checkpoint_root / f"{ABANDONED_PREFIX}{stamp}-{suffix}", suffix + 1
    target.mkdir()
    for directory in directories:
        os.replace(directory, target / directory.name)
    log.warning(
        "%s: moved %s aside to %s (nothing deleted; resume from one of them with train.resume=<its path>)",
        why,
        ", ".join(directory.name for directory in directories),
        target,
    )
    return target


def remove_stale_temporaries(checkpoint_root: Path) -> List[Path]:
    """Delete the ``.step_*.tmp-PID`` directories whose process is not running on this host (a save
    interrupted by a crash or a kill), with a log line each; those of a live process are left alone.
    The removed ones."""
    if not checkpoint_root.is_dir():
        return []
    removed = []
    for path in sorted(checkpoint_root.iterdir()):
        match = TEMPORARY_DIR.match(path.name)
        if not match or not path.is_dir() or process_running(int(match.group(2))):
            continue
        shutil.rmtree(path)
        removed.append(path)
        log.info(
            "removed %s: an unfinished checkpoint of step %d whose writer (pid %s) is no longer running",
            path,
            int(match.group(1)),
            match.group(2),
        )
    return removed


def settle_lineage(checkpoint_root: Path, resume_from: Optional[Path], dist) -> None:
    """Make ``checkpoint_root`` hold only the lineage this run continues (module docstring), once at start.

    Every rank calls it after choosing ``resume_from``: it begins with a barrier (``dist.any_rank``), so
    rank 0 moves or removes directories only once no rank is still listing or verifying them; the other
    ranks return after the barrier. The chosen checkpoint itself never moves.
    """
    dist.any_rank(False)
    if not dist.is_main:
        return
    remove_stale_temporaries(checkpoint_root)
    if resume_from is None:
        why = "this run starts from step 0 (a new lineage)"
    elif not _same_dir(Path(resume_from).parent, checkpoint_root):
        why = f"this run continues {resume_from}, a checkpoint of another directory (a new lineage)"
    else:
        why = f"this run continues {Path(resume_from).name}, older than these checkpoints"
    move_aside(checkpoint_root, off_lineage(checkpoint_root, resume_from), why)
