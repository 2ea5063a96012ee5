"""Data section of the run config (``data.*`` keys)."""

from dataclasses import dataclass, field
from typing import List, Optional

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
    seq_len: int = 128
    #: Sequences per optimizer step over all data-parallel ranks.
    global_batch_size: int = 16
    #: Sequences per forward/backward on one rank; accumulation = global / (micro * dp).
    micro_batch_size: int = 16
    #: A sentencepiece ``.model`` file or a HF checkpoint directory (``tokenizer.json`` or ``tokenizer.model``)
    #: to use; null = the ``model.pretrained`` directory's tokenizer if set, else train one on ``train_files``.
    tokenizer: Optional[str] = None
    #: Vocabulary size when the tokenizer is trained here.
    vocab_size: int = 4096
    #: Where tokenizers and MindRecord shards are cached; null = ``$MINDMOE_CACHE`` or ``~/.cache/mindmoe``.
    cache_dir: Optional[str] = None
    #: Processes used to tokenise the corpus.
    num_proc: int = 2
    #: Packed windows per MindRecord shard file.
    shard_windows: int = 4096
    #: ``text`` (documents, every token scored) or ``sft`` (JSONL conversations, ``messages`` or
    #: ``prompt``/``response``, rendered with the tokenizer's chat template; only assistant tokens scored).
    format: str = "text"
    #: SFT conversations longer than ``seq_len + 1`` tokens: ``error``, or ``truncate`` (cut and counted;
    #: dropped when no assistant token is left).
    sft_overlong: str = "error"
