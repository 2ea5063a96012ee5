"""DeepSeek Sparse Attention: the lightning indexer's shape (``model.dsa.*``) and how it trains (``dsa.*``).

DSA (DeepSeek-V3.2 report; GLM-5, HF ``glm_moe_dsa``) adds to every MLA layer a small indexer that scores
each earlier key for each query; the main attention then sees only the ``index_topk`` best keys of each
query (:mod:`model.dsa`). Training has two stages (the report's §2.1):

=============  ===========================================================================================
stage          what runs
=============  ===========================================================================================
dense_warmup   the main attention is dense (every earlier key); only the indexer trains, on the KL loss
               ``KL(p_t || softmax(I_t))`` against the main attention's distribution (every other
               parameter frozen); after ``warmup_steps`` optimizer steps the run continues in ``sparse``
sparse         the main attention sees the selected keys only; the KL loss is restricted to them and the
               indexer's inputs are detached from the main model (it learns only from its loss); every
               parameter trains
off            the indexer exists (its weights import, export and checkpoint) but is not run: dense MLA
=============  ===========================================================================================

The stage, its warm-up and the indexer loss's weight are a run's training schedule (:class:`DSATrainingConfig`, the
``dsa:`` section), not the architecture a checkpoint stores. An imported ``glm_moe_dsa`` checkpoint trains ``sparse``
unless told otherwise; every export serves ``sparse`` (``off`` stays dense).
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields

from mindmoe.model.records import from_record

DSA_STAGES = ("dense_warmup", "sparse", "off")


#: The ``dsa.*`` keys (:class:`DSATrainingConfig`); before that section they were ``model.dsa.*``.
DSA_TRAINING_KEYS = ("stage", "warmup_steps", "indexer_loss_coeff")


@dataclass
class DSAConfig:
    """The indexer (HF ``index_n_heads``, ``index_head_dim``, ``index_topk``)."""

    #: Indexer query heads; 0 = no indexer (plain MLA). GLM-5: 32.
    index_n_heads: int = 0
    #: Width of the indexer's query heads and of its one shared key; the first ``qk_rope_head_dim`` channels
    #: are rotated (interleaved pairs). GLM-5: 128.
    index_head_dim: int = 128
    #: Keys each query keeps (``min(index_topk, position + 1)`` for the first positions). GLM-5: 2048.
    index_topk: int = 2048

    @property
    def enabled(self) -> bool:
        return self.index_n_heads > 0


@dataclass
class DSATrainingConfig:
    """How a model's DSA indexers train (read only when ``model.dsa.index_n_heads`` > 0)."""

    #: dense_warmup | sparse | off (model/dsa_config.py's docstring).
    stage: str = "sparse"
    #: dense_warmup: optimizer steps before the run switches to sparse (> 0).
    warmup_steps: int = 0
    #: Weight of the indexer's KL loss in the objective (logged unweighted as ``indexer_loss``).
    indexer_loss_coeff: float = 1.0

    @classmethod
    def from_dict(cls, values: dict, source: str) -> "DSATrainingConfig":
        """The schedule ``dataclasses.asdict`` wrote (``state.json`` ``dsa_config``); ValueError naming ``source``."""
        return from_record(cls, values, source, "dsa")


def dsa_training(value) -> DSATrainingConfig:
    """Accept the dataclass, None (the defaults) or a mapping (an OmegaConf node) of its fields."""
    if value is None:
        return DSATrainingConfig()
    if isinstance(value, DSATrainingConfig):
        return value
    return DSATrainingConfig(**dict(value))


def validate_dsa_training(cfg: DSATrainingConfig) -> None:
    """Raise ValueError naming the ``dsa.*`` key whose value cannot work."""

    def fail(key: str, why: str):
        raise ValueError(f"dsa.{key}={getattr(cfg, key)!r}: {why}")

    if cfg.stage not in DSA_STAGES:
        fail("stage", f"must be one of {DSA_STAGES}")
    if isinstance(cfg.warmup_steps, bool) or not isinstance(cfg.warmup_steps, int) or cfg.warmup_steps < 0:
        fail("warmup_steps", "must be an integer >= 0")
    if cfg.indexer_loss_coeff < 0:
        fail("indexer_loss_coeff", "must be >= 0")
    if cfg.stage == "dense_warmup" and cfg.warmup_steps < 1:
        fail(
            "warmup_steps",
            "must be > 0 with dsa.stage=dense_warmup: the optimizer steps of the warm-up, after which the run trains "
            "sparse",
        )
    if cfg.stage != "dense_warmup" and cfg.warmup_steps:
        fail("warmup_steps", f"is only read with dsa.stage=dense_warmup; leave it at 0 for {cfg.stage!r}")


def dsa_config(value) -> DSAConfig:
    """Accept the dataclass or a mapping of its fields (a config read back with ``dataclasses.asdict``)."""
    if isinstance(value, DSAConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"model.dsa={value!r}: must be a mapping of {[f.name for f in fields(DSAConfig)]}")
    known = {f.name for f in fields(DSAConfig)}
    for key in value:
        if key in DSA_TRAINING_KEYS:
            raise ValueError(f"model.dsa.{key} is now dsa.{key}: how the indexer trains is the dsa.* section")
        if key not in known:
            raise ValueError(f"model.dsa.{key}: unknown key; known keys are {sorted(known)}")
    return DSAConfig(**dict(value))


def validate_dsa(cfg: DSAConfig, attention_type: str, q_lora_rank, qk_rope_head_dim: int) -> None:
    """Raise ValueError naming the ``model.dsa.*`` (or ``model.*``) key whose value cannot work."""

    def fail(key: str, why: str):
        raise ValueError(f"model.dsa.{key}={getattr(cfg, key)!r}: {why}")

    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            fail(key, "must be an integer >= 0")
    if not cfg.enabled:
        return
    if attention_type != "mla":
        fail("index_n_heads", "the DSA indexer belongs to MLA: set model.attention_type=mla (or index_n_heads: 0)")
    if q_lora_rank is None:
        fail(
            "index_n_heads",
            "the indexer's queries are read from MLA's compressed query (q_a_proj): set model.q_lora_rank",
        )
    if cfg.index_head_dim < qk_rope_head_dim or cfg.index_head_dim % 2:
        fail(
            "index_head_dim",
            f"must be even and at least model.qk_rope_head_dim={qk_rope_head_dim} (its first "
            f"{qk_rope_head_dim} channels are rotated)",
        )
    if cfg.index_topk < 1:
        fail("index_topk", "must be >= 1 (keys each query keeps)")
