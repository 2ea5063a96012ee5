"""Multi-token prediction (MTP, DeepSeek-V3 report arXiv 2412.19437 §2.2): ``model.mtp_layers`` extra depths.

Shape legend (docs/architecture.md): U MTP depths, B batch, S sequence, T tokens (B * S), H hidden size.

Depth k (1..U) at position i combines the previous depth's hidden state ``h^{k-1}_i`` (depth 0: the main
model's output after its final norm, the LM head's input) with the embedding of token ``t_{i+k}``:

    h'_i = eh_proj(concat(enorm(Emb(t_{i+k})), hnorm(h^{k-1}_i)))      # eh_proj: [H, 2H], no bias
    h^k  = one MoE decoder layer of h' (same causal, document-aware attention as the main layers)
    p(t_{i+k+1}) = softmax(shared_head.norm(h^k) @ W_head^T)           # the main model's LM head

The concatenation puts the **embedding first, the hidden state second**. The paper's equation (21) writes
``[RMSNorm(h); RMSNorm(Emb)]``, but the released weights are laid out the other way: vLLM
``model_executor/models/deepseek_mtp.py`` (``torch.cat([inputs_embeds, previous_hidden_states])``) and
Megatron-LM ``megatron/core/transformer/multi_token_prediction.py`` (``torch.cat((decoder_input,
hidden_states), -1)``) both concatenate embedding then hidden state, which is what makes the published
``eh_proj`` weights of DeepSeek-V3 (``model.layers.61``) and GLM-4.5 (``model.layers.92``) work. Both also feed
the main model's final-normed hidden state to depth 1 and pass each depth's block output, before
``shared_head.norm``, on to the next depth; this module does the same.

The embedding and the LM head are the main model's (the report: "shared"); HF checkpoints still store copies per
depth (``embed_tokens``, ``shared_head.head``), which the import checks against the main ones and the export
writes back (:mod:`model.hf.load`, :mod:`model.hf.export`).
"""

import mindspore as ms
import numpy as np
from mindspore import ops

from mindmoe.model.config import ModelConfig
from mindmoe.model.linear import Linear
from mindmoe.model.lora.layers import NO_LORA
from mindmoe.model.norm import RMSNorm


def mtp_layer_class(decoder_layer_cls):
    """The MTP depth built on ``decoder_layer_cls`` (``model.transformer.MoEDecoderLayer``).

    A subclass, not a wrapper, so the decoder block's parameters sit directly under ``mtp_layers.{k}.`` as HF's
    sit under ``model.layers.{L + k}.``, beside ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``.
    """

    class MTPLayer(decoder_layer_cls):
        """One MTP depth: ``construct(embedded_BSH, previous_BSH, cos, sin, mask, doc_ids_BS)`` ->
        ``(h^k [B, S, H] before shared_head.norm, aux)``, ``aux`` the decoder layer's (model/outputs.py)."""

        def __init__(
            self,
            cfg: ModelConfig,
            layer_idx: int,
            rng: np.random.Generator,
            expert_dispatcher=None,
            lora=NO_LORA,
            moe=None,
            dsa_stage: str = "sparse",
        ):
            super().__init__(
                cfg, layer_idx, rng, expert_dispatcher=expert_dispatcher, lora=lora, moe=moe, dsa_stage=dsa_stage
            )
            hidden = cfg.hidden_size
            self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.eh_proj = Linear(2 * hidden, hidden, False, cfg.initializer_range, rng)
            self.shared_head = SharedHeadNorm(hidden, cfg.rms_norm_eps)

        def construct(self, embedded_BSH, previous_BSH, cos, sin, mask, doc_ids_BS):
            joined_BSH = ops.concat((self.enorm(embedded_BSH), self.hnorm(previous_BSH)), -1)
            return super().construct(self.eh_proj(joined_BSH), cos, sin, mask, doc_ids_BS)

    MTPLayer.__name__ = MTPLayer.__qualname__ = "MTP" + decoder_layer_cls.__name__
    return MTPLayer


class SharedHeadNorm(ms.nn.Cell):
    """``shared_head.norm``: the depth's own final norm before the shared LM head (HF name ``shared_head.norm``)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)

    def construct(self, x):
        return self.norm(x)


def shifted_tokens(tokens: np.ndarray, depths: int) -> np.ndarray:
    """``[U + 1, B, S]`` int32 from packed ``[B, S + 1]`` windows: row j holds ``t_{i+j+1}`` at position i (0 past
    the window's end). Row 0 is the labels; depth k reads its input tokens from row k-1 and its targets from row k."""
    batch, window = tokens.shape
    seq_len = window - 1
    out = np.zeros((depths + 1, batch, seq_len), np.int32)
    for shift in range(depths + 1):
        out[shift, :, : seq_len - shift] = tokens[:, 1 + shift :]
    return out


def mtp_loss_mask(label_mask_BS: np.ndarray, doc_ids: np.ndarray, depths: int) -> np.ndarray:
    """``[U, B, S]`` int32: 1 where depth k's target ``t_{i+k+1}`` is scored.

    ``label_mask_BS`` is the main loss's mask (label ``t_{i+1}`` scored: same document as ``t_i``; SFT: an
    assistant token) and ``doc_ids`` the window's ``[B, S + 1]`` document ids. Depth k's target at i is the main
    label at ``i + k``, so it counts when that label counts and ``t_{i+k}`` is in ``t_i``'s document (documents
    are contiguous, so then every token in between is too). A target in another document or past the window's
    end contributes nothing.
    """
    batch, seq_len = label_mask_BS.shape
    out = np.zeros((depths, batch, seq_len), np.int32)
    for depth in range(1, depths + 1):
        valid = seq_len - depth
        if valid <= 0:
            continue
        same_doc = doc_ids[:, depth : depth + valid] == doc_ids[:, :valid]
        out[depth - 1, :, :valid] = label_mask_BS[:, depth:] * same_doc
    return out
