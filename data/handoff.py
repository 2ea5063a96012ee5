"""How the processes of one job share one preparation: a writer builds, the others wait and read.

The cache key of the shards hashes the content of every data file, which only the writer reads.
The other processes (``msrun`` workers other than rank 0) name the preparation by what they can
see without reading a file: its path, size and modification time, with every other setting of the
key. When the writer has the complete entry (built, or found intact), it writes a pointer under
that name, ``data/ready/<name>.json``, holding the entry's key; renamed into place, so a reader
sees the whole pointer or none. A reader waits for the pointer and for the entry it names to be
complete and intact (:mod:`data.cache_entry`), then uses it; a pointer of an earlier job is as
good when the files are unchanged. A file edited in place keeps its path but not its mtime.
"""

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Dict, Tuple

from mindmoe.data.cache_entry import META, entry_damage

logger = logging.getLogger(__name__)

READY = "ready"
#: Seconds between two looks at the pointer, growing to the second value.
POLL_SECONDS = (0.2, 5.0)


def visible_name(fields: Dict, files: Dict[str, Path]) -> str:
    """The name of a preparation from ``fields`` (every non-content field of its key) and the
    ``stat`` of ``files``: what any process of the job computes the same without reading them."""
    seen = {key: [str(path), path.stat().st_size, path.stat().st_mtime_ns] for key, path in files.items()}
    text = json.dumps({"fields": fields, "files": seen}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def publish(root: Path, name: str, key: str) -> None:
    """Point ``name`` at the complete entry ``data/<key>`` (the writer, after building or reusing it)."""
    ready = root / "data" / READY
    ready.mkdir(parents=True, exist_ok=True)
    staging = ready / f".{name}.{os.getpid()}"
    staging.write_text(json.dumps({"key": key}))
    os.replace(staging, ready / f"{name}.json")


def wait_for_entry(root: Path, name: str, timeout_s: float) -> Tuple[str, Dict]:
    """``(key, meta)`` of the entry the writer points ``name`` at, once complete and intact.

    Raises ``TimeoutError`` naming the cache directory and ``data.wait_timeout_s`` after ``timeout_s``.
    """
    pointer = root / "data" / READY / f"{name}.json"
    started, pause, said = time.monotonic(), POLL_SECONDS[0], None
    while True:
        key, state = _look(root, pointer)
        if state is None:
            logger.info("data cache entry %s written by the writer process: using it", root / "data" / key)
            return key, json.loads((root / "data" / key / META).read_text())
        if state != said:
            logger.info("waiting for the writer process: %s", state)
            said = state
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise TimeoutError(
                f"data.wait_timeout_s={timeout_s:g}: waited {waited:.0f} s for the process writing the data "
                f"cache in {root} ({state}); the writer is rank 0 of the job (or mindmoe-data, run ahead with "
                "the same data.* keys). Raise data.wait_timeout_s for a corpus that takes longer to prepare, "
                "or run mindmoe-data first; nodes that do not share data.cache_dir each need it run there"
            )
        time.sleep(min(pause, max(timeout_s - waited, 0.0)))
        pause = min(pause * 2, POLL_SECONDS[1])


def _look(root: Path, pointer: Path) -> Tuple[str, object]:
    """``(key, None)`` when the pointed-at entry is ready, else ``(key or "", what is missing)``."""
    try:
        key = json.loads(pointer.read_text())["key"]
    except FileNotFoundError:
        return "", f"no pointer {pointer.name} in {pointer.parent} yet"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "", f"pointer {pointer} is unreadable"
    entry = root / "data" / key
    if not (entry / META).is_file():
        return key, f"entry {entry} is not complete yet"
    damage = entry_damage(entry)
    return key, None if damage is None else f"entry {entry} is damaged ({damage}) and being rebuilt"
