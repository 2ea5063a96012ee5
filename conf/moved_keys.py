"""Keys that moved to another section: an old command line fails naming the new place (exit 2).

Hydra alone would answer ``Could not override 'model.dispatch'``, which does not say where the key went.
Every command's ``main`` calls :func:`exit_on_moved_keys` on its arguments before Hydra composes the config.
A leaf module: it imports nothing of mindmoe but the key lists.
"""

import sys
from typing import Iterable, Optional

from mindmoe.conf.exit_codes import CONFIG_ERROR
from mindmoe.model.dsa_config import DSA_TRAINING_KEYS
from mindmoe.model.moe_config import MOE_KEYS

#: ``{old dotted key: new dotted key}``: MoE training policy left ``model.*`` for ``moe.*``, DSA's training schedule
#: ``model.dsa.*`` for ``dsa.*``; ``model.*`` holds only the architecture a checkpoint stores.
MOVED_KEYS = {
    **{f"model.{key}": f"moe.{key}" for key in MOE_KEYS},
    **{f"model.dsa.{key}": f"dsa.{key}" for key in DSA_TRAINING_KEYS},
}


def moved_key_error(args: Iterable[str]) -> Optional[str]:
    """The message for the first moved key among command-line ``args`` (``key=value``, ``+key=``, ``~key``)."""
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in MOVED_KEYS:
            new = MOVED_KEYS[key]
            value = arg.split("=", 1)[1] if "=" in arg else "..."
            return (
                f"{key} is now {new} (model.* holds only the architecture a checkpoint stores; how it is "
                f"trained is the {new.split('.')[0]}.* section): write {new}={value}"
            )
    return None


def exit_on_moved_keys(prog: str, args: Iterable[str]) -> None:
    """Print ``<prog>: error: ...`` and exit with the configuration error's code when ``args`` hold a moved key."""
    error = moved_key_error(args)
    if error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
