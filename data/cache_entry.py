"""One cache entry (a tokenizer or a set of shards): built once across processes, reused while intact.

An entry is built in a staging directory beside it and renamed into place, under a ``FileLock``;
concurrent processes (all ``msrun`` workers prepare the data) wait for the first one and reuse its
result. ``files.json`` records the size of every file the build wrote and ``meta.json``, written
last, marks the entry complete. A complete entry whose files no longer match (a shard truncated by
a full disk or a copy, a file deleted by hand) is rebuilt with a warning instead of being handed to
MindSpore, which would fail on it with a traceback naming no file.
"""

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, Optional

from filelock import FileLock

from mindmoe.data.scratch import scratch_prefix

logger = logging.getLogger(__name__)

META = "meta.json"
MANIFEST = "files.json"


def build_once(entry: Path, build: Callable[[Path], Dict]) -> Dict:
    """The ``meta.json`` of cache ``entry``, calling ``build(staging_dir) -> meta`` if it is absent or damaged.

    Safe across processes: the builder holds a file lock, later callers wait on it
    and find the finished entry.
    """
    meta = _intact_meta(entry, report=False)
    if meta is not None:
        logger.info("cache hit: %s", entry)
        return meta
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        meta = _intact_meta(entry, report=True)
        if meta is not None:
            logger.info("cache hit (built by another process): %s", entry)
            return meta
        logger.info("cache miss, building: %s", entry)
        # Staging directories of a crashed builder of this entry; only the lock holder creates them.
        for stale in entry.parent.glob(f".{entry.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=scratch_prefix(f".{entry.name}."), dir=entry.parent))
        try:
            meta = build(staging)
            sizes = {path.name: path.stat().st_size for path in sorted(staging.iterdir()) if path.is_file()}
            (staging / MANIFEST).write_text(json.dumps(sizes, indent=2))
            (staging / META).write_text(json.dumps(meta, indent=2, ensure_ascii=False))
            if entry.exists():  # damaged, or left without meta.json, e.g. partly deleted by hand
                shutil.rmtree(entry)
            os.rename(staging, entry)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return meta


def entry_damage(entry: Path) -> Optional[str]:
    """What is wrong with the files of the complete ``entry`` (None if they are as written)."""
    for name in (META, MANIFEST):
        try:
            json.loads((entry / name).read_text())
        except FileNotFoundError:
            return f"{name} is missing"
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f"{name} is cut short or corrupt"
    sizes = json.loads((entry / MANIFEST).read_text())
    if not isinstance(sizes, dict):
        return f"{MANIFEST} is corrupt"
    for name, size in sizes.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    return None


def _intact_meta(entry: Path, report: bool) -> Optional[Dict]:
    """The ``meta.json`` of ``entry`` if it is complete and intact; None otherwise (a damaged one
    is logged when ``report``)."""
    if not (entry / META).exists():
        return None
    damage = entry_damage(entry)
    if damage is not None:
        if report:
            logger.warning("cache entry %s is damaged: %s; rebuilding it", entry, damage)
        return None
    return json.loads((entry / META).read_text())
