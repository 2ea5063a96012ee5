"""How a cell reads its trained parameters: through a seam that sharded data parallelism can replace.

A cell that holds a trained parameter ``weight`` also holds ``weight_full`` (:class:`FullWeight`, the identity)
and computes with ``self.weight_full(self.weight)``, never with ``self.weight`` itself. ``parallel.zero=2`` / ``3``
(train/parallel/fsdp.py) install another cell in its place: one that hands the backward's gradient to the ranks
owning its ranges (reduce-scatter), and under ``zero=3`` also all-gathers the parameter from its ranges before
the forward uses it. A parameter without a seam is sharded as ``zero=1`` shards it (whole weight and gradient,
ranged moments), so a new cell works unsharded until it reads its weights through one.
"""

from mindspore import nn

#: The suffix of a seam's attribute: parameter ``weight`` is read through ``weight_full``.
SEAM_SUFFIX = "_full"


class FullWeight(nn.Cell):
    """The seam of one parameter: the parameter as held (identity)."""

    def construct(self, weight):
        return weight


def add_seams(cell: nn.Cell, *names: str) -> None:
    """Give ``cell`` the identity seam of each of its parameter attributes ``names``."""
    for name in names:
        setattr(cell, name + SEAM_SUFFIX, FullWeight())


def seams(model: nn.Cell) -> dict:
    """``{parameter name: (cell, seam attribute)}`` of every parameter of ``model`` read through a seam."""
    found = {}
    for _, cell in model.cells_and_names():
        for attribute, param in cell._params.items():
            seam = attribute + SEAM_SUFFIX
            if param is not None and isinstance(getattr(cell, seam, None), nn.Cell):
                found[param.name] = (cell, seam)
    return found
