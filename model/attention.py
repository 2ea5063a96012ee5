"""Grouped-query causal self-attention with document-aware masking.

Shape legend (docs/architecture.md): B batch, S sequence (queries), P key positions (S in training,
cached + new when decoding), Q queries of one block, H hidden, N query heads, G key/value heads, D head_dim.
Packed sequences carry ``doc_ids [B, S]``; a token attends only to earlier tokens of the
same document, so packing never leaks context across documents.
"""

import math

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindmoe.model import kernels
from mindmoe.model.config import ModelConfig
from mindmoe.model.lora.layers import NO_LORA, AdapterScope, projection
from mindmoe.model.norm import RMSNorm
from mindmoe.model.rope import apply_rope

# Large negative instead of -inf: a fully masked row would otherwise give NaN in softmax.
MASK_VALUE = -1e9

#: Positions per block of the blockwise training attention (``kernels.blockwise_attention``); sequences
#: of at most this length keep the full-mask path (see :func:`training_attention_masks`).
BLOCK_SIZE = 512
#: Device targets whose training forward runs blockwise attention past BLOCK_SIZE. Not CPU: there the
#: kernel now reuses its block buffers and skips the blocks of other documents, but in the default
#: training run it saved no memory (peak RSS at 2048 and 4096 positions equal to the full-mask path's
#: or above) and it ran at 0.9x (2048) and 0.6x (4096) the full-mask path's tokens/s.
BLOCKWISE_DEVICES = ("Ascend",)


def document_causal_mask(doc_ids_BS, num_heads: int = 1, chunks: int = 1):
    """Additive mask ``[B, num_heads, S, S]``: 0 where key j <= query i and both are in one document.

    The model builds it once per forward with every query head's copy (``num_heads``): adding a
    mask of the scores' own shape ran about 3x faster on CPU than broadcasting one over the heads,
    and every layer adds it. With ``chunks`` > 1 (see :func:`causal_chunks`) it is a tuple instead:
    chunk c's queries ``[c S/chunks, (c+1) S/chunks)`` against the keys ``[0, (c+1) S/chunks)`` they
    can see, ``[B, num_heads, S/chunks, (c+1) S/chunks]`` each."""
    seq_len = doc_ids_BS.shape[1]
    if chunks == 1:
        return _document_causal_mask(doc_ids_BS, doc_ids_BS, 0, num_heads)
    size = seq_len // chunks
    return tuple(
        _document_causal_mask(
            doc_ids_BS[:, c * size : (c + 1) * size], doc_ids_BS[:, : (c + 1) * size], c * size, num_heads
        )
        for c in range(chunks)
    )


def _document_causal_mask(query_doc_ids_BQ, key_doc_ids_BP, offset: int, num_heads: int):
    """``[B, num_heads, Q, P]`` mask of queries at positions ``offset + i`` against keys at ``j``."""
    query_pos_Q1 = (ops.arange(query_doc_ids_BQ.shape[1], dtype=ms.int32) + offset).expand_dims(1)
    causal_QP = ops.arange(key_doc_ids_BP.shape[1], dtype=ms.int32).expand_dims(0) <= query_pos_Q1
    same_doc_BQP = ops.equal(query_doc_ids_BQ.expand_dims(2), key_doc_ids_BP.expand_dims(1))
    allowed_BQP = ops.logical_and(same_doc_BQP, causal_QP)
    mask_BQP = ops.select(
        allowed_BQP, ops.zeros_like(same_doc_BQP, dtype=ms.float32), ops.fill(ms.float32, allowed_BQP.shape, MASK_VALUE)
    )
    mask_B1QP = ops.stop_gradient(mask_BQP).expand_dims(1)
    if num_heads == 1:
        return mask_B1QP
    return ops.tile(mask_B1QP, (1, num_heads, 1, 1))


def training_attention_masks(doc_ids_BS, num_heads: int, blockwise: bool, chunked: bool = True):
    """What a training forward passes every layer's :meth:`Attention.attend` as ``mask``: the document ids
    ``[B, S]`` themselves when ``blockwise`` (:attr:`Attention.use_blockwise`) and ``S > BLOCK_SIZE``
    (blockwise attention builds each block's mask and keeps no ``[S, S]`` tensor), else the full mask, in
    :func:`causal_chunks` chunks (faster at short lengths) when ``chunked`` (DSA's layers take it whole)."""
    seq_len = doc_ids_BS.shape[1]
    if blockwise and seq_len > BLOCK_SIZE:
        return doc_ids_BS
    return document_causal_mask(doc_ids_BS, num_heads, causal_chunks(seq_len) if chunked else 1)


def causal_chunks(seq_len: int) -> int:
    """Query chunks a training sequence's causal attention is computed in (1, 2 or 4).

    Chunk c attends only to the keys before its end, which skips the fully masked blocks above the
    diagonal: 4 chunks compute 10/16 of the score matrix, 2 chunks 3/4. Chunks keep at least 128
    queries so the BatchMatMuls stay large."""
    for chunks in (4, 2):
        if seq_len % chunks == 0 and seq_len // chunks >= 128:
            return chunks
    return 1


def query_chunks(q_BNSD, chunks: int):
    """The queries of :func:`causal_chunks` chunks, ``[B, N, S / chunks, D]`` each: one split, not a slice per chunk.
    The gradient of a split is one concat; each slice's is a zero-filled ``[B, N, S, D]`` tensor, and the chunks' are
    then added (13.7 + 5.4 ms per step of the dense benchmark model on CPU, profiled)."""
    return ops.split(q_BNSD, q_BNSD.shape[2] // chunks, 2)


class AttentionHeads(nn.Cell):
    """What every attention variant shares once it has its queries, keys and values: the document-causal
    softmax over the heads (full mask, causal chunks or blockwise) and ``o_proj``.

    A subclass sets ``o_proj`` and implements ``project_qkv``; ``num_kv_heads`` = ``num_heads`` is plain
    multi-head attention (MLA). Values may be narrower than queries/keys (MLA's ``v_head_dim``).
    """

    #: True where the layer runs DSA's indexer (model/mla.py): its blocks then also return the indexer's loss.
    dsa_active = False

    def __init__(self, num_heads: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.core = kernels.attention_core(scale)
        self.blockwise = kernels.blockwise_attention(scale, BLOCK_SIZE)
        self.use_blockwise = ms.get_context("device_target") in BLOCKWISE_DEVICES

    def construct(self, x_BSH, cos, sin, mask):
        q_BNSD, k_BGSD, v_BGSD = self.project_qkv(x_BSH, cos, sin)
        return self.attend(q_BNSD, k_BGSD, v_BGSD, mask)

    def attend(self, q_BNSD, k_BGPD, v_BGPD, mask):
        """``softmax(q k^T / sqrt(D) + mask) v`` projected back to ``[B, S, H]``; P keys (P = S in training,
        cached + new ones when decoding). ``mask`` is ``[B, N, S, P]``, per query head or shared (its
        second axis 1), the causal chunks of :func:`document_causal_mask` (training, P = S), or the
        document ids ``[B, S]`` for blockwise attention (training, P = S; :func:`training_attention_masks`)."""
        batch, _, seq_len, _ = q_BNSD.shape
        if not isinstance(mask, tuple) and mask.ndim == 2:
            out_BNSD = self._blockwise(q_BNSD, k_BGPD, v_BGPD, mask)
        elif isinstance(mask, tuple):
            chunks = len(mask)
            size = seq_len // chunks
            q_chunks = query_chunks(q_BNSD, chunks)
            outs = []
            for c, mask_c in enumerate(mask):
                keys = (c + 1) * size
                # The last chunk sees every key: MindSpore 2.9's CPU StridedSlice ran a full-range
                # slice ~50x slower than a partial one, so it is not sliced at all.
                k_c = k_BGPD if c == chunks - 1 else k_BGPD[:, :, :keys]
                v_c = v_BGPD if c == chunks - 1 else v_BGPD[:, :, :keys]
                outs.append(self._attend_heads(q_chunks[c], k_c, v_c, mask_c))
            out_BNSD = ops.concat(outs, 2)
        else:
            out_BNSD = self._attend_heads(q_BNSD, k_BGPD, v_BGPD, mask)
        out_BSH = out_BNSD.transpose(0, 2, 1, 3).reshape(batch, seq_len, self.num_heads * out_BNSD.shape[-1])
        return self.o_proj(out_BSH)

    def _blockwise(self, q_BNSD, k_BGSD, v_BGSD, doc_ids_BS):
        """Blockwise attention; values narrower than the keys (MLA) are zero-padded to their width and the
        padding cut from the output, as the blockwise kernels (and FlashAttentionScore) take one head dim."""
        pad = q_BNSD.shape[-1] - v_BGSD.shape[-1]
        if pad == 0:
            return self.blockwise(q_BNSD, k_BGSD, v_BGSD, doc_ids_BS)
        zeros_BGSD = ops.zeros(v_BGSD.shape[:-1] + (pad,), v_BGSD.dtype)
        out_BNSD = self.blockwise(q_BNSD, k_BGSD, ops.concat((v_BGSD, zeros_BGSD), -1), doc_ids_BS)
        return out_BNSD[..., : v_BGSD.shape[-1]]

    def _attend_heads(self, q_BNSD, k_BGPD, v_BGPD, mask_BNSP):
        """``[B, N, S, D]`` attention output of every query head (``mask_BNSP`` may have one head)."""
        batch, _, seq_len, head_dim = q_BNSD.shape
        num_keys = k_BGPD.shape[2]
        group = self.num_heads // self.num_kv_heads
        if mask_BNSP.shape[1] != self.num_heads:
            mask_BNSP = ops.tile(mask_BNSP, (1, self.num_heads, 1, 1))
        # Query head n uses key/value head n // group (HF repeat_kv order), so [B, N, S, D] is
        # [B, G, group * S, D] without moving data.
        rows = group * seq_len
        out_BGQD, _ = self.core(
            q_BNSD.reshape(batch, self.num_kv_heads, rows, head_dim),
            k_BGPD,
            v_BGPD,
            mask_BNSP.reshape(batch, self.num_kv_heads, rows, num_keys),
        )
        return out_BGQD.reshape(batch, self.num_heads, seq_len, v_BGPD.shape[-1])


class Attention(AttentionHeads):
    """q/k/v projections (optional bias) -> optional QK RMSNorm -> partial RoPE -> softmax(qk/sqrt(D)) v."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, lora: AdapterScope = NO_LORA):
        head_dim = cfg.resolved_head_dim
        super().__init__(cfg.num_heads, cfg.num_kv_heads, 1.0 / math.sqrt(head_dim))
        self.head_dim = head_dim
        self.interleaved = cfg.rope_interleaved
        std = cfg.initializer_range
        q_out, kv_out = cfg.num_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        self.q_proj = projection(cfg.hidden_size, q_out, cfg.qkv_bias, std, rng, lora, "q_proj")
        self.k_proj = projection(cfg.hidden_size, kv_out, cfg.qkv_bias, std, rng, lora, "k_proj")
        self.v_proj = projection(cfg.hidden_size, kv_out, cfg.qkv_bias, std, rng, lora, "v_proj")
        self.o_proj = projection(q_out, cfg.hidden_size, False, std, rng, lora, "o_proj")
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotate = kernels.rope(cfg.rope_interleaved)

    def project_qkv(self, x_BSH, cos, sin):
        """Queries ``[B, N, S, D]`` and keys/values ``[B, G, S, D]`` after QK-norm and RoPE (what a KV cache holds)."""
        batch, seq_len, _ = x_BSH.shape
        q_BNSD = self.q_proj(x_BSH).reshape(batch, seq_len, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k_BGSD = self.k_proj(x_BSH).reshape(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v_BGSD = self.v_proj(x_BSH).reshape(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q_BNSD = self.q_norm(q_BNSD)
            k_BGSD = self.k_norm(k_BGSD)
        q_BNSD = apply_rope(q_BNSD, cos, sin, self.interleaved, self.rotate)
        k_BGSD = apply_rope(k_BGSD, cos, sin, self.interleaved, self.rotate)
        return q_BNSD, k_BGSD, v_BGSD
