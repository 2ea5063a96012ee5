"""Exit codes of every mindmoe command, and the one mapping from an error to its code and message.

======  ==================================================================================
code    meaning
======  ==================================================================================
0       done (``mindmoe-launch launch.dry_run=true`` too, whatever it warns about)
1       ``mindmoe-launch``: a worker of the job failed; the message names its rank and log
2       usage or configuration error: a key, a file or the input is wrong (the message names it);
        also a run dir held by another run, a busy ``launch.master_port``
3       ``mindmoe-train`` stopped by SIGTERM/SIGINT after writing the checkpoint of that step, and
        ``mindmoe-launch`` after forwarding such a signal to its workers
======  ==================================================================================

Hydra itself rejects an unknown key or a value of the wrong type before a command runs (exit 1).
This module imports nothing of mindmoe and no MindSpore, so every package's command line can use it.
"""

import functools
import sys

OK = 0
#: ``mindmoe-launch``: msrun stopped the job because one of its workers exited with an error.
WORKER_FAILED = 1
CONFIG_ERROR = 2
#: ``mindmoe-train`` after a SIGTERM/SIGINT checkpoint; ``mindmoe-launch`` reads it in a worker's status
#: and exits with it after forwarding a signal it received.
STOPPED_ON_SIGNAL = 3

#: What a wrong key, file or input raises; the message names it and what would be right.
CONFIG_ERRORS = (ValueError, FileNotFoundError, FloatingPointError, NotImplementedError)


class CommandExit(RuntimeError):
    """Ends a command with :attr:`exit_code`, reported as ``<prog>: <label>: <message>``."""

    exit_code = CONFIG_ERROR
    label = "error"


def exit_status(error: BaseException):
    """``(exit code, label)`` for an error a command reports, or None for an unexpected one (a bug)."""
    if isinstance(error, CommandExit):
        return error.exit_code, error.label
    if isinstance(error, CONFIG_ERRORS):
        return CONFIG_ERROR, "error"
    return None


def reports_errors(prog: str):
    """Decorate a command's main: an error :func:`exit_status` knows is printed to stderr as
    ``<prog>: error: <message>`` (``<prog>: stopped: ...`` for a stop) and exits with its code.

    Under ``@hydra.main`` this goes below it: Hydra would report the exception itself, with exit 1.
    Any other exception keeps its traceback.
    """

    def decorate(main):
        @functools.wraps(main)
        def reporting_main(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except (CommandExit, *CONFIG_ERRORS) as error:
                code, label = exit_status(error)
                print(f"{prog}: {label}: {error}", file=sys.stderr)
                sys.exit(code)

        return reporting_main

    return decorate
