"""Failures and recovery: which checkpoint to resume from, and stopping cleanly on a signal."""

import logging
import signal
from pathlib import Path

from mindmoe.conf.exit_codes import STOPPED_ON_SIGNAL, CommandExit
from mindmoe.train.checkpoint import CorruptCheckpointError, list_checkpoints, resolve_checkpoint, verify_checkpoint

log = logging.getLogger("mindmoe.train")


def pick_resume_checkpoint(resume: str, checkpoint_root: Path, on_corrupt: str):
    """The checkpoint to resume from (verified against its recorded hashes), or None.

    ``auto`` takes the newest complete checkpoint of the run dir; one that fails its hashes is
    an error, or with ``on_corrupt="previous"`` is skipped for the next older one.
    """
    if resume == "none":
        return None
    if resume != "auto":
        chosen = resolve_checkpoint(resume)
        verify_checkpoint(chosen)
        return chosen
    for candidate in reversed(list_checkpoints(checkpoint_root)):
        try:
            verify_checkpoint(candidate)
            return candidate
        except CorruptCheckpointError as error:
            if on_corrupt != "previous":
                raise CorruptCheckpointError(
                    f"{error}; set train.on_corrupt_checkpoint=previous to resume "
                    "from the newest older checkpoint instead"
                ) from error
            log.warning("%s; trying the previous checkpoint", error)
    return None


class StopRequest:
    """Within its ``with`` block, SIGTERM/SIGINT only set ``signal_name``; the training loop
    checks it at the next step boundary, writes a checkpoint and stops."""

    def __init__(self):
        self.signal_name = None
        self._previous = {}

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


class TrainingStopped(CommandExit):
    """Raised after the checkpoint requested by a signal has been written."""

    exit_code = STOPPED_ON_SIGNAL
    label = "stopped"
