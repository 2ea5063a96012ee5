"""Markdown reference tables of config sections, generated from the dataclasses (key, default, domain, meaning).

Each key is documented once, by the ``#:`` comment above its dataclass field; docs/configuration.md's key tables
are this output (a test compares them), so a default or a description cannot drift between the two.

    python -m mindmoe.conf.reference launch     # the table of the launch.* keys
"""

import ast
import dataclasses
import inspect
import json
import sys
import textwrap

from mindmoe.conf.ranges import field_ranges


def field_docs(cls) -> dict:
    """``{field name: its #: comment}`` of a dataclass, read from its source."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    docs = {}
    for node in ast.parse("\n".join(lines)).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        comment, row = [], node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#:"):
            comment.insert(0, lines[row].strip()[2:].strip())
            row -= 1
        docs[node.target.id] = " ".join(comment)
    return docs


def default_value(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def yaml_text(value) -> str:
    """A default as it is written on the command line (YAML flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(item) for item in value) + "]"
    if dataclasses.is_dataclass(value):
        return json.dumps(dataclasses.asdict(value))
    return str(value)


def markdown_table(section: str, cls) -> str:
    """``| key | default | domain | meaning |`` rows of every field of ``cls`` as ``section.<field>``; the domain is
    the one declared on the field (:func:`conf.ranges.bounded`), empty for the others."""
    docs = field_docs(cls)
    ranges = field_ranges(cls)
    rows = ["| key | default | domain | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        meaning = docs.get(field.name, "").replace("``", "`").replace("|", "\\|")
        domain = ranges[field.name].bound() if field.name in ranges else ""
        rows.append(f"| `{section}.{field.name}` | `{yaml_text(default_value(field))}` | {domain} | {meaning} |")
    return "\n".join(rows) + "\n"


def section_class(section: str):
    """The dataclass of a top-level section of the run config (``conf/schema.py``)."""
    from mindmoe.conf.schema import Config

    for field in dataclasses.fields(Config):
        if field.name == section and dataclasses.is_dataclass(field.default_factory):
            return field.default_factory
    raise ValueError(f"{section!r} is not a section of the run config")


def main(argv=None) -> None:
    for section in argv if argv is not None else sys.argv[1:]:
        print(markdown_table(section, section_class(section)), end="")


if __name__ == "__main__":
    main()
