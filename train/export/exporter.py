"""``mindmoe-export``: serving graphs or a HF directory from a checkpoint or a HF checkpoint directory.

    mindmoe-export checkpoint=<run dir>/checkpoints/step_000200 export.out=exported
    mindmoe-export model.pretrained=/models/glm-4.5-air export.out=exported export.dtype=bf16
    mindmoe-export checkpoint=... export.format=hf export.out=hf_dir

``export.format=mindir`` writes ``prefill.mindir`` and ``decode.mindir`` (:mod:`model.export.serving`; MLA
models cache their latent, :mod:`model.export.mla_serving`), the tokenizer files, ``manifest.json`` (every
input/output, the cache layout, the model config, versions, source hashes),
``CONVERT.md`` and the Ascend converter configs (:mod:`train.export.convert`). ``export.format=hf`` writes a
transformers-loadable directory with :func:`model.hf.export_hf`: a HF source keeps its ``model_type`` (a
``glm4_moe_lite`` is not relabelled ``deepseek_v3``), a checkpoint gets the first architecture that reproduces it.
"""

import dataclasses
import importlib.metadata
import json
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import mindspore as ms
from omegaconf import OmegaConf

from mindmoe.conf.explicit_keys import explicit_keys
from mindmoe.conf.policy import run_dsa_training, run_moe_config
from mindmoe.data.prepare import file_sha256
from mindmoe.data.tokenizer_files import copy_tokenizer, open_tokenizer, special_token_ids
from mindmoe.model.checkpoints.files import checkpoint_dsa_training, checkpoint_moe_config
from mindmoe.model.checkpoints.shards import model_files
from mindmoe.model.config import ModelConfig, validate_model_config
from mindmoe.model.dsa_config import DSATrainingConfig
from mindmoe.model.export.runner import MANIFEST_FILE
from mindmoe.model.hf import (
    HFCheckpointError,
    ImportedConfig,
    apply_overrides,
    export_hf,
    hf_config_from_model,
    read_pretrained_config,
)
from mindmoe.model.hf.load import weight_files
from mindmoe.model.kernels.host_runtime import configure_host_runtime
from mindmoe.model.moe_config import MoEConfig
from mindmoe.train.checkpoints.checkpoint import (
    STATE_FILE,
    checkpoint_model_config,
    read_state,
    resolve_checkpoint,
    verify_checkpoint,
)
from mindmoe.train.checkpoints.tokenizer import checkpoint_tokenizer
from mindmoe.train.export.config import ExportConfig, validate_export_config
from mindmoe.train.export.target import ExportTarget, check_export_target, export_sources, staged_export
from mindmoe.train.init_model import explicit_model_keys, model_overrides

log = logging.getLogger("mindmoe.export")

MANIFEST_FORMAT = "mindmoe-mindir/1"


@dataclasses.dataclass
class ExportSource:
    """The model to export: where it is, its config, its tokenizer and the hashes of its weight files."""

    kind: str  # "checkpoint" or "pretrained"
    path: Path
    model_config: ModelConfig
    tokenizer: Optional[Path]
    sha256: dict
    step: Optional[int] = None
    notes: list = dataclasses.field(default_factory=list)
    #: The MoE policy the model was trained with (a checkpoint's ``state.json``; the run's ``moe.*`` for a HF
    #: directory), explicit ``moe.*`` keys on top; serving replays its expert locking, always dropless.
    moe_config: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    #: How its DSA indexers trained (recorded, or the run's ``dsa.*``); a dense warm-up is served sparse.
    dsa_training: DSATrainingConfig = dataclasses.field(default_factory=DSATrainingConfig)


def command_line_model_overrides(cfg, override_args, runtime=None) -> dict:
    """``model.*`` keys set explicitly: on the command line (``model.rope_scaling.type=...`` counts as
    ``rope_scaling``) or by a chosen recipe / model group (``runtime``: Hydra's ``hydra.runtime``; see
    :func:`train.init_model.explicit_model_keys`), with their typed values from ``cfg``;
    ``model.pretrained`` itself is not an override."""
    return model_overrides(OmegaConf.to_object(cfg.model), explicit_model_keys(override_args, runtime))


def command_line_moe_overrides(cfg, override_args, runtime=None) -> dict:
    """``moe.*`` keys set explicitly (command line, chosen recipe or model group), with their values from ``cfg``."""
    keys = {key.split(".")[1] for key in explicit_keys(override_args, runtime) if key.startswith("moe.")}
    return {key: cfg.moe[key] for key in sorted(keys)}


def resolve_source(cfg, model_overrides: dict, moe_overrides: Optional[dict] = None) -> ExportSource:
    """The export source named by ``checkpoint`` or ``model.pretrained`` (exactly one of them); ``moe_overrides``:
    explicit ``moe.*`` keys that replace the policy the checkpoint records."""
    checkpoint, pretrained = cfg.checkpoint, cfg.model.pretrained
    if checkpoint and pretrained:
        raise ValueError(
            f"checkpoint={checkpoint} and model.pretrained={pretrained} are both set; export reads "
            "one model: pass only one of them"
        )
    if not checkpoint and not pretrained:
        raise ValueError(
            "nothing to export: pass checkpoint=<run dir>/checkpoints/step_NNNNNN (or its "
            "model.safetensors) or model.pretrained=<HF checkpoint directory>"
        )
    if pretrained:
        imported = read_pretrained_config(pretrained, model_overrides)
        files = weight_files(pretrained)
        return ExportSource(
            "pretrained",
            Path(pretrained).expanduser(),
            imported.model_config,
            Path(pretrained).expanduser(),
            {path.name: file_sha256(path) for path in files},
            notes=list(imported.notes),
            moe_config=run_moe_config(cfg),
            dsa_training=run_dsa_training(cfg),
        )
    try:
        checkpoint_dir = resolve_checkpoint(checkpoint)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"checkpoint={checkpoint}: {error}") from None
    verify_checkpoint(checkpoint_dir)
    state = read_state(checkpoint_dir)
    if (checkpoint_dir / "adapter").is_dir():
        raise ValueError(
            f"checkpoint={checkpoint}: a LoRA checkpoint holds only adapters; export its base with "
            f"model.pretrained=<base> (or checkpoint=<base checkpoint>) and "
            f"export.adapter={checkpoint_dir / 'adapter'}"
        )
    try:
        model_cfg = checkpoint_model_config(checkpoint_dir)
    except ValueError as err:
        raise ValueError(f"checkpoint={checkpoint}: {err}") from None
    if model_overrides:
        # The same rule as for HF imports: routing/runtime keys may change, the architecture may not.
        model_cfg = apply_overrides(
            ImportedConfig("mindmoe checkpoint", model_cfg), model_overrides, str(checkpoint_dir / STATE_FILE)
        )
    # Only the tokenizer the checkpoint carries is read (data.tokenizer for an older one that carries none),
    # so an export never copies a file from outside the checkpoint.
    try:
        tokenizer = checkpoint_tokenizer(checkpoint_dir, cfg.data.tokenizer)
    except ValueError as err:
        raise ValueError(f"checkpoint={checkpoint}: {err}") from None
    return ExportSource(
        "checkpoint",
        checkpoint_dir,
        model_cfg,
        tokenizer,
        # The hashes of the files holding the model's tensors (one file in one process, one per rank otherwise).
        {name: state["files"][name] for name in sorted(model_files(checkpoint_dir))},
        step=state.get("step"),
        moe_config=dataclasses.replace(checkpoint_moe_config(checkpoint_dir), **(moe_overrides or {})),
        dsa_training=checkpoint_dsa_training(checkpoint_dir),
    )


def merge_adapters(model, adapter_dir: Optional[str] = None, model_type: str = "glm4_moe"):
    """The one place where LoRA adapters are merged into the base weights before export.

    ``adapter_dir`` None: the model is exported as it is. Otherwise the PEFT adapter is merged
    (``W + scaling * B A`` per target, experts included; :func:`model.lora.peft_adapter.merge_adapters`) and
    the plain model with the base parameter names is returned. ``model_type``: the HF architecture
    whose module names the adapter uses (the imported checkpoint's).
    """
    if adapter_dir is None:
        return model
    from mindmoe.model.lora.peft_adapter import merge_adapters as merge_peft_adapter

    return merge_peft_adapter(model, Path(adapter_dir).expanduser(), model_type)


def source_model_type(source: "ExportSource") -> str:
    """The HF architecture of the source: a HF directory's own ``model_type``; for a mindmoe checkpoint
    (which does not record one) the first architecture that reproduces its model config, "" if none does."""
    if source.kind == "pretrained":
        return read_pretrained_config(source.path).model_type
    try:
        return hf_config_from_model(source.model_config)[0]
    except HFCheckpointError:
        return ""


def adapter_names_type(model_config: ModelConfig, model_type: str) -> str:
    """The architecture whose module names a LoRA adapter is read with: ``model_type``, or for a model no HF
    architecture reproduces, the one that names its attention's weights (a mismatch fails the merge loudly)."""
    from mindmoe.model.lora.plan import names_type

    return model_type or names_type(model_config)


def _adapter_of(cfg, source: "ExportSource"):
    """``(adapter dir or None, HF model_type or "")`` (see :func:`source_model_type`); the adapter's hash goes
    into the manifest."""
    export_cfg = cfg.export
    model_type = source_model_type(source)
    if not export_cfg.adapter:
        return None, model_type
    from mindmoe.model.lora.peft_adapter import ADAPTER_WEIGHTS

    adapter = Path(export_cfg.adapter).expanduser()
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(
            f"export.adapter={export_cfg.adapter}: no {ADAPTER_WEIGHTS} (expected a PEFT "
            "adapter directory such as <run dir>/checkpoints/step_000150/adapter)"
        )
    source.sha256["adapter/" + ADAPTER_WEIGHTS] = file_sha256(adapter / ADAPTER_WEIGHTS)
    source.notes.append(f"LoRA adapter {adapter} merged into the base weights")
    return adapter, model_type


def build_serving_model(source: ExportSource, model_overrides: dict):
    """The training model with the source's weights and dropless MoE dispatch (see model/export/serving.py);
    DeepSeek Sparse Attention in stage sparse unless ``dsa.stage`` is off (:func:`serve_dsa_sparse`)."""
    moe = dataclasses.replace(source.moe_config, dispatch="dropless")
    if source.kind == "pretrained":
        from mindmoe.model.hf import load_hf_pretrained

        _, model, notes = load_hf_pretrained(source.path, model_overrides, moe=moe, dsa=source.dsa_training)
        source.notes += [note for note in notes if note not in source.notes]
        return serve_dsa_sparse(model, source.notes)
    from mindmoe.model.transformer import MoETransformer
    from mindmoe.train.checkpoints.checkpoint import load_model_weights

    validate_model_config(source.model_config)
    model = MoETransformer(source.model_config, moe=moe, dsa=source.dsa_training)
    load_model_weights(list(model.get_parameters()), source.path)
    return serve_dsa_sparse(model, source.notes)


def serve_dsa_sparse(model, notes: list):
    """Switch a DSA model (``model.dsa.index_n_heads`` > 0) in stage dense_warmup to sparse, layers and
    ``dsa_training``: an export serves the attention the model is trained towards (model/dsa_config.py); stage off
    stays dense."""
    dsa = model.dsa_training
    if not model.config.dsa.enabled or dsa.stage in ("sparse", "off"):
        return model
    from mindmoe.model.mla import set_dsa_stage

    set_dsa_stage(model, "sparse")
    model.dsa_training = dataclasses.replace(dsa, stage="sparse", warmup_steps=0)
    notes.append(
        f"dsa.stage={dsa.stage!r} exported as 'sparse': every query attends to its "
        f"index_topk={model.config.dsa.index_topk} "
        "best keys, as training does after the warm-up"
    )
    return model


def export_hf_with_tokenizer(
    source, out_dir, model_config: ModelConfig = None, tokenizer_dir=None, model_type: str = ""
) -> list:
    """:func:`model.hf.export_hf` plus the tokenizer (a HF directory or a sentencepiece ``.model``): its
    files copied beside the weights and its bos/eos/pad ids in ``config.json``. ``model_type`` forces the
    architecture written ("": the first that reproduces the model). Returns the notes."""
    tokenizer = None if tokenizer_dir is None else Path(tokenizer_dir).expanduser()
    ids = {} if tokenizer is None else special_token_ids(open_tokenizer(tokenizer, "tokenizer"))
    notes = export_hf(source, model_config, out_dir, special_token_ids=ids, model_type=model_type)
    copy_tokenizer(tokenizer, Path(out_dir).expanduser())
    if tokenizer is not None and tokenizer.is_file():
        notes.append(
            "the sentencepiece model is copied as tokenizer.model; HF needs a tokenizer class to load it "
            "(e.g. LlamaTokenizer), which mindmoe does not choose for you"
        )
    return notes


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_manifest(
    source: ExportSource,
    model_config: ModelConfig,
    export_cfg: ExportConfig,
    graphs: dict,
    tokenizer_files: list,
    dsa_stage: str = "sparse",
) -> dict:
    """The manifest of a MindIR export; ``dsa_stage``: the stage its DSA layers serve (the cache layout follows)."""
    from mindmoe.model.export.mindir import cache_layout

    return {
        "format": MANIFEST_FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mindmoe_version": _version("mindmoe"),
        "mindspore_version": ms.__version__,
        "source": {"kind": source.kind, "path": str(source.path), "step": source.step, "sha256": source.sha256},
        "dtype": export_cfg.dtype,
        "dispatch": "dropless",
        "graphs": graphs,
        "cache": cache_layout(model_config, export_cfg.dtype, dsa_stage),
        "tokenizer_files": tokenizer_files,
        "model_config": dataclasses.asdict(model_config),
        "moe_config": dataclasses.asdict(dataclasses.replace(source.moe_config, dispatch="dropless")),
        "limits": [
            "every prompt of a prefill batch has the same length (no padding, no attention_mask)",
            "decode: position < cache_len <= model_config.max_position_embeddings; cache_len fixed per sequence",
            "each sequence is one document (no packing at serving time)",
        ]
        + (
            [
                "rope_scaling dynamic_ntk: the cached (RoPE) keys keep the scaling of the step that wrote them, so "
                "decoded logits differ from a full recompute once the length passes original_max_position"
            ]
            if model_config.rope_scaling.type == "dynamic_ntk"
            else []
        ),
        "notes": source.notes,
    }


def export_target(cfg, export_cfg: ExportConfig, source: ExportSource, adapter, run_dir: Path) -> ExportTarget:
    """``export.out`` checked against everything the export reads (:func:`train.export.target.check_export_target`)."""
    source_key = "checkpoint" if source.kind == "checkpoint" else "model.pretrained"
    tokenizer_key = "data.tokenizer" if cfg.data.tokenizer else f"the tokenizer of {source_key}"
    sources = export_sources(
        [(source_key, source.path), (tokenizer_key, source.tokenizer), ("export.adapter", adapter)]
    )
    return check_export_target(export_cfg.out, sources, export_cfg.overwrite, run_dir)


def run_export(cfg, run_dir: Path, override_args=None, runtime=None) -> Path:
    """Export as configured; returns the output directory. The export is written into a hidden sibling
    of it and renamed into place once complete (:func:`train.export.target.staged_export`)."""
    export_cfg: ExportConfig = OmegaConf.to_object(cfg.export)
    model_overrides = command_line_model_overrides(cfg, override_args, runtime)
    moe_overrides = command_line_moe_overrides(cfg, override_args, runtime)
    source = resolve_source(cfg, model_overrides, moe_overrides)
    validate_export_config(export_cfg, source.model_config.max_position_embeddings)
    adapter, model_type = _adapter_of(cfg, source)
    if export_cfg.format == "mindir" and moe_overrides.get("dispatch", "dropless") not in ("dropless", "auto"):
        raise ValueError(
            f"moe.dispatch={moe_overrides['dispatch']!r}: exported graphs always use dropless "
            "dispatch (under a capacity a token's logits would depend on the rest of the batch)"
        )
    target = export_target(cfg, export_cfg, source, adapter, run_dir)
    with staged_export(target) as staging:
        if export_cfg.format == "hf":
            notes = write_hf_export(source, model_overrides, adapter, model_type, staging)
        else:
            notes = write_mindir_export(source, model_overrides, adapter, model_type, export_cfg, staging)
    for note in notes:
        log.info("note: %s", note)
    return target.out


def write_hf_export(source: ExportSource, model_overrides: dict, adapter, model_type: str, out: Path) -> list:
    """``export.format=hf`` into the (empty) directory ``out``, as the architecture ``model_type`` (a HF
    source's own, so a ``glm4_moe_lite`` stays one; "": the first that reproduces the model, and an error
    naming every architecture's reasons if none does); returns the notes."""
    if source.kind == "checkpoint" and adapter is None:
        return export_hf_with_tokenizer(source.path, out, source.model_config, source.tokenizer, model_type)
    model = build_serving_model(source, model_overrides)
    model = merge_adapters(model, adapter, adapter_names_type(model.config, model_type))
    return export_hf_with_tokenizer(model, out, tokenizer_dir=source.tokenizer, model_type=model_type)


def write_mindir_export(
    source: ExportSource, model_overrides: dict, adapter, model_type: str, export_cfg: ExportConfig, out: Path
) -> list:
    """``export.format=mindir`` into the (empty) directory ``out``: graphs, tokenizer, manifest, converter
    files; returns the notes."""
    from mindmoe.model.export.mindir import export_mindir
    from mindmoe.model.export.mla_serving import serving_dsa_stage
    from mindmoe.train.export.convert import write_conversion_files

    ms.set_context(mode=ms.GRAPH_MODE)
    configure_host_runtime()
    model = build_serving_model(source, model_overrides)
    model = merge_adapters(model, adapter, adapter_names_type(model.config, model_type))
    graphs = export_mindir(model, out, export_cfg.dtype)
    tokenizer_files = copy_tokenizer(source.tokenizer, out)
    manifest = build_manifest(source, model.config, export_cfg, graphs, tokenizer_files, serving_dsa_stage(model))
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    write_conversion_files(out, manifest, export_cfg)
    return source.notes
