"""Export section of the run config (``export.*`` keys, read by ``mindmoe-export``)."""

from dataclasses import dataclass, field
from typing import List, Optional

EXPORT_FORMATS = ("mindir", "hf")
EXPORT_DTYPES = ("fp32", "fp16", "bf16")


@dataclass
class ExportConfig:
    """What ``mindmoe-export`` writes from ``checkpoint=...`` or ``model.pretrained=...``."""

    #: mindir (prefill.mindir + decode.mindir for serving) or hf (a transformers-loadable directory).
    format: str = "mindir"
    #: Output directory, written whole or not at all (staged in a hidden sibling, then renamed); it must be
    #: absent or empty, and neither hold nor lie inside the source. null = the Hydra run dir.
    out: Optional[str] = None
    #: Replace a non-empty ``export.out`` as a whole (its old files are deleted once the new export is
    #: complete); false = refuse, listing the files already there.
    overwrite: bool = False
    #: A PEFT LoRA adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``, e.g.
    #: ``<run>/checkpoints/step_N/adapter``) merged into the base weights before export; null = none.
    adapter: Optional[str] = None
    #: Weight and KV-cache dtype of the MindIR graphs: fp32, or fp16/bf16 for Ascend. RMSNorm weights and
    #: the router stay fp32; logits are fp32. CPU runs fp32 and fp16 graphs, not bf16. hf writes fp32 only.
    dtype: str = "fp32"
    #: Batch sizes written into the Ascend converter configs beside the graphs (ge.dynamicDims gears).
    ascend_batch_sizes: List[int] = field(default_factory=lambda: [1, 4, 8])
    #: Prompt lengths of the prefill gears, capped at model.max_position_embeddings; every (batch size, length)
    #: pair is one gear (100 at most).
    ascend_prompt_lengths: List[int] = field(default_factory=lambda: [128, 512, 2048])
    #: Fixed KV-cache capacity of the decode graph on Ascend (prompt + generated tokens);
    #: 0 = model.max_position_embeddings.
    ascend_cache_len: int = 0


def validate_export_config(cfg: ExportConfig, max_position_embeddings: int) -> None:
    """Raise ValueError naming the ``export.*`` key whose value cannot work."""

    def fail(key: str, why: str):
        raise ValueError(f"export.{key}={getattr(cfg, key)!r}: {why}")

    if cfg.format not in EXPORT_FORMATS:
        fail("format", f"must be one of {EXPORT_FORMATS}")
    if cfg.dtype not in EXPORT_DTYPES:
        fail("dtype", f"must be one of {EXPORT_DTYPES}")
    if cfg.format == "hf" and cfg.dtype != "fp32":
        fail("dtype", "export.format=hf writes fp32 safetensors; dtype applies to export.format=mindir")
    if cfg.format != "mindir":
        return
    batch_sizes, lengths = list(cfg.ascend_batch_sizes), list(cfg.ascend_prompt_lengths)
    if not batch_sizes or any(size < 1 for size in batch_sizes):
        fail("ascend_batch_sizes", "must list batch sizes >= 1")
    if not lengths or any(length < 1 for length in lengths):
        fail("ascend_prompt_lengths", "must list prompt lengths >= 1")
    if len(batch_sizes) * len(lengths) > 100:
        fail("ascend_prompt_lengths", "times export.ascend_batch_sizes gives more than the converter's 100 gears")
    if not 0 <= cfg.ascend_cache_len <= max_position_embeddings:
        fail("ascend_cache_len", f"must be in [0, model.max_position_embeddings={max_position_embeddings}]")
