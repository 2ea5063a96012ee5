"""Data section of the run config (``data.*`` keys)."""

from dataclasses import dataclass, field
from typing import List, Optional

from mindmoe.conf.ranges import above, at_least, bounded

DATA_FORMATS = ("text", "sft")
#: ``data.sft_overlong`` values.
OVERLONG_POLICIES = ("error", "truncate")

# "${samples:}" is an OmegaConf resolver (registered in conf.schema) giving the
# installed data/samples directory, so the defaults work after a non-editable install.


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes packed token windows."""

    #: Local json/jsonl/parquet/txt files of the training mixture (one source per entry).
    train_files: List[str] = field(default_factory=lambda: ["${samples:}/corpus_train.jsonl"])
    #: Local files for validation loss; empty list = no validation.
    valid_files: List[str] = field(default_factory=lambda: ["${samples:}/corpus_valid.jsonl"])
    #: Mixture weights, one per entry of ``train_files`` (relative; null = proportional to size).
    weights: Optional[List[float]] = None
    #: Field holding the document text in json/jsonl/parquet rows.
    text_field: str = "text"
    #: Tokens the model sees per sequence; windows of ``seq_len + 1`` tokens are packed.
    seq_len: int = bounded(128, at_least(1))
    #: Sequences per optimizer step over all data-parallel ranks.
    global_batch_size: int = bounded(16, at_least(1))
    #: Sequences per forward/backward on one rank; accumulation = global / (micro * dp).
    micro_batch_size: int = bounded(16, at_least(1))
    #: A sentencepiece ``.model`` file or a HF checkpoint directory (``tokenizer.json`` or ``tokenizer.model``)
    #: to use; null = the ``model.pretrained`` directory's tokenizer if set, else train one on ``train_files``.
    #: A resumed run uses the tokenizer its checkpoint carries.
    tokenizer: Optional[str] = None
    #: Vocabulary size when the tokenizer is trained here.
    vocab_size: int = bounded(4096, at_least(1))
    #: Where tokenizers and MindRecord shards are cached; null = ``$MINDMOE_CACHE`` or ``~/.cache/mindmoe``.
    cache_dir: Optional[str] = None
    #: Processes used to tokenise the corpus.
    num_proc: int = bounded(2, at_least(1))
    #: Packed windows per MindRecord shard file.
    shard_windows: int = bounded(4096, at_least(1))
    #: ``text`` (documents, every token scored) or ``sft`` (JSONL conversations, ``messages`` or
    #: ``prompt``/``response``, rendered with the tokenizer's chat template; only assistant tokens scored).
    format: str = "text"
    #: SFT conversations longer than ``seq_len + 1`` tokens: ``error``, or ``truncate`` (cut and counted;
    #: dropped when no assistant token is left).
    sft_overlong: str = "error"
    #: Seconds a process other than the writer (rank 0 of a job) waits for the writer to finish the cache
    #: entry of this data before failing; preparing a large corpus the first time takes that long at most.
    wait_timeout_s: float = bounded(7200.0, above(0, "seconds"))


def validate_data_config(cfg: DataConfig) -> None:
    """Raise ValueError naming the ``data.*`` key whose value cannot work (files are checked when read)."""
    if not cfg.train_files:
        raise ValueError("data.train_files is empty; list at least one training file")
    if cfg.weights is not None:
        if len(cfg.weights) != len(cfg.train_files):
            raise ValueError(
                f"data.weights has {len(cfg.weights)} entries but data.train_files has "
                f"{len(cfg.train_files)}; give one weight per training file"
            )
        if any(w < 0 for w in cfg.weights) or sum(cfg.weights) <= 0:
            raise ValueError(f"data.weights={list(cfg.weights)} must be non-negative with a positive sum")
    for name in ("seq_len", "vocab_size", "shard_windows", "num_proc"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"data.{name}={getattr(cfg, name)} must be at least 1")
    if not cfg.wait_timeout_s > 0:
        raise ValueError(f"data.wait_timeout_s={cfg.wait_timeout_s} must be a positive number of seconds")
    if cfg.format not in DATA_FORMATS:
        raise ValueError(f"data.format={cfg.format!r} must be one of {DATA_FORMATS}")
    if cfg.sft_overlong not in OVERLONG_POLICIES:
        raise ValueError(f"data.sft_overlong={cfg.sft_overlong!r} must be one of {OVERLONG_POLICIES}")
    if cfg.format == "sft" and cfg.weights is not None:
        raise ValueError("data.weights: mixture weights apply to data.format=text; SFT files are used whole")
    if cfg.format == "sft" and not cfg.tokenizer:
        raise ValueError(
            "data.format=sft needs a tokenizer: set model.pretrained (its tokenizer is used) or data.tokenizer"
        )


def validate_batch_sizes(data: DataConfig) -> None:
    """``data.global_batch_size`` must split into micro-batches; how they split over data-parallel
    ranks is :func:`conf.checks.resolve_layout`."""
    if data.micro_batch_size < 1 or data.global_batch_size % data.micro_batch_size:
        raise ValueError(
            f"data.global_batch_size={data.global_batch_size} must be a positive multiple of "
            f"data.micro_batch_size={data.micro_batch_size}"
        )
