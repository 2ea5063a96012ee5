"""Where ``mindmoe-export`` writes, checked before a model is built, and how it writes there.

:func:`check_export_target` refuses an ``export.out`` that is a file, is or holds or lies inside a directory
the export reads (the source model, its tokenizer, the adapter), or already holds files (unless
``export.overwrite=true``). :func:`staged_export` writes the export into a hidden sibling
``.<name>.tmp-<pid>`` and renames it to ``export.out`` only once complete: an export that fails or is
interrupted (exception, Ctrl-C, SIGTERM) leaves ``export.out`` as it was, and an overwritten directory is
replaced as a whole, so no file of an earlier export is left beside the new ones.
"""

import logging
import os
import re
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

from mindmoe.data.scratch import process_running

log = logging.getLogger("mindmoe.export")

#: Files Hydra writes into its run dir, kept when the run dir itself is the export (``export.out=null``).
HYDRA_DIR = ".hydra"


@dataclass(frozen=True)
class ExportTarget:
    """A checked output directory: ``out`` (absolute), how the user named it (``name``, for messages),
    whether an existing export is replaced, and ``keep``: names in ``out`` that belong to Hydra's run dir."""

    out: Path
    name: str
    overwrite: bool = False
    keep: tuple = ()


def _within(path: Path, directory: Path) -> bool:
    return path == directory or path.is_relative_to(directory)


def _relation(out: Path, source: Path) -> Optional[str]:
    if out == source:
        return "is"
    if _within(out, source):
        return "is inside"
    if _within(source, out):
        return "contains"
    return None


def check_export_target(
    out,
    sources: Dict[str, Path],
    overwrite: bool = False,
    run_dir: Optional[Path] = None,
) -> ExportTarget:
    """The checked target for ``out`` (``export.out``; None = ``run_dir``, the Hydra run dir of this export).

    ``sources``: what the export reads, by the key that named it (``{"model.pretrained": path, ...}``).
    Raises ValueError naming ``export.out`` and the conflicting path, before anything is written.
    """
    if out is None:
        target = Path(run_dir).expanduser().resolve()
        name = f"the run dir {target} (export.out=null)"
        hydra_files = target.iterdir() if target.is_dir() else ()
        keep = tuple(sorted(p.name for p in hydra_files if p.name == HYDRA_DIR or p.suffix == ".log"))
    else:
        target = Path(out).expanduser().resolve()
        name, keep = f"export.out={out}", ()
    if target.exists() and not target.is_dir():
        raise ValueError(f"{name} is a file, not a directory; choose a directory for the export")
    for key, source in sources.items():
        relation = _relation(target, Path(source).expanduser().resolve())
        if relation:
            raise ValueError(
                f"{name} {relation} the export's source {key}={source}: an export never writes where it reads "
                "from; choose an export.out outside it"
            )
    present = sorted(p.name for p in target.iterdir() if p.name not in keep) if target.is_dir() else []
    if present and not overwrite:
        shown = ", ".join(present[:8]) + (", ..." if len(present) > 8 else "")
        raise ValueError(
            f"{name} is not empty ({len(present)} entries: {shown}); export into a new or empty directory, "
            "or set export.overwrite=true to replace it as a whole"
        )
    if present:
        _check_replaceable(target, name, run_dir)
    return ExportTarget(target, name, overwrite, keep)


def _check_replaceable(target: Path, name: str, run_dir: Optional[Path]) -> None:
    """``export.overwrite=true`` deletes the old directory: never one holding the working directory, the
    home directory or this export's own run dir (its log is being written)."""
    protected = {"the working directory": Path.cwd(), "the home directory": Path.home()}
    if run_dir is not None and Path(run_dir).expanduser().resolve() != target:
        # With export.out=null the run dir is the target; Hydra's files in it are kept (ExportTarget.keep).
        protected["this export's run dir (hydra.run.dir)"] = Path(run_dir)
    for what, path in protected.items():
        path = path.expanduser().resolve()
        if _within(path, target):
            raise ValueError(
                f"export.overwrite=true would delete {name}, which holds {what} {path}; "
                "export into a directory of its own"
            )


def staging_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def remove_stale_staging(out: Path) -> None:
    """Delete ``.<name>.tmp-<pid>`` siblings of ``out`` left by exports that died (their pid is gone)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.tmp-(\d+)")
    for path in out.parent.iterdir() if out.parent.is_dir() else []:
        match = pattern.fullmatch(path.name)
        if match and int(match.group(1)) != os.getpid() and not process_running(int(match.group(1))):
            log.warning("removing %s, left by an interrupted export (process %s is gone)", path, match.group(1))
            shutil.rmtree(path, ignore_errors=True)


def publish(staged: Path, target: ExportTarget) -> None:
    """Rename the complete ``staged`` directory to ``target.out``, replacing what is there as a whole
    (Hydra's own files of the run dir, ``target.keep``, move along into the new directory)."""
    out = target.out
    if not out.exists():
        os.rename(staged, out)
        return
    for name in target.keep:
        if (out / name).exists() and not (staged / name).exists():
            os.rename(out / name, staged / name)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(staged, out)
    shutil.rmtree(old)
    if target.overwrite:
        log.info("replaced the previous contents of %s", out)


@contextmanager
def _sigterm_raises():
    """SIGTERM raises SystemExit (status 143) while the export is staged, so the staging dir is removed."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def staged_export(target: ExportTarget):
    """Yield an empty staging directory beside ``target.out``; on success it becomes ``target.out``, on any
    error or interrupt it is deleted and ``target.out`` is left as it was."""
    remove_stale_staging(target.out)
    staged = staging_dir(target.out)
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    try:
        with _sigterm_raises():
            yield staged
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    publish(staged, target)


def export_sources(labelled: Sequence) -> Dict[str, Path]:
    """``{key: path}`` of the ``(key, path or None)`` pairs an export reads (None entries left out)."""
    return {key: Path(path) for key, path in labelled if path is not None}
