"""Ascend implementation of the ``blockwise_attention`` kernel: FlashAttentionScore, the op call and nothing
else (its mask comes from :mod:`~.attention_masks`, shared code). Shape legend as in :mod:`~.cpu_attention`."""

from mindspore import nn, ops

from mindmoe.model.kernels.attention_masks import document_discard_mask


class AscendFlashAttention(nn.Cell):
    """``ops.flash_attention_score`` in the BNSD layout (its backward is MindSpore's; it saves only the
    row statistics and recomputes the probabilities, like the CPU kernel).

    Document masking: a boolean ``attn_mask [B, 1, S, S]`` (True = discard) with ``sparse_mode=0``.
    The packed-document layout ``TND`` with ``actual_seq_qlen`` would skip the other documents' blocks,
    but it takes every row's document lengths as a list whose length is the number of documents
    (data-dependent, and no zero lengths), which a graph compiled for static shapes cannot give.
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
            sparse_mode=0,
        )
