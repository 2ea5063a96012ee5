"""The benchmark models in PyTorch (CPU, fp32): what a user would otherwise run.

Same architecture, batch and optimizer as the mindmoe train step: GQA attention with q/k/v bias,
QK-norm, partial rotate-half RoPE and a document-causal mask; SwiGLU FFN or 8 experts with
softmax top-2 routing (renormalised), a switch aux loss and a router z-loss; masked next-token
cross-entropy; global-norm clipping; ``torch.optim.AdamW``. The experts run the usual eager way
(HF Mixtral style): a loop over experts, each on the tokens routed to it.

Two variants are timed (:func:`best_torch_step` picks the second on the machine):

- **eager**: the model written plainly: attention as ``softmax(q k^T + mask) v`` with repeated k/v,
  ``torch.optim.AdamW`` with its defaults (the per-parameter loop on CPU).
- **best**: what a good PyTorch engineer runs on CPU: ``F.scaled_dot_product_attention`` with the
  document-causal boolean mask and grouped k/v, ``AdamW(fused=True)`` or ``foreach=True`` (whichever
  is faster here), and the loss ``torch.compile``-d when that is faster than eager here.

Shape legend: B batch, S sequence, H hidden, N query heads, G kv heads, D head dim, T tokens, E experts, K top-k.
"""

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mindmoe.bench.specs import BENCH_MOE, BenchSize, model_config


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, hidden, width):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class Attention(nn.Module):
    def __init__(self, cfg, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x_BSH, cos_SR, sin_SR, mask_B1SS):
        batch, seq_len, _ = x_BSH.shape
        q = self.q_norm(self.q_proj(x_BSH).view(batch, seq_len, self.heads, self.head_dim).transpose(1, 2))
        k = self.k_norm(self.k_proj(x_BSH).view(batch, seq_len, self.kv_heads, self.head_dim).transpose(1, 2))
        v = self.v_proj(x_BSH).view(batch, seq_len, self.kv_heads, self.head_dim).transpose(1, 2)
        rot = cos_SR.shape[-1]
        q = torch.cat((q[..., :rot] * cos_SR + rotate_half(q[..., :rot]) * sin_SR, q[..., rot:]), -1)
        k = torch.cat((k[..., :rot] * cos_SR + rotate_half(k[..., :rot]) * sin_SR, k[..., rot:]), -1)
        if self.sdpa:
            # mask_B1SS is boolean here (True = may attend); k/v heads are shared by their query group.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS, enable_gqa=True)
        else:
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + mask_B1SS
            out = torch.softmax(scores, -1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.num_experts = cfg.top_k, cfg.num_experts
        self.aux_coeff, self.z_coeff = BENCH_MOE.aux_loss_coeff, BENCH_MOE.z_loss_coeff
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x_BSH):
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        logits_TE = self.gate(x_TH)
        probs_TE = torch.softmax(logits_TE, -1)
        weight_TK, idx_TK = torch.topk(probs_TE, self.top_k, -1)
        weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True)
        out_TH = torch.zeros_like(x_TH)
        for expert_id, expert in enumerate(self.experts):
            token_idx, choice = torch.where(idx_TK == expert_id)
            if token_idx.numel():
                y = expert(x_TH[token_idx]) * weight_TK[token_idx, choice, None]
                out_TH = out_TH.index_add(0, token_idx, y)
        counts_E = F.one_hot(idx_TK, self.num_experts).sum((0, 1)).float()
        aux = self.aux_coeff * self.num_experts * (counts_E / idx_TK.numel() * probs_TE.mean(0)).sum()
        z = self.z_coeff * torch.logsumexp(logits_TE, -1).pow(2).mean()
        return out_TH.view_as(x_BSH), aux + z


class Layer(nn.Module):
    def __init__(self, cfg, moe, sdpa):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, sdpa)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = moe
        self.mlp = MoE(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        if self.moe:
            ffn, router_loss = self.mlp(self.post_attention_layernorm(x))
            return x + ffn, router_loss
        return x + self.mlp(self.post_attention_layernorm(x)), x.new_zeros(())


class Transformer(nn.Module):
    def __init__(self, cfg, sdpa: bool = False):
        super().__init__()
        self.sdpa = sdpa
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i >= cfg.first_k_dense, sdpa) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float64) / cfg.rotary_dim)
        self.inv_freq = inv_freq
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=cfg.initializer_range)

    def forward(self, input_ids_BS, doc_ids_BS):
        seq_len = input_ids_BS.shape[1]
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), self.inv_freq)
        angles = torch.cat((angles, angles), -1)
        cos, sin = angles.cos().float(), angles.sin().float()
        allowed = (doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :]) & torch.ones(
            seq_len, seq_len, dtype=torch.bool
        ).tril()
        mask = allowed[:, None] if self.sdpa else torch.where(allowed, 0.0, -1e9)[:, None]
        x = self.embed_tokens(input_ids_BS)
        router_loss = x.new_zeros(())
        for layer in self.layers:
            x, layer_loss = layer(x, cos, sin, mask)
            router_loss = router_loss + layer_loss
        return self.lm_head(self.norm(x)), router_loss


#: AdamW implementations: ``loop`` is the default on CPU tensors (one parameter at a time).
OPTIMIZERS = {"loop": {}, "fused": {"fused": True}, "foreach": {"foreach": True}}


class TorchTrainStep:
    """One optimizer step of the PyTorch model per call, on the windows of :func:`bench.cases.random_windows`.

    ``sdpa``: attention by ``F.scaled_dot_product_attention``; ``optimizer``: a key of
    :data:`OPTIMIZERS`; ``compiled``: forward + loss through ``torch.compile`` (backward by AOTAutograd).
    """

    def __init__(self, size: BenchSize, kind: str, sdpa: bool = False, optimizer: str = "loop", compiled=False):
        torch.manual_seed(0)
        self.model = Transformer(model_config(size, kind), sdpa=sdpa)
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
            ],
            lr=3e-4,
            betas=(0.9, 0.95),
            eps=1e-8,
            **OPTIMIZERS[optimizer],
        )
        self.params = sum(p.numel() for p in params)
        self.variant = {"attention": "sdpa" if sdpa else "matmul-softmax", "optimizer": optimizer, "compiled": compiled}
        self.loss_fn = torch.compile(self.loss) if compiled else self.loss

    def loss(self, tokens_BW, doc_ids_BW):
        """Masked next-token cross-entropy + router losses of ``[B, S + 1]`` windows."""
        logits, router_loss = self.model(tokens_BW[:, :-1], doc_ids_BW[:, :-1])
        mask = (doc_ids_BW[:, 1:] == doc_ids_BW[:, :-1]).float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens_BW[:, 1:].reshape(-1), reduction="none")
        return (nll * mask.reshape(-1)).sum() / mask.sum().clamp(min=1.0) + router_loss

    def __call__(self, window: dict) -> float:
        """The loss of the step on ``window`` (``input_ids``/``doc_ids`` ``[B, S + 1]``)."""
        tokens, doc_ids = torch.from_numpy(window["input_ids"]).long(), torch.from_numpy(window["doc_ids"])
        loss = self.loss_fn(tokens, doc_ids)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        value = loss.item()
        if not math.isfinite(value):
            raise RuntimeError(f"PyTorch reference step produced loss {value}")
        return value


def _alternated_step_s(steps: dict, warmup: list, timed: list) -> dict:
    """``{name: median step s}`` of ``steps`` run in turn on each window, so all see the same load."""
    for window in warmup:
        for step in steps.values():
            step(window)
    timings = {name: [] for name in steps}
    for window in timed:
        for name, step in steps.items():
            start = time.perf_counter()
            step(window)
            timings[name].append(time.perf_counter() - start)
    return {name: float(np.median(values)) for name, values in timings.items()}


def best_torch_step(size: BenchSize, kind: str, warmup: list, timed: list) -> tuple:
    """``(step, choice)``: the fastest PyTorch variant here, and how it was chosen (timings in s).

    SDPA attention always; AdamW ``fused`` vs ``foreach`` by their median step time on ``timed``
    (after ``warmup``, steps alternated); then that step eager vs under ``torch.compile`` (its first
    call compiles), compiled kept only when faster. A compile that fails is reported, eager is used.
    """
    optimizers = {name: TorchTrainStep(size, kind, True, name) for name in ("fused", "foreach")}
    choice = {"optimizer_step_s": _alternated_step_s(optimizers, warmup, timed)}
    optimizer = min(choice["optimizer_step_s"], key=choice["optimizer_step_s"].get)
    best = optimizers.pop(optimizer)
    optimizers.clear()
    try:
        compiled = TorchTrainStep(size, kind, True, optimizer, compiled=True)
        start = time.perf_counter()
        compiled(warmup[0])
        choice["compile_s"] = time.perf_counter() - start
        race = _alternated_step_s({"eager": best, "compiled": compiled}, warmup[1:], timed)
    except Exception as error:  # noqa: BLE001  (any failure of torch.compile means: run eager)
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__
        choice["torch_compile"] = f"fails here ({reason}): eager"
    else:
        choice["eager_step_s"], choice["compiled_step_s"] = race["eager"], race["compiled"]
        faster = race["compiled"] < race["eager"]
        choice["torch_compile"] = (
            f"{'faster' if faster else 'slower'} than eager ({race['compiled']:.3g} vs {race['eager']:.3g} s"
            f" per step): {'compiled' if faster else 'eager'}"
        )
        if faster:
            best = compiled
    choice.update(best.variant)
    return best, choice
