"""Activation bytes of ``mindmoe-plan``: what one token of a micro-batch leaves alive until its backward.

The formulas, and which tensors each term is, are in :mod:`launch.plan`'s module docstring; this module
computes them. ``setup`` is a :class:`launch.plan.Setup` and ``layout`` a :class:`launch.plan.Layout` (only
their ``compute_bytes`` / ``blockwise`` and ``routed`` / ``ep`` are read, so nothing is imported from there).
"""

from mindmoe.model.config import ModelConfig
from mindmoe.model.moe_config import MoEConfig

#: model/lm_loss.py CHUNK_BYTES (copied so that a plan imports no MindSpore; tests/unit/test_plan.py checks it).
LOSS_CHUNK_BYTES = 32 * 2**20
#: Chunk-sized buffers the chunked loss holds at once (model/lm_loss.py): 4.3-6.5 measured on CPU by
#: ``python bench/loss_memory.py`` (2,048-8,192 tokens, V = 4,096-8,192, 1-4 chunks), rounded up.
LOSS_BUFFERS = 7
#: model/attention.py BLOCK_SIZE (copied for the same reason; launch/plan.py takes it from here).
BLOCK_SIZE = 512
#: fp32 ``[micro_batch, BLOCK_SIZE, s]`` tensors per head that the ``indexed_attention`` kernel's backward holds at
#: once for its last block of queries (model/kernels/cpu_dsa.py): per attention head the probabilities, their
#: gradient and the scores' gradient; per indexer head the ReLU'd products, their weighted gradient, the ReLU's
#: mask and the products' gradient.
DSA_BLOCK_TENSORS = (3, 4)


def routed_rows_per_token(cfg: ModelConfig, layout, moe: MoEConfig) -> float:
    """Expert input rows per token of this rank's micro-batch under policy ``moe`` (module docstring)."""
    if not moe.dropless:
        return cfg.top_k * moe.capacity_factor
    if layout.routed:
        return layout.ep * min(cfg.top_k, cfg.num_experts // layout.ep)
    return cfg.top_k


def dsa_active(cfg: ModelConfig, setup) -> bool:
    """The DSA indexer runs (model/mla.py): the model has one and ``dsa.stage`` is not off."""
    return cfg.attention_type == "mla" and cfg.dsa.enabled and setup.dsa_stage != "off"


def dsa_blockwise(cfg: ModelConfig, seq_len: int, setup) -> bool:
    """DSA layers run the ``indexed_attention`` kernel (on every device, past ``BLOCK_SIZE`` positions)."""
    return dsa_active(cfg, setup) and seq_len > BLOCK_SIZE


def full_mask(cfg: ModelConfig, seq_len: int, setup) -> bool:
    """The attention keeps its softmax and the model one fp32 mask: no blockwise kernel for this length."""
    if dsa_active(cfg, setup):
        return not dsa_blockwise(cfg, seq_len, setup)
    return not setup.blockwise(seq_len)


def scores_bytes_per_token(cfg: ModelConfig, seq_len: int, setup) -> float:
    """What the attention keeps of its scores: the softmax on the full-mask path; blockwise the fp32 log-sum-exp per
    head (FlashAttentionScore), nothing with DSA (its kernel's backward recomputes each block's softmax)."""
    if full_mask(cfg, seq_len, setup):
        return setup.compute_bytes * cfg.num_heads * seq_len
    return 0 if dsa_active(cfg, setup) else 4 * cfg.num_heads


def gqa_attention_bytes_per_token(cfg: ModelConfig, c: int) -> float:
    """GQA: ``c (2h + 2q + 2kv)``, ``+ c (q + kv)`` with QK-norm."""
    head_dim = cfg.resolved_head_dim
    q_width, kv_width = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    kept = 2 * cfg.hidden_size + 2 * q_width + 2 * kv_width
    if cfg.qk_norm:
        kept += q_width + kv_width
    return c * kept


def mla_attention_bytes_per_token(cfg: ModelConfig, c: int) -> float:
    """MLA: ``c (2h + 2 r_q + 2 r_kv + 2 a d_qk + 2 a d_v)`` (``r_q`` 0 without ``q_lora_rank``)."""
    heads = cfg.num_heads
    q_latent = 2 * (cfg.q_lora_rank or 0)
    kv_latent = 2 * cfg.kv_lora_rank
    per_head = 2 * heads * cfg.qk_head_dim + 2 * heads * cfg.v_head_dim
    return c * (2 * cfg.hidden_size + q_latent + kv_latent + per_head)


def dsa_indexer_bytes_per_token(cfg: ModelConfig, seq_len: int, setup) -> float:
    """The DSA lightning indexer of one MLA layer (``model.dsa``; 0 without one or with ``dsa.stage=off``).

    Its query ``n_I d_I``, its key before the LayerNorm and after the LayerNorm and RoPE ``2 d_I``, the head
    weights ``n_I`` (``c`` bytes each), the ReLU'd query-key products of every indexer head ``4 n_I s`` (fp32;
    the head-weighted sum's backward reads them), and three fp32 rows over the ``s`` keys: the index scores,
    the selection mask and the indexer's softmax kept by the KL loss (both training stages run it). The
    ``indexed_attention`` kernel keeps none of the rows or products (its backward recomputes them per block).
    """
    if not dsa_active(cfg, setup):
        return 0
    c, dsa = setup.compute_bytes, cfg.dsa
    vectors = dsa.index_n_heads * dsa.index_head_dim + 2 * dsa.index_head_dim + dsa.index_n_heads
    if dsa_blockwise(cfg, seq_len, setup):
        return c * vectors
    products = 4 * dsa.index_n_heads * seq_len
    scores, selection, kl_softmax = 4 * seq_len, 4 * seq_len, 4 * seq_len
    return c * vectors + products + scores + selection + kl_softmax


def dsa_block_bytes(cfg: ModelConfig, batch, setup) -> float:
    """What the ``indexed_attention`` kernel's backward holds for one block of queries (``DSA_BLOCK_TENSORS``), once
    per micro-batch: one layer's backward runs at a time."""
    if not dsa_blockwise(cfg, batch.seq_len, setup):
        return 0
    per_head, per_indexer_head = DSA_BLOCK_TENSORS
    heads = per_head * cfg.num_heads + per_indexer_head * cfg.dsa.index_n_heads
    return 4 * batch.micro_batch * BLOCK_SIZE * batch.seq_len * heads


def attention_bytes_per_token(cfg: ModelConfig, seq_len: int, setup) -> float:
    """The attention block of one layer: its widths (GQA or MLA), its scores, the DSA indexer."""
    c = setup.compute_bytes
    if cfg.attention_type == "mla":
        widths = mla_attention_bytes_per_token(cfg, c) + dsa_indexer_bytes_per_token(cfg, seq_len, setup)
    else:
        widths = gqa_attention_bytes_per_token(cfg, c)
    return widths + scores_bytes_per_token(cfg, seq_len, setup)


def activation_bytes_per_token(cfg: ModelConfig, moe: bool, seq_len: int, setup, rows: float) -> float:
    """Bytes one token leaves alive in one decoder layer until its backward (module docstring)."""
    c, hidden = setup.compute_bytes, cfg.hidden_size
    attention = attention_bytes_per_token(cfg, seq_len, setup)
    if not moe:
        return attention + c * (2 * hidden + 3 * cfg.intermediate_size)
    shared_width = cfg.num_shared_experts * cfg.moe_intermediate_size
    router = 8 * cfg.num_experts
    experts = rows * c * (2 * hidden + 3 * cfg.moe_intermediate_size)
    return attention + c * 2 * hidden + router + experts + 3 * c * shared_width


def mtp_bytes_per_token(cfg: ModelConfig, seq_len: int, setup, rows: float) -> float:
    """The ``model.mtp_layers`` depths, never recomputed: each its MoE layer plus ``5 c h`` (the embedding
    enorm reads, the ``[2h]`` eh_proj input, the block output, the depth's loss input), and once ``c h`` (the
    main model's final-normed rows, depth 1's hnorm input)."""
    if not cfg.mtp_layers:
        return 0
    c, hidden = setup.compute_bytes, cfg.hidden_size
    depth = activation_bytes_per_token(cfg, True, seq_len, setup, rows) + c * (hidden + 2 * hidden + hidden + hidden)
    return cfg.mtp_layers * depth + c * hidden


def loss_bytes(cfg: ModelConfig, tokens: int, head_trained: bool) -> float:
    """The chunked losses (the main one and one per MTP depth, one after another): one set of chunk buffers
    plus what each keeps for the backward, the gradients it computed in the forward: its rows' ``4 h`` per token
    and, when the head trains, the head's ``4 V h``; over several chunks also the head gradient's running sum
    (``2 x 4 V h``: at V = 151,552 the loss of 1,024 tokens grew by 5 head-sized tensors, bench/loss_memory.py)."""
    rows = max(1, LOSS_CHUNK_BYTES // (4 * cfg.vocab_size))
    head = 4 * cfg.vocab_size * cfg.hidden_size * int(head_trained)
    kept = 4 * cfg.hidden_size * tokens + head
    # Over several chunks the head's gradient is a loop-carried sum: the running sum and the next one.
    accumulator = 2 * head if tokens > rows else 0
    return LOSS_BUFFERS * 4 * cfg.vocab_size * min(tokens, rows) + (1 + cfg.mtp_layers) * kept + accumulator


def activation_memory(cfg: ModelConfig, layout, batch, setup) -> float:
    """Activations of one micro-batch of ``batch.tokens`` tokens on one rank (module docstring)."""
    c, tokens = setup.compute_bytes, batch.tokens
    rows = routed_rows_per_token(cfg, layout, setup.moe)
    per_layer = [
        activation_bytes_per_token(cfg, layer >= cfg.first_k_dense, batch.seq_len, setup, rows)
        for layer in range(cfg.num_layers)
    ]
    if cfg.mtp_layers:  # an MTP block's activations can be the largest layer's (a model without main MoE layers)
        per_layer.append(activation_bytes_per_token(cfg, True, batch.seq_len, setup, rows))
    main = per_layer[: cfg.num_layers]
    largest = max(per_layer, default=0)
    rebuilt = max(main, default=0)  # train.recompute rebuilds the main layers only (train/precision.py)
    kept = cfg.num_layers * c * cfg.hidden_size + rebuilt if layout.recompute else sum(main)
    mask = 4 * cfg.num_heads * batch.seq_len if full_mask(cfg, batch.seq_len, setup) else 0
    mtp = mtp_bytes_per_token(cfg, batch.seq_len, setup, rows)
    # + the backward's gradients of one layer's activations, + the final norm's input; + a DSA block's backward
    return tokens * (kept + mask + largest + c * cfg.hidden_size + mtp) + dsa_block_bytes(cfg, batch, setup)
