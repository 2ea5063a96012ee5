"""The token embedding table, also the LM head's weight (``tie_word_embeddings``, or ``lm_head`` of the same class).

Shape legend (docs/architecture.md): V vocabulary, H hidden size, B batch, S sequence.
"""

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

from mindmoe.model.linear import normal_init
from mindmoe.model.weights import add_seams


class Embedding(nn.Cell):
    """``[V, H]`` rows; stored in ``dtype`` (a half frozen base, ``lora.base_dtype``), gathered rows are fp32."""

    def __init__(self, vocab_size: int, hidden_size: int, std: float, rng: np.random.Generator, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(normal_init((vocab_size, hidden_size), std, rng, dtype), name="weight")
        self.half_weight = dtype != ms.float32
        # CPU has no bf16 Gather kernel: there the table is up-cast first (a transient fp32 copy).
        self.cast_first = dtype == ms.bfloat16 and ms.get_context("device_target") == "CPU"
        add_seams(self, "weight")

    def table(self):
        """The ``[V, H]`` table as the forward reads it (model/weights.py)."""
        return self.weight_full(self.weight)

    def construct(self, input_ids_BS):
        if self.cast_first:
            return ops.gather(self.table().astype(ms.float32), input_ids_BS, 0)
        rows_BSH = ops.gather(self.table(), input_ids_BS, 0)
        return rows_BSH.astype(ms.float32) if self.half_weight else rows_BSH
