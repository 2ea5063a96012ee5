"""LoRA on the routed experts: stacked per-expert adapters, built in place of :class:`RoutedExperts`.

Routed experts are stacked ``[E, O, F]`` tensors; their adapters are stacked too: ``A [E, R, F]``,
``B [E, O, R]``, row e being the factors PEFT gives HF module ``experts.{e}.<proj>`` (see
:mod:`model.lora`). A process holding a share of the experts (``held_experts``, ``parallel.ep``) holds
the adapter rows of those experts only: ``A [e, R, F]``, ``B [e, O, R]``.

Shape legend (docs/architecture.md): E experts (e held here), C rows per expert, R rank, F input
features, O output features, H hidden, I expert width.
"""

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor

from mindmoe.model.lora import EXPERT_PROJECTIONS
from mindmoe.model.lora.layers import AdapterScope, AdapterSpec, lora_a_init
from mindmoe.model.moe.experts import RoutedExperts


class LoraRoutedExperts(RoutedExperts):
    """:class:`RoutedExperts` with per-expert adapters on some of its projections.

    The factors of projection ``gate_proj`` are the pair ``gate_proj_lora`` (None when it has no
    adapter), named ``gate_proj.lora_A`` / ``gate_proj.lora_B`` beside the stacked weight ``gate_proj``.
    With gradient isolation (``token_grad``) the adapter factors get the same row-scaled weight
    gradient as the expert weights: a locked token trains its expert's adapters with weight lambda.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        std: float,
        rng: np.random.Generator,
        projections,
        adapter: AdapterSpec,
        held_experts: range = None,
        name: str = "experts",
        dtypes: dict = None,
        frozen: tuple = (),
        row_scaled: bool = False,
    ):
        super().__init__(
            num_experts, hidden_size, intermediate_size, std, rng, held_experts, dtypes, frozen, row_scaled
        )
        self.scaling = adapter.scaling
        self.dropout = adapter.dropout
        self.projections = tuple(p for p in EXPERT_PROJECTIONS if p in projections)
        held = range(self.first_expert, self.first_expert + self.num_held)
        for proj in EXPERT_PROJECTIONS:
            factors = None
            if proj in self.projections:
                _, out_features, in_features = getattr(self, proj).shape
                # Like the expert weights, A is drawn for every expert and this process keeps its rows: a
                # process holding a share (parallel.ep) starts from the rows one process would, and the
                # random stream of the adapters built after these is the same.
                lora_A = lora_a_init(adapter.rng, (num_experts, adapter.rank, in_features))
                if len(held) != num_experts:
                    lora_A = Tensor(lora_A.asnumpy()[held.start : held.stop])
                # A ParameterTuple keeps the dotted names: a parameter attribute cannot contain a dot.
                factors = ParameterTuple(
                    (
                        Parameter(lora_A, name=f"{proj}.lora_A"),
                        Parameter(
                            Tensor(np.zeros((len(held), out_features, adapter.rank), np.float32)),
                            name=f"{proj}.lora_B",
                        ),
                    )
                )
            setattr(self, f"{proj}_lora", factors)
            if factors is not None:
                self.add_grouped_site(f"{proj}_lora_A", False)
                self.add_grouped_site(f"{proj}_lora_B", False)
            # Each projection's adapter drops its own input independently (PEFT: one dropout per module).
            setattr(self, f"{proj}_dropout", adapter.dropout_stream(f"{name}.{proj}") if factors else None)

    def _project(self, proj, x_ECF, scale_EC, group_sizes=None):
        # group_sizes: None on an [E, C, F] buffer, else grouped rows (RoutedExperts.expert_matmul).
        y_ECO = self.expert_matmul(x_ECF, self.held_weight(proj), scale_EC, group_sizes, proj)
        factors = getattr(self, proj + "_lora")
        if factors is None:
            return y_ECO
        if self.dropout > 0 and self.training:
            # A share of the experts' [E, C, F] buffer (parallel.ep, allgather) is dropped as those rows of the
            # whole buffer: the masks of one process. Grouped rows are the whole sorted buffer on every rank.
            first_row = self.first_expert * x_ECF.shape[1] if group_sizes is None else 0
            x_ECF = getattr(self, proj + "_dropout").drop(x_ECF, first_row)
        lora_A_ERF = factors[0].astype(x_ECF.dtype)
        lora_B_EOR = factors[1].astype(x_ECF.dtype)
        low_ECR = self.expert_matmul(x_ECF, lora_A_ERF, scale_EC, group_sizes, proj + "_lora_A")
        delta_ECO = self.expert_matmul(low_ECR, lora_B_EOR, scale_EC, group_sizes, proj + "_lora_B")
        return y_ECO + delta_ECO * self.scaling

    def token_specs(self):
        specs = super().token_specs()
        if specs is None:
            return None
        for proj, spec in zip(EXPERT_PROJECTIONS, specs):
            stream = getattr(self, proj + "_dropout")
            spec.lora = getattr(self, proj + "_lora") is not None
            spec.dropout = (stream.threshold, stream.scale) if spec.lora and stream is not None else None
        return specs

    def token_shapes(self):
        shapes = []
        for proj in EXPERT_PROJECTIONS:
            factors = getattr(self, proj + "_lora")
            adapter = (None, None) if factors is None else (tuple(factors[0].shape), tuple(factors[1].shape))
            shapes.append((tuple(getattr(self, proj).shape),) + adapter)
        return shapes

    def token_slots(self, proj: str, num_rows: int):
        weight, none_f32, _, none_i32, _ = super().token_slots(proj, num_rows)
        factors = getattr(self, proj + "_lora")
        if factors is None:
            return weight, none_f32, none_f32, none_i32, none_i32
        if self.dropout > 0 and self.training:
            # The masks of the grouped path: rows of the whole expert-sorted buffer (first row 0).
            row_Z, col_F = getattr(self, proj + "_dropout").factors(num_rows, getattr(self, proj).shape[2])
        else:
            row_Z, col_F = none_i32, none_i32
        return weight, factors[0], factors[1], row_Z, col_F

    def _forward(self, x_ECH, scale_EC, groups=None):
        gate_ECI = self._project("gate_proj", x_ECH, scale_EC, groups)
        up_ECI = self._project("up_proj", x_ECH, scale_EC, groups)
        return self._project("down_proj", self.activation(gate_ECI, up_ECI), scale_EC, groups)


def routed_experts(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    std: float,
    rng,
    lora: AdapterScope,
    held_experts=None,
    row_scaled: bool = False,
):
    """The :class:`RoutedExperts` at scope ``lora`` (``layers.{i}.mlp.experts``), with the planned adapters;
    ``held_experts`` and ``row_scaled`` as there."""
    projections = lora.expert_projections()
    dtypes = {proj: lora.weight_dtype(proj) for proj in EXPERT_PROJECTIONS}
    frozen = tuple(proj for proj in EXPERT_PROJECTIONS if lora.frozen(proj))
    if not projections:
        return RoutedExperts(
            num_experts, hidden_size, intermediate_size, std, rng, held_experts, dtypes, frozen, row_scaled
        )
    return LoraRoutedExperts(
        num_experts,
        hidden_size,
        intermediate_size,
        std,
        rng,
        projections,
        lora.spec,
        held_experts,
        lora.prefix,
        dtypes,
        frozen,
        row_scaled,
    )
