"""The markdown table of which implementation of each kernel function every device runs, read from the registry
(:data:`mindmoe.model.kernels.IMPLEMENTATIONS`). docs/kernels.md holds its output (a test compares them).

    python -m mindmoe.model.kernels.table
"""

import inspect
import re

from mindmoe.model import kernels
from mindmoe.model.kernels import cpu_native

PACKAGE = kernels.__name__ + "."

#: The first ``double-backticked`` dotted name of a docstring: the op an Ascend implementation calls.
OP_NAME = re.compile(r"``([A-Za-z_][\w.]*)``")


def target(factory):
    """What a registry entry builds: a no-argument lambda (``lambda: cpu.swiglu``) stands for what it returns."""
    if getattr(factory, "__name__", "") == "<lambda>" and not inspect.signature(factory).parameters:
        return factory()
    return factory


def qualified(factory) -> str:
    """``module.name`` of an entry, relative to the kernels package."""
    built = target(factory)
    return f"`{built.__module__.removeprefix(PACKAGE)}.{built.__qualname__}`"


def native_of(factory):
    """The compiled kernel class of a CPU entry made by :func:`~.cpu_native.when_built`, else None."""
    if getattr(factory, "__qualname__", "") != cpu_native.when_built.__qualname__ + ".<locals>.factory":
        return None
    return inspect.getclosurevars(factory).nonlocals["native"]


def op_name(factory) -> str:
    """The op named first in an implementation's docstring, or "" when it names none."""
    match = OP_NAME.search(inspect.getdoc(target(factory)) or "")
    return match.group(1) if match else ""


def cell(factory, formula) -> str:
    """A device's entry: ``as CPU`` where it is the formula, ``none`` where the device has no such kernel (the model
    takes another path), else the implementation and, when its docstring names one first, the op it calls."""
    if factory is None:
        return "none"
    if factory is formula:
        return "as CPU"
    op = op_name(factory)
    return qualified(factory) + (f": `{op}`" if op else "")


def markdown_table() -> str:
    """``| kernel | CPU | CPU training graphs, compiled | Ascend | GPU |``, one row per kernel function. CPU is the
    MindSpore formula (:data:`~mindmoe.model.kernels.FORMULA_KERNELS`) that the other devices fall back to."""
    formulas = kernels.FORMULA_KERNELS
    cpu, ascend, gpu = (kernels.IMPLEMENTATIONS[device] for device in ("CPU", "Ascend", "GPU"))
    names = list(dict.fromkeys(name for table in kernels.IMPLEMENTATIONS.values() for name in table))
    rows = [
        "| kernel | CPU | CPU training graphs, with the compiled library | Ascend | GPU |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        formula = formulas.get(name)
        native = native_of(cpu.get(name))
        compiled = qualified(native) if native is not None else cell(cpu.get(name), formula)
        cells = [qualified(formula) if formula else "none", compiled, cell(ascend.get(name), formula)]
        rows.append(f"| `{name}` | " + " | ".join(cells + [cell(gpu.get(name), formula)]) + " |")
    return "\n".join(rows) + "\n"


def main() -> None:
    print(markdown_table(), end="")


if __name__ == "__main__":
    main()
