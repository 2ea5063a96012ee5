"""Long-context evaluation: validation loss of one checkpoint at several context lengths, per RoPE scaling.

For each context length L the validation files are packed with the checkpoint's tokenizer into
windows of L + 1 tokens (``prepare_data`` with ``data.seq_len = L``, cached per L). Every scaling
type is measured on exactly those windows: a model is built from the checkpoint's config with only
``rope_scaling``, ``max_position_embeddings`` (raised to L if shorter; the tables have no weights)
and ``dispatch`` changed, the checkpoint's weights are loaded, and the mean NLL per scored token is
taken. Scored tokens are those training scores: the label is in the same document as its input.

Scaling: ``factor`` = ``eval.factor``, or L / trained length per column when it is 0, for every type
but none; dynamic_ntk and yarn get ``original_max_position`` = the trained length.

Attention: by default a token attends only to its own document, as in training, so the context a
token sees reaches beyond the trained length only inside documents longer than it. Every cell also
reports the loss over just those tokens ("beyond"): input offset >= trained length from the start of
the span it can attend to (its document inside the window; the window with ``eval.cross_document``,
where attention crosses documents so positions really reach L).

Cost: each (type, length) pair is its own graph (the RoPE tables are graph constants and the shapes
differ per length), so it is compiled once: on a shared 2-core CPU about 20-40 s per pair for the
tiny model, more than the evaluation itself (15 pairs, 5 types x 3 lengths: 8-13 min). Activation memory
grows with ``batch_size * L^2`` (attention): about 1.3 GB per 2 windows of 1024 tokens for the tiny model.
Graphs are freed after each pair (``train.graph_memory.release_compiled_graphs``: every compiled graph of the
process).
"""

import dataclasses
import logging
import math
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor
from omegaconf import OmegaConf

from mindmoe.data.mindrecord import EvalLoader
from mindmoe.data.prepare import prepare_data
from mindmoe.model.checkpoints.files import checkpoint_dsa_training, checkpoint_moe_config
from mindmoe.model.config import ModelConfig
from mindmoe.model.dsa_config import DSATrainingConfig
from mindmoe.model.kernels.host_runtime import configure_host_runtime
from mindmoe.model.moe_config import MoEConfig
from mindmoe.model.rope_scaling import RopeScalingConfig
from mindmoe.model.transformer import MoETransformer
from mindmoe.train.checkpoints.checkpoint import (
    CONFIG_FILE,
    checkpoint_model_config,
    load_model_weights,
    read_state,
    resolve_checkpoint,
    verify_checkpoint,
)
from mindmoe.train.checkpoints.tokenizer import checkpoint_tokenizer
from mindmoe.train.evaluation.config import EvalConfig, validate_eval_config
from mindmoe.train.graph_memory import release_compiled_graphs
from mindmoe.train.head_loss import head_loss, head_nll, masked_sum
from mindmoe.train.step import split_window

log = logging.getLogger("mindmoe.eval")

RUN_CONFIG_FILE = "resolved_config.yaml"


def resolve_trained_length(eval_cfg: EvalConfig, checkpoint_dir: Path) -> int:
    """``eval.trained_length``, else ``data.seq_len`` of the run that wrote ``checkpoint_dir`` (its
    ``config.yaml``; an older checkpoint carries none, then its run directory's)."""
    if eval_cfg.trained_length:
        return eval_cfg.trained_length
    run_config = checkpoint_dir / CONFIG_FILE
    if not run_config.is_file():
        run_config = checkpoint_dir.parent.parent / RUN_CONFIG_FILE
    if not run_config.is_file():
        raise ValueError(
            f"eval.trained_length=0: neither {checkpoint_dir / CONFIG_FILE} nor {run_config} found, so the "
            f"context length checkpoint "
            f"{checkpoint_dir} was trained at is unknown; set eval.trained_length=<data.seq_len "
            "of its training run>"
        )
    return int(OmegaConf.load(run_config).data.seq_len)


def column_factor(eval_cfg: EvalConfig, length: int, trained_length: int) -> float:
    return float(eval_cfg.factor) if eval_cfg.factor else max(1.0, length / trained_length)


def scaled_model_config(
    model_cfg: ModelConfig, scaling_type: str, factor: float, trained_length: int, length: int
) -> ModelConfig:
    """The checkpoint's config with RoPE scaling ``scaling_type`` for windows of ``length`` tokens."""
    if scaling_type == "none":
        scaling = RopeScalingConfig()
    else:
        uses_original = scaling_type in ("dynamic_ntk", "yarn")
        scaling = RopeScalingConfig(
            type=scaling_type, factor=factor, original_max_position=trained_length if uses_original else 0
        )
    return dataclasses.replace(
        model_cfg,
        rope_scaling=scaling,
        max_position_embeddings=max(model_cfg.max_position_embeddings, length),
    )


def context_offsets(doc_ids_BS: np.ndarray, cross_document: bool) -> np.ndarray:
    """Per input token, how many earlier tokens it can attend to (its offset in its attention span)."""
    batch, seq_len = doc_ids_BS.shape
    index_S = np.arange(seq_len)
    if cross_document:
        return np.broadcast_to(index_S, (batch, seq_len)).copy()
    starts_BS = np.diff(doc_ids_BS, axis=1, prepend=doc_ids_BS[:, :1] - 1) != 0
    return index_S - np.maximum.accumulate(np.where(starts_BS, index_S, 0), axis=1)


def length_windows(cfg, tokenizer_path: str, length: int, eval_cfg: EvalConfig):
    """``(batches, prepared, windows)``: the validation windows of ``length + 1`` tokens in batches (the last
    one filled with unscored padding windows), the ``prepare_data`` result, and the real windows used."""
    data_cfg = dataclasses.replace(OmegaConf.to_object(cfg.data), seq_len=length, tokenizer=tokenizer_path)
    prepared = prepare_data(data_cfg)
    max_batches = math.ceil(eval_cfg.max_windows / eval_cfg.batch_size) if eval_cfg.max_windows else 0
    loader = EvalLoader(prepared.valid_shards, eval_cfg.batch_size, max_batches=max_batches)
    return list(loader), prepared, loader.evaluated_windows


def nll_function(model):
    """Compiled ``(sum nll, scored tokens, sum nll beyond, tokens beyond)`` of one batch: both sums from one
    pass of the head, chunked over tokens (:func:`train.head_loss.head_loss`)."""
    token_nll = head_loss(model)

    @ms.jit
    def nll_sums(input_ids, doc_ids, labels, loss_mask, beyond_mask):
        _, nll_T, _ = head_nll(model, token_nll, input_ids, doc_ids, labels, loss_mask)
        nll_all, count_all = masked_sum(nll_T, loss_mask)
        nll_beyond, count_beyond = masked_sum(nll_T, loss_mask * beyond_mask)
        return nll_all, count_all, nll_beyond, count_beyond

    return nll_sums


def evaluate_model(model, batches, trained_length: int, cross_document: bool) -> dict:
    """Mean NLL over the scored tokens of ``batches``, and over those whose context exceeds the trained length."""
    nll_sums = nll_function(model)
    totals = np.zeros(4, np.float64)
    for batch in batches:
        input_ids, doc_ids, labels, loss_mask = split_window(batch)
        input_doc_ids = batch["doc_ids"][:, :-1]
        beyond = (context_offsets(input_doc_ids, cross_document) >= trained_length).astype(np.int32)
        if cross_document:
            doc_ids = Tensor(np.zeros_like(input_doc_ids, np.int32))
        outputs = nll_sums(input_ids, doc_ids, labels, loss_mask, Tensor(beyond))
        totals += [float(value.asnumpy()) for value in outputs]
    nll, tokens, nll_beyond, tokens_beyond = totals
    loss = nll / tokens if tokens else float("nan")
    loss_beyond = nll_beyond / tokens_beyond if tokens_beyond else None
    return {
        "loss": loss,
        "ppl": math.exp(loss),
        "scored_tokens": int(tokens),
        "loss_beyond": loss_beyond,
        "ppl_beyond": None if loss_beyond is None else math.exp(loss_beyond),
        "beyond_tokens": int(tokens_beyond),
    }


def load_checkpoint_config(checkpoint: str, data_tokenizer: str = ""):
    """``(checkpoint_dir, state, model_config, tokenizer)``; fails naming ``checkpoint`` when it is unusable.

    The tokenizer is the one the checkpoint carries (``data_tokenizer``, i.e. ``data.tokenizer``, only for
    an older checkpoint that carries none)."""
    if not checkpoint:
        raise ValueError("checkpoint is not set: pass checkpoint=<run dir>/checkpoints/step_NNNNNN")
    checkpoint_dir = resolve_checkpoint(checkpoint)
    verify_checkpoint(checkpoint_dir)
    state = read_state(checkpoint_dir)
    try:
        model_cfg = checkpoint_model_config(checkpoint_dir)
        tokenizer = checkpoint_tokenizer(checkpoint_dir, data_tokenizer)
    except ValueError as err:
        raise ValueError(f"checkpoint {checkpoint_dir}: {err}") from None
    if tokenizer is None:
        raise ValueError(f"checkpoint {checkpoint_dir}: state.json names no 'tokenizer'; pass data.tokenizer")
    if model_cfg.rope_scaling.type != "none":
        raise ValueError(
            f"checkpoint {checkpoint_dir} was trained with model.rope_scaling.type="
            f"{model_cfg.rope_scaling.type!r}; mindmoe-eval compares scalings of a model trained "
            "with plain RoPE (type none)"
        )
    return checkpoint_dir, state, model_cfg, str(tokenizer)


def evaluate_checkpoint(cfg) -> dict:
    """The long-context report of ``cfg.checkpoint`` (see :mod:`train.evaluation.report` for its tables)."""
    eval_cfg = OmegaConf.to_object(cfg.eval)
    validate_eval_config(eval_cfg)
    checkpoint_dir, state, model_cfg, tokenizer_path = load_checkpoint_config(cfg.checkpoint, cfg.data.tokenizer)
    trained_length = resolve_trained_length(eval_cfg, checkpoint_dir)
    if not cfg.data.valid_files:
        raise ValueError("data.valid_files is empty: mindmoe-eval measures loss on validation text")
    ms.set_context(mode=ms.GRAPH_MODE)
    configure_host_runtime()
    # The policy the checkpoint trained with (its expert locking), with the dispatch eval.dispatch names.
    moe = dataclasses.replace(checkpoint_moe_config(checkpoint_dir), dispatch=eval_cfg.dispatch)
    dsa = checkpoint_dsa_training(checkpoint_dir)
    columns, rows = [], []
    for length in eval_cfg.context_lengths:
        batches, prepared, windows = length_windows(cfg, tokenizer_path, length, eval_cfg)
        if prepared.vocab_size > model_cfg.vocab_size:
            raise ValueError(
                f"tokenizer {prepared.tokenizer_path} has {prepared.vocab_size} pieces, more than the "
                f"checkpoint's model.vocab_size={model_cfg.vocab_size}; pass its own tokenizer"
            )
        factor = column_factor(eval_cfg, length, trained_length)
        columns.append(
            {
                "length": length,
                "factor": factor,
                "windows": windows,
                "unigram_loss": prepared.unigram_val_loss,
                "data_cache_key": prepared.cache_key,
            }
        )
        for scaling_type in eval_cfg.scaling_types:
            scaled = scaled_model_config(model_cfg, scaling_type, factor, trained_length, length)
            rows.append(
                evaluate_cell(
                    scaled, length, checkpoint_dir, batches, trained_length, eval_cfg.cross_document, moe, dsa
                )
            )
    return {
        "checkpoint": str(checkpoint_dir),
        "step": state.get("step"),
        "trained_length": trained_length,
        "attention": "cross_document" if eval_cfg.cross_document else "document",
        "dispatch": eval_cfg.dispatch,
        "factor": eval_cfg.factor,
        "batch_size": eval_cfg.batch_size,
        "columns": columns,
        "rows": rows,
    }


def evaluate_cell(
    scaled: ModelConfig,
    length: int,
    checkpoint_dir: Path,
    batches,
    trained_length: int,
    cross_document: bool,
    moe: MoEConfig = None,
    dsa: DSATrainingConfig = None,
) -> dict:
    """One table cell: the checkpoint's weights under the RoPE scaling of ``scaled``, on ``batches`` of
    windows of ``length`` tokens."""
    started = time.perf_counter()
    model = MoETransformer(scaled, seed=0, moe=moe, dsa=dsa)
    load_model_weights(list(model.get_parameters()), checkpoint_dir)
    cell = evaluate_model(model, batches, trained_length, cross_document)
    del model
    # A compiled graph keeps its activation memory until recycled (about 2.5 GB for the tiny
    # model at L=1024, batch 4), so without this 15 pairs grew to 20 GB. It frees every graph.
    release_compiled_graphs()
    scaling_type = scaled.rope_scaling.type
    cell.update(
        scaling=scaling_type,
        length=length,
        factor=scaled.rope_scaling.factor,
        seconds=round(time.perf_counter() - started, 1),
    )
    log.info(
        "L=%d %s (factor %g): loss %.4f, ppl %.2f, %d scored tokens, %.0f s (incl. compile)",
        length,
        scaling_type,
        cell["factor"],
        cell["loss"],
        cell["ppl"],
        cell["scored_tokens"],
        cell["seconds"],
    )
    return cell
