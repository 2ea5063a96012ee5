"""A config section read back from what ``dataclasses.asdict`` wrote (``state.json``, an export manifest)."""

import dataclasses
from collections.abc import Mapping


def from_record(cls, values, source: str, section: str):
    """``cls(**values)``; ValueError naming ``source`` when ``values`` is not an object or holds a key ``cls`` does
    not have (``section``: the key prefix the message names, e.g. ``moe``)."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{source}: must be an object of {section}.* keys, got {type(values).__name__}")
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"{source}: unknown {section} keys {', '.join(unknown)} (written by another mindmoe version?)")
    return cls(**dict(values))
