"""Run metrics: ``metrics.jsonl`` + TensorBoard, model FLOPs and MFU.

Training rows carry ``loss``; validation rows carry ``val_loss`` and never ``loss``, so a
plot of ``loss`` is never a mix of the two. Every line is strict JSON: a non-finite value is written
as ``null`` and the row lists the keys that had one in ``nonfinite`` (``"nonfinite": ["loss"]``).
A resumed run first drops the rows past the step it resumes from, which it writes again.
"""

import json
import logging
import math
import os
import time
from math import prod
from pathlib import Path

import numpy as np
from mindspore import Tensor, ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe.layer import LAYER_STATS

log = logging.getLogger("mindmoe.train")

METRICS_FILE = "metrics.jsonl"
#: Where a resumed run moves the rows past its checkpoint's step (appended, never overwritten).
ABANDONED_FILE = "metrics.abandoned.jsonl"
#: The key of a row that lists its keys whose value (or an element of it) was NaN or infinite.
NONFINITE_KEY = "nonfinite"


def strict_row(row: dict) -> dict:
    """``row`` with each non-finite float (also inside a list) as None, and :data:`NONFINITE_KEY` naming them."""
    clean, nonfinite = {}, []
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            clean[key] = None
            nonfinite.append(key)
        elif isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
            clean[key] = [None if isinstance(v, float) and not math.isfinite(v) else v for v in value]
            nonfinite.append(key)
        else:
            clean[key] = value
    if nonfinite:
        clean[NONFINITE_KEY] = sorted(nonfinite)
    return clean


def truncate_rows(path: Path, last_step: int) -> int:
    """Move the rows of ``path`` past ``last_step`` to :data:`ABANDONED_FILE` (``path`` rewritten atomically);
    the number moved.

    A run that crashed after logging steps its last checkpoint does not hold is resumed from that
    checkpoint and logs those steps again; without this they would appear twice. A torn last line
    (a kill mid-write) is dropped too."""
    if not path.is_file():
        return 0
    kept, dropped = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            step = None  # torn or foreign: not a row
        (kept if isinstance(step, int) and step <= last_step else dropped).append(line)
    if dropped:
        # Nothing is lost: the rows of the abandoned steps move to a sibling file, oldest first.
        abandoned = path.with_name(ABANDONED_FILE)
        with open(abandoned, "a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in dropped))
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
        log.info(
            "%s: moved %d rows past step %d, the step this run resumes from, to %s",
            path,
            len(dropped),
            last_step,
            abandoned.name,
        )
    return len(dropped)


class MetricsWriter:
    """Appends one JSON object per row to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    ``resumed_step``: the step the run starts after (0 for a fresh run); rows past it are dropped first.
    """

    def __init__(self, run_dir: Path, resumed_step: int = 0):
        from tensorboardX import SummaryWriter

        self.path = Path(run_dir) / METRICS_FILE
        truncate_rows(self.path, resumed_step)
        self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, row: dict) -> None:
        line = json.dumps(strict_row(row), sort_keys=True, allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
        # TensorBoard plots NaN and inf as such: it gets the values as measured.
        step = row["step"]
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self.tensorboard.add_scalar(key, value, step)
            elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
                for index, item in enumerate(value):
                    self.tensorboard.add_scalar(f"{key}/{index}", item, step)
        self.tensorboard.flush()

    def image(self, tag: str, rgb, step: int) -> None:
        self.tensorboard.add_image(tag, rgb, step, dataformats="HWC")
        self.tensorboard.flush()

    def close(self) -> None:
        self.tensorboard.close()


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights a token multiplies through: attention, FFN (k routed + shared experts), router, LM head.

    The input embedding is a lookup, not a matmul, so it is excluded.
    """
    head_dim = cfg.resolved_head_dim
    attention = cfg.hidden_size * head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    dense_ffn = 3 * cfg.hidden_size * cfg.intermediate_size
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    moe_ffn = expert * (cfg.top_k + cfg.num_shared_experts) + cfg.hidden_size * cfg.num_experts
    return (
        cfg.num_layers * attention
        + cfg.first_k_dense * dense_ffn
        + cfg.num_moe_layers * moe_ffn
        + cfg.vocab_size * cfg.hidden_size
    )


def train_flops_per_token(cfg: ModelConfig, seq_len: int, params=None) -> float:
    """Training FLOPs per token: the weight matmuls + ``6 * layers * seq_len * heads * head_dim``.

    A token multiplied through a weight with ``n`` elements costs ``2 n`` forward and ``2 n`` for
    the gradient of the weight's input; the weight's own gradient costs another ``2 n`` only when
    it trains. ``params`` is ``{name: (shape, trained)}`` of the model (e.g. from :func:`param_table`);
    None = every parameter of ``cfg`` trains, i.e. ``6 * active_matmul_params``. A LoRA run counts
    4 per frozen base weight element and 6 per adapter element.

    The second term is causal attention: QK^T and PV cost 2*S*d each per token forward,
    halved by the causal mask, times 3 for forward + backward (no weights: only input gradients).
    """
    attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * cfg.resolved_head_dim
    if params is None:
        return 6.0 * active_matmul_params(cfg) + attention
    weights = 0.0
    for name, (shape, trained) in params.items():
        weights += (4 + 2 * bool(trained)) * _active_matmul_elements(cfg, name, shape)
    return weights + attention


def param_table(model) -> dict:
    """``{name: (shape, trained)}`` of ``model``'s parameters, for :func:`train_flops_per_token`."""
    return {p.name: (tuple(p.shape), bool(p.requires_grad)) for p in model.get_parameters()}


def _active_matmul_elements(cfg: ModelConfig, name: str, shape) -> float:
    """Elements of parameter ``name`` one token multiplies through (0 for lookups, norms, biases)."""
    if name.endswith((".bias", "norm.weight", "e_score_correction_bias")):
        return 0.0
    if name == "embed_tokens.weight":
        # A lookup; it is the LM head's matmul only when tied.
        return float(prod(shape)) if cfg.tie_word_embeddings else 0.0
    if ".mlp.experts." in name:
        # Stacked routed experts (and their adapters) lead with the experts this process holds;
        # a token passes through top_k of them.
        return prod(shape) / shape[0] * cfg.top_k
    return float(prod(shape))


def measure_peak_gflops(size: int = 1024, repeats: int = 8, trials: int = 3) -> float:
    """Achieved fp32 GFLOP/s of a square MatMul here: the practical ceiling MFU is measured against.

    The best of ``trials`` timings: one ~0.1 s timing caught by a moment of load from another
    process read low, and the MFU of a run against it came out above 1."""
    a = Tensor(np.random.default_rng(0).standard_normal((size, size)).astype(np.float32))
    matmul = ops.MatMul()
    matmul(a, a).asnumpy()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            out = matmul(a, a)
        out.asnumpy()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 * repeats / best / 1e9


def load_imbalance(counts_LE: np.ndarray) -> list:
    """``max_load / mean_load`` per MoE layer (1.0 = perfectly balanced)."""
    mean = counts_LE.mean(-1)
    return [float(m) for m in np.where(mean > 0, counts_LE.max(-1) / np.maximum(mean, 1e-12), 1.0)]


def window_row(
    step: int,
    window: list,
    seconds: float,
    tokens_per_step: int,
    flops_per_token: float,
    peak_gflops: float,
    skipped_steps: int,
) -> dict:
    """One ``metrics.jsonl`` training row from the ``StepStats`` of the steps since the last row."""
    tokens_per_s = len(window) * tokens_per_step / max(seconds, 1e-9)
    routing_L3E = np.sum([s.routing_stats for s in window], axis=0)
    layer_means_L5 = np.mean([s.layer_stats for s in window], axis=0)
    row = {
        "step": step,
        "loss": float(np.mean([s.loss for s in window])),
        "lm_loss": float(np.mean([s.lm_loss for s in window])),
        "aux_loss": float(np.mean([s.aux_loss for s in window])),
        "z_loss": float(np.mean([s.z_loss for s in window])),
        "lr": window[-1].lr,
        "grad_norm": float(np.mean([s.grad_norm for s in window])),
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / (peak_gflops * 1e9),
        "skipped_steps": skipped_steps,
    }
    if window[-1].mtp_loss is not None:
        row["mtp_loss"] = float(np.mean([s.mtp_loss for s in window]))
    if window[-1].indexer_loss is not None:
        row["indexer_loss"] = float(np.mean([s.indexer_loss for s in window]))
    row.update(per_layer_metrics(routing_L3E, layer_means_L5))
    row["lock_rate"] = float(np.mean(row["layer_lock_rate"])) if row["layer_lock_rate"] else 0.0
    return row


def per_layer_metrics(routing_L3E: np.ndarray, layer_means_L5: np.ndarray) -> dict:
    """Lists with one entry per MoE layer, as they appear in metrics.jsonl."""
    if len(routing_L3E) == 0:
        return {
            key: []
            for key in (
                "load_imbalance",
                "dropped_assignments",
                "layer_lock_rate",
                "layer_flip_rate",
                "layer_aux_loss",
                "layer_z_loss",
            )
        }
    chosen_LE, kept_LE = routing_L3E[:, 0], routing_L3E[:, 1]
    column = {name: layer_means_L5[:, LAYER_STATS.index(name)] for name in LAYER_STATS}
    return {
        "load_imbalance": load_imbalance(chosen_LE),
        # (token, chosen expert) pairs over capacity: a token keeps its other top_k choices.
        "dropped_assignments": [float(d) for d in chosen_LE.sum(-1) - kept_LE.sum(-1)],
        "layer_lock_rate": [float(v) for v in column["lock_rate"]],
        "layer_flip_rate": [float(v) for v in column["flip_rate"]],
        "layer_aux_loss": [float(v) for v in column["aux_loss"]],
        "layer_z_loss": [float(v) for v in column["z_loss"]],
    }
