"""Run metrics: ``metrics.jsonl`` + TensorBoard, model FLOPs and MFU.

Training rows carry ``loss``; validation rows carry ``val_loss`` and never ``loss``, so a
plot of ``loss`` is never a mix of the two.
"""
import json
import time
from pathlib import Path

import numpy as np
from mindspore import Tensor, ops


from model.config import ModelConfig


class MetricsWriter:
    """Appends one JSON object per row to ``metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, row: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
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
    return (cfg.num_layers * attention + cfg.first_k_dense * dense_ffn + cfg.num_moe_layers * moe_ffn
            + cfg.vocab_size * cfg.hidden_size)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """``6 * active matmul params + 6 * layers * seq_len * heads * head_dim``.

    The second term is causal attention: QK^T and PV cost 2*S*d each per token forward,
    halved by the causal mask, times 3 for forward + backward.
    """
    attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * cfg.resolved_head_dim
    return 6.0 * active_matmul_params(cfg) + attention


def measure_peak_gflops(size: int = 1024, repeats: int = 8) -> float:
    """Achieved fp32 GFLOP/s of a square MatMul here: the practical ceiling MFU is measured against."""
    a = Tensor(np.random.default_rng(0).standard_normal((size, size)).astype(np.float32))
    matmul = ops.MatMul()
    matmul(a, a).asnumpy()
    start = time.perf_counter()
    for _ in range(repeats):
        out = matmul(a, a)
    out.asnumpy()
    elapsed = time.perf_counter() - start
    return 2.0 * size ** 3 * repeats / elapsed / 1e9


def load_imbalance(counts_LE: np.ndarray) -> list:
    """``max_load / mean_load`` per MoE layer (1.0 = perfectly balanced)."""
    mean = counts_LE.mean(-1)
    return [float(m) for m in np.where(mean > 0, counts_LE.max(-1) / np.maximum(mean, 1e-12), 1.0)]


