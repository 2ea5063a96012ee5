"""The global gradient norm of the train step, in fp32.

Its value must not depend on how the routed experts are laid out over ranks: with ``parallel.ep`` each rank holds
``E/ep`` rows of every expert tensor (and of its LoRA factors), and a clipped update is only the one a single process
makes if the norm is bit for bit the same. So an expert tensor contributes its per-expert sums of squares
(:func:`expert_row_squares`, one value per expert row whatever else the rank holds), and the norm adds, in one sum,
every expert tensor's row values in global expert order after the other parameters' (:func:`layout_free_norm`).
"""

import math

from mindspore import ops

from mindmoe.model import kernels

#: Longest piece of an expert row that one dot product of the formula of ``kernels.row_squares`` reduces.
PIECE = 4096


def piece_length(row_size: int) -> int:
    """The largest divisor of ``row_size`` (elements of one expert row) that is at most :data:`PIECE`."""
    return next(length for length in range(min(row_size, PIECE), 0, -1) if row_size % length == 0)


def squared_norm_of(squares):
    """``grads -> sum_i |g_i|^2`` (fp32) with ``squares``, a ``kernels.row_squares`` kernel: each gradient as one row
    (the formula: one dot product of the whole tensor)."""

    def global_squared_norm(grads):
        return ops.stack([squares(g.reshape(1, -1), None).reshape(()) for g in grads]).sum()

    return global_squared_norm


def global_squared_norm_kernel():
    """:func:`squared_norm_of` this device's ``kernels.row_squares`` (built now: call it at build time)."""
    return squared_norm_of(kernels.row_squares())


def expert_row_squares(tensor, piece: int, squares):
    """``[e]``: the sum of squares of each row of an expert tensor ``[e, ...]`` (fp32) by ``squares``
    (``kernels.row_squares``; its formula cuts a row into pieces of ``piece`` elements, :func:`piece_length`): a
    row's value does not depend on the other rows."""
    return squares(tensor.reshape(tensor.shape[0], -1), piece)


def expert_parameter_names(model) -> set:
    """Names of ``model``'s routed expert tensors (their first axis the held experts) and of their LoRA factors."""
    from mindmoe.model.moe.experts import routed_expert_cells

    return {param.name for cell in routed_expert_cells(model) for param in cell.get_parameters()}


def layout_free_norm(params, expert_names, gather_rows=None, group_size: int = 1):
    """``grads -> |g|^2`` over ``params`` (in the order of the gradients), the same whatever share of the experts a
    rank holds: the other parameters' :func:`global_squared_norm` plus one sum of every expert tensor's
    :func:`expert_row_squares` in ``[tensor, expert]`` order. ``gather_rows``: ``[P, e] -> [G * P, e]`` in rank order
    over the ``group_size`` ranks of an expert group, whose rank ``i`` holds experts ``[i e, (i + 1) e)`` (None: this
    process holds every expert)."""
    params = list(params)
    squares = kernels.row_squares()
    global_squared_norm = squared_norm_of(squares)
    expert_idx = [i for i, p in enumerate(params) if p.name in expert_names]
    dense_idx = [i for i, p in enumerate(params) if p.name not in expert_names]
    if not expert_idx:
        return global_squared_norm

    pieces = [piece_length(math.prod(params[i].shape[1:])) for i in expert_idx]

    def squared_norm(grads):
        rows_Pe = ops.stack([expert_row_squares(grads[i], piece, squares) for i, piece in zip(expert_idx, pieces)])
        if gather_rows is not None:
            num_params, held = rows_Pe.shape
            rows_GPe = gather_rows(rows_Pe).reshape(group_size, num_params, held)
            rows_Pe = rows_GPe.transpose(1, 0, 2).reshape(num_params, group_size * held)
        experts = rows_Pe.sum()
        if not dense_idx:
            return experts
        return global_squared_norm(tuple(grads[i] for i in dense_idx)) + experts

    return squared_norm
