"""Ascend implementation of the ``blockwise_attention`` kernel: FlashAttentionScore, the op call and nothing
else (its mask comes from :mod:`~.attention_masks`, shared code). Shape legend as in :mod:`~.cpu_attention`."""

from mindspore import nn, ops

from mindmoe.model.kernels.attention_masks import document_discard_mask


class AscendFlashAttention(nn.Cell):
    """``ops.flash_attention_score`` in the BNSD layout (its backward is MindSpore's; it saves only the
    row statistics and recomputes the probabilities, like the CPU kernel).

    Document masking: a boolean ``attn_mask [B, 1, S, S]`` (True = discard) with ``sparse_mode=0``, and
    ``next_tokens=0``: in that mode the op computes only the band between ``pre_tokens`` and
    ``next_tokens`` of the mask, so the blocks entirely in the future are skipped (as on CPU); the mask
    discards them anyway, so the result is the same.

    Blocks entirely in another document are not expressed to the op. The only way is the packed layout
    ``TND`` with ``actual_seq_qlen``/``actual_seq_kvlen``: the cumulative document lengths of the whole
    batch, one entry per document, none of length 0. Their number changes from batch to batch, while
    this graph is compiled for static shapes (a new count would mean a new shape, recompiled), and a
    fixed-size list cannot be padded (a zero length is refused; splitting a document would change the
    attention). The other sparse modes (2-4: causal or band) take a fixed 2048 x 2048 mask, no documents.
    FlashAttentionScore maps query head n to key/value head n // (N / G) as the CPU kernel does, and
    takes fp16/bf16 q/k/v only (``train.dtype=bf16`` or ``fp16``). ``block_size`` is the op's own."""

    def __init__(self, scale: float, block_size: int):
        super().__init__()
        self.scale = scale

    def construct(self, q_BNSD, k_BGSD, v_BGSD, doc_ids_BS):
        return ops.flash_attention_score(
            q_BNSD,
            k_BGSD,
            v_BGSD,
            q_BNSD.shape[1],
            attn_mask=document_discard_mask(doc_ids_BS),
            scalar_value=self.scale,
            input_layout="BNSD",
            next_tokens=0,
            sparse_mode=0,
        )
