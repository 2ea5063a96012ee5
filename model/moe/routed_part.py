"""The routed part of an MoE layer: how the tokens reach the routed experts and come back, chosen once at build.

Shape legend: T tokens, H hidden, K experts per token, A = T * K assignments.

A routed part is ``(experts, x [T, H], routing, grad_scale [T]) -> (y [T, H], kept [A] fp32)``: ``routing =
(topk_idx [T, K], weight [T, K])``, ``y_t = sum_k weight_tk * expert_{topk_tk}(x_t)`` over the kept assignments,
``grad_scale`` how much each token trains the expert weights (gradient isolation's ``token_grad``; the products of
experts built without ``row_scaled`` ignore it). The experts are an argument, not a child cell: they stay the
layer's (``mlp.experts.*``, the checkpoint's names). Two implementations:

- :class:`GroupedRoutedPart`: a :class:`~model.moe.token_dispatcher.TokenDispatcher` over the experts' products
  (dispatch -> experts on the dispatcher's buffer -> combine); every device, every dispatcher;
- :class:`HostTokenPart`: the experts' tokens-to-tokens kernel (:func:`model.kernels.token_experts`, CPU training
  graphs with a dispatcher that ``routes_tokens``): no expert row lives in the graph.
"""

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops import functional as F


def dispatched_output(dispatcher, experts, x_TH, routing, scale_T):
    """``(y [T, H], kept [A])`` of ``experts`` behind ``dispatcher``; ``scale_T`` (or None) moves to the rows of the
    dispatcher's buffer as the experts' row scale."""
    expert_inputs, state = dispatcher.dispatch(x_TH, routing)
    group_sizes, row_scale = dispatcher.expert_args(state, scale_T)
    y_TH = dispatcher.combine(experts(expert_inputs, group_sizes, row_scale), state)
    return y_TH, dispatcher.kept(state)


class GroupedRoutedPart(nn.Cell):
    """Dispatch, the experts' products, combine (module docstring). ``row_scaled``: whether the experts were built
    to scale their weight gradients per row (only then is the token scale moved to the rows)."""

    def __init__(self, dispatcher, row_scaled: bool):
        super().__init__()
        self.dispatcher = dispatcher
        self.row_scaled = row_scaled

    def construct(self, experts, x_TH, routing, grad_scale_T):
        return dispatched_output(self.dispatcher, experts, x_TH, routing, grad_scale_T if self.row_scaled else None)


class HostTokenPart(GroupedRoutedPart):
    """The dispatcher's ``token_experts``: the experts from tokens to tokens in one host kernel each way (module
    docstring); ``kept`` is all ones (dropless). A graph compiled for any token count (``set_inputs`` with None
    dimensions) runs the grouped path instead: a host kernel's shapes are fixed when it compiles."""

    def __init__(self, dispatcher, row_scaled: bool, top_k: int):
        super().__init__(dispatcher, row_scaled)
        self.top_k = top_k

    def construct(self, experts, x_TH, routing, grad_scale_T):
        num_tokens = x_TH.shape[0]
        if not F.isconstant(num_tokens):
            return super().construct(experts, x_TH, routing, grad_scale_T)
        y_TH = self.dispatcher.token_experts(x_TH, routing, experts, grad_scale_T)
        return y_TH, ops.ones((num_tokens * self.top_k,), ms.float32)


def routed_part(dispatcher, experts, top_k: int):
    """The routed part of a layer whose ``experts`` sit behind ``dispatcher``: :class:`HostTokenPart` where the
    dispatcher routes tokens and the device has a tokens-to-tokens kernel for these experts (it is built here),
    else :class:`GroupedRoutedPart`."""
    if dispatcher.routes_tokens and experts.build_token_kernel(top_k):
        return HostTokenPart(dispatcher, experts.row_scaled, top_k)
    return GroupedRoutedPart(dispatcher, experts.row_scaled)
