"""MoE training policy (``moe.*`` keys): how the routed experts are trained, not what they are.

A checkpoint's architecture is ``model.*`` (``state.json`` ``model_config``, HF ``config.json``); these keys
choose the token dispatch, the balancing losses, the bias update and expert locking of one run, so a
pretrained model or a resumed run may change them freely. The run records them beside the architecture
(``state.json`` ``moe_config``) because serving replays the lock rule the model was trained with.
"""

import dataclasses
from dataclasses import dataclass

from mindmoe.conf.ranges import Range, above, at_least, bounded, field_ranges
from mindmoe.model.records import from_record

#: ``moe.dispatch``: ``auto`` resolves per run (:meth:`MoEConfig.resolved`).
DISPATCH_MODES = ("auto", "capacity", "dropless")
AUX_LOSS_TYPES = ("switch", "seq", "none")
ISOLATION_MODES = ("expert_update", "token_grad")
#: The keys that were ``model.*`` before they moved here: an old override names its new place.
MOE_KEYS = (
    "dispatch",
    "capacity_factor",
    "aux_loss",
    "aux_loss_coeff",
    "z_loss_coeff",
    "bias_update_rate",
    "expert_lock",
    "lock_run_length",
    "lock_span",
    "isolation_decay",
    "isolation_mode",
)


@dataclass
class MoEConfig:
    """Token dispatch, router balancing and expert locking of the MoE layers."""

    #: capacity (static buffers, overflow dropped by position), dropless (exact, no token dropped) or auto:
    #: dropless for a model whose weights were trained elsewhere (``model.pretrained``,
    #: ``lora.base_checkpoint``: dropping would change its logits), capacity for one initialised here.
    dispatch: str = "auto"
    #: Expert capacity = ceil(capacity_factor * tokens * top_k / num_experts) per micro-batch.
    capacity_factor: float = bounded(1.25, above(0))
    #: Load-balancing loss: switch (coeff * E * sum_e f_e P_e, f_e = c_e / (k T), over the micro-batch),
    #: seq (the same per sequence, averaged over sequences; DeepSeek-V3) or none.
    aux_loss: str = "switch"
    #: Coefficient of the aux loss; perfectly balanced routing gives exactly this value per layer.
    aux_loss_coeff: float = bounded(1e-2, at_least(0))
    #: Coefficient of the router z-loss, coeff * mean(logsumexp(logits)^2); 0 disables it.
    z_loss_coeff: float = bounded(1e-3, at_least(0))
    #: Step of the aux-loss-free balancing bias (``model.expert_bias``) per optimizer step,
    #: ``b += rate * sign(mean_load - load)`` from the effective routing counts of the whole global batch;
    #: 0 keeps the bias fixed (e.g. an imported one).
    bias_update_rate: float = bounded(0.0, at_least(0))
    #: Expert locking: after ``lock_run_length`` consecutive tokens of a document with the same natural
    #: top-k set, the next ``lock_span`` tokens are routed to that set.
    expert_lock: bool = False
    #: Identical consecutive routing decisions that start a lock.
    lock_run_length: int = bounded(5, at_least(1))
    #: Tokens after a qualifying run that stay locked.
    lock_span: int = bounded(10, at_least(1))
    #: lambda: how much locked tokens still train the experts they are locked to (1 = no isolation).
    isolation_decay: float = bounded(0.3, Range(0, 1))
    #: expert_update (scale expert e's optimizer update by 1-(1-lambda)*f_e, f_e = locked share of its
    #: tokens; survives Adam's scale invariance) or token_grad (scale locked tokens' expert gradients).
    isolation_mode: str = "expert_update"

    def resolved(self, trained_weights: bool) -> "MoEConfig":
        """This policy with ``dispatch=auto`` made concrete: dropless when the model's weights were trained
        elsewhere (``trained_weights``), capacity otherwise."""
        if self.dispatch != "auto":
            return self
        return dataclasses.replace(self, dispatch="dropless" if trained_weights else "capacity")

    @property
    def dropless(self) -> bool:
        return self.dispatch == "dropless"

    @classmethod
    def from_dict(cls, values: dict, source: str) -> "MoEConfig":
        """The policy ``dataclasses.asdict`` wrote (``state.json`` ``moe_config``); ValueError naming ``source``."""
        return from_record(cls, values, source, "moe")


MOE_CHOICES = {"dispatch": DISPATCH_MODES, "aux_loss": AUX_LOSS_TYPES, "isolation_mode": ISOLATION_MODES}


def validate_moe_config(moe: MoEConfig, expert_bias: bool = True) -> None:
    """Raise ValueError naming the ``moe.*`` key whose value cannot work; ``expert_bias``: whether the
    model has the correction bias that ``moe.bias_update_rate`` updates (``model.expert_bias``)."""
    for key, choices in MOE_CHOICES.items():
        if getattr(moe, key) not in choices:
            raise ValueError(f"moe.{key}={getattr(moe, key)!r}: must be one of {choices}")
    for key, domain in field_ranges(MoEConfig).items():
        if not domain.contains(getattr(moe, key)):
            raise ValueError(f"moe.{key}={getattr(moe, key)!r}: must be {domain.text()}")
    if moe.bias_update_rate > 0 and not expert_bias:
        raise ValueError(
            f"moe.bias_update_rate={moe.bias_update_rate!r}: needs model.expert_bias=true (there is no bias to update)"
        )


def moe_policy(moe) -> MoEConfig:
    """Accept the dataclass, None (the defaults) or a mapping (an OmegaConf node) of its fields."""
    if moe is None:
        return MoEConfig()
    if isinstance(moe, MoEConfig):
        return moe
    return MoEConfig(**dict(moe))
