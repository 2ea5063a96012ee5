"""Masks the attention kernels build from document ids, shared by every device's implementation.

Shape legend (docs/architecture.md): B batch, S positions (queries and keys, training).
"""

import mindspore as ms
from mindspore import ops


def document_discard_mask(doc_ids_BS):
    """``[B, 1, S, S]`` bool, True where query i must not see key j (another document, or j > i): the
    ``attn_mask`` of FlashAttentionScore (1 = discard), one byte per pair, shared by every head."""
    positions_S = ops.arange(doc_ids_BS.shape[1], dtype=ms.int32)
    future_SS = positions_S.expand_dims(0) > positions_S.expand_dims(1)
    other_doc_BSS = ops.not_equal(doc_ids_BS.expand_dims(2), doc_ids_BS.expand_dims(1))
    return ops.stop_gradient(ops.logical_or(other_doc_BSS, future_SS)).expand_dims(1)
