"""Failures and recovery: which checkpoint to resume from, the random state it continues, and stopping
cleanly on a signal."""

import logging
import signal
from pathlib import Path

from mindmoe.conf.exit_codes import STOPPED_ON_SIGNAL, CommandExit
from mindmoe.model.lora.dropout import dropout_draws, dropout_streams, set_dropout_state
from mindmoe.train.checkpoints.checkpoint import (
    CorruptCheckpointError,
    check_complete,
    resolve_checkpoint,
    verify_checkpoint,
)
from mindmoe.train.checkpoints.lineage import step_dirs

log = logging.getLogger("mindmoe.train")


def pick_resume_checkpoint(resume: str, checkpoint_root: Path, on_corrupt: str, hash_files: bool = True):
    """The checkpoint to resume from (verified against its recorded sizes and hashes), or None.

    ``hash_files=False`` (the ranks of a job) checks sizes only: each rank hashes the files it reads when it
    loads them (:func:`train.checkpoints.checkpoint.load_model_weights`), so a file altered without a change of size
    is an error then, not a fall-back to an older checkpoint.

    ``auto`` takes the newest ``step_*`` directory directly under ``checkpoint_root`` (never one under
    ``abandoned-*``: :mod:`train.checkpoints.lineage`). One that is incomplete (no ``state.json``, a listed file
    missing) or fails its hashes is an error naming it, or with ``on_corrupt="previous"`` is skipped with
    a warning for the next older one. Nothing is moved or deleted here: every rank of a job calls this,
    then :func:`train.checkpoints.lineage.settle_lineage` moves aside what the chosen checkpoint does not continue.
    """
    if resume == "none":
        return None
    verify = verify_checkpoint if hash_files else check_complete
    if resume != "auto":
        chosen = resolve_checkpoint(resume)
        verify(chosen)
        return chosen
    for candidate in reversed(step_dirs(checkpoint_root)):
        try:
            verify(candidate)
            return candidate
        except CorruptCheckpointError as error:
            if on_corrupt != "previous":
                raise CorruptCheckpointError(
                    f"{error}; set train.on_corrupt_checkpoint=previous to resume "
                    "from the newest older checkpoint instead (it is moved aside, not deleted)"
                ) from error
            log.warning("%s; trying the previous checkpoint (train.on_corrupt_checkpoint=previous)", error)
    if step_dirs(checkpoint_root):
        log.warning("no checkpoint of %s verifies: starting from step 0", checkpoint_root)
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


#: ``state.json`` key: the draws so far of the LoRA dropout streams (:mod:`model.lora.dropout`).
DROPOUT_DRAWS = "lora_dropout_draws"


def dropout_checkpoint_state(model) -> dict:
    """What ``state.json`` records of ``model``'s dropout masks: the draw count (nothing without LoRA dropout)."""
    draws = dropout_draws(model)
    return {} if draws is None else {DROPOUT_DRAWS: draws}


def restore_dropout(model, dp_rank: int, state) -> None:
    """Key the dropout masks by ``dp_rank`` and continue them where checkpoint ``state`` (None: a fresh
    run) left them, so a resumed run draws the masks of the uninterrupted one. Before the first step."""
    draws = 0 if state is None else state.get(DROPOUT_DRAWS)
    if draws is None:
        if dropout_streams(model):
            log.warning(
                "the checkpoint has no %s (written before dropout state was saved): LoRA dropout masks "
                "restart from the first step's",
                DROPOUT_DRAWS,
            )
        draws = 0
    set_dropout_state(model, dp_rank, int(draws))
