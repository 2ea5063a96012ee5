"""Quiet by default: framework messages a user can do nothing about are hidden; ours never are.

A default run of MindSpore 2.9 + mindformers 1.9 prints warnings about the frameworks themselves:

- MindSpore's graph compiler (C++ submodule ``ANALYZER``): ``auto_monad ... Some side effect nodes were
  eliminated by mistake`` for a compiled graph that leaves an output of a cell unused (the default run's step
  did until its loss changed; other graphs may);
- MindSpore's Python logger: ``Module 'mindspore.common.api' is deprecated`` (MindSpore's own import);
- mindformers' logger: ``Import PyNative...ForCausalLM failed: No module named 'hyper_parallel'``
  (model classes mindmoe never uses).

:func:`quiet_framework_logs` (first thing in every command's ``main``, before MindSpore is imported)
hides exactly these: the ``ANALYZER`` submodule logs errors only, and the two Python messages are
filtered by their text on the two framework loggers. Other MindSpore and mindformers warnings, every
framework error, and everything of mindmoe (its ``mindmoe.*`` loggers, its exceptions) stay visible.
The variables are set in ``os.environ``, so msrun workers inherit them.

``MINDMOE_FRAMEWORK_LOGS=1`` shows them all again; a ``MS_SUBMODULE_LOG_v`` the user set is kept.
"""

import logging
import os
import re

#: Set to 1 to see the framework messages this module hides.
FRAMEWORK_LOGS_ENV = "MINDMOE_FRAMEWORK_LOGS"
#: MindSpore's per-submodule C++ log levels (3 = errors only).
QUIET_SUBMODULES = "{ANALYZER:3}"
#: Where mindformers writes its log files, out of the working directory (mindformers' default: ./output).
MINDFORMERS_LOG_DIR = os.path.join("~", ".cache", "mindmoe", "mindformers_log")
#: Messages of the two frameworks' Python loggers that say nothing about the user's run.
NOISE = (
    re.compile(r"Module 'mindspore\.[\w.]+' is deprecated from version"),
    re.compile(r"Import PyNative\w* failed: No module named 'hyper_parallel'"),
)


def framework_logs_wanted() -> bool:
    return os.environ.get(FRAMEWORK_LOGS_ENV, "").strip().lower() not in ("", "0", "false", "no")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.search(message) for pattern in NOISE)


def quiet_framework_logs() -> None:
    """Hide the framework noise listed above unless ``MINDMOE_FRAMEWORK_LOGS=1``; call before importing MindSpore."""
    os.environ.setdefault("LOG_MF_PATH", os.path.expanduser(MINDFORMERS_LOG_DIR))
    if framework_logs_wanted():
        return
    os.environ.setdefault("MS_SUBMODULE_LOG_v", QUIET_SUBMODULES)
    # Both frameworks log through a logger of a fixed name that does not propagate; a filter set on
    # it now is kept when they configure it on import (MindSpore: ME.mindspore.log.<pid>,
    # mindformers: "mindformers" + its log directory).
    names = (f"ME.mindspore.log.{os.getpid()}", "mindformers" + os.path.expanduser(os.environ["LOG_MF_PATH"]))
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
