"""Memory and time of DeepSeek Sparse Attention's training step on its two paths on CPU:
``python bench/dsa_memory.py [--seq 4096] [--batch 1]``.

Each case runs in a fresh process: a two-layer GLM-5-shaped model (MLA with query compression, a lightning indexer
of 8 heads keeping 256 keys, the second layer MoE) takes a forward and backward of ``sum(logits) / T + indexer
loss`` over ``--seq`` positions of four packed documents, compiled and run three times; it reports the peak RSS
growth over the RSS after building the model (``VmHWM``: :mod:`bench.peak_memory`; compilation included) and
the last step's time.

- ``full``: the whole ``[B, N, S, S]`` document mask, the indexer's ``[B, S, S]`` scores and the attention's
  probabilities kept for the backward (what every DSA layer ran before the ``indexed_attention`` kernel);
- ``blockwise``: the ``indexed_attention`` kernel (model/kernels/cpu_dsa.py) in blocks of
  ``model.attention.BLOCK_SIZE`` queries, recomputing each block in the backward.

Prints one JSON line per case and a summary JSON object as its last line. Not part of the test suite.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindmoe.bench.peak_memory import current_rss, own_peak_rss  # noqa: E402

CASES = ("full", "blockwise")


def model_config(topk: int):
    from mindmoe.model.config import ModelConfig

    return ModelConfig(
        vocab_size=512,
        hidden_size=256,
        num_layers=2,
        num_heads=8,
        attention_type="mla",
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_interleaved=True,
        first_k_dense=1,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=128,
        intermediate_size=512,
        dsa=dict(index_n_heads=8, index_head_dim=32, index_topk=topk),
    )


def measure_case(case: str, seq_len: int, batch: int) -> dict:
    """Three compiled forward-backward steps of the case's path; peak RSS growth over the built model's RSS."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    from mindmoe.model import attention
    from mindmoe.model.kernels.host_runtime import configure_host_runtime
    from mindmoe.model.moe_config import MoEConfig
    from mindmoe.model.outputs import OUT_HEAD, OUT_INDEXER_LOSS
    from mindmoe.model.transformer import MoETransformer

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    configure_host_runtime("CPU")
    model = MoETransformer(model_config(256), moe=MoEConfig(dispatch="dropless"))
    if case == "full":  # no sequence is past the block size: every DSA layer takes the whole mask
        attention.BLOCK_SIZE = seq_len
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, 512, size=(batch, seq_len)).astype(np.int32))
    doc_ids = Tensor(np.repeat(np.arange(4), seq_len // 4)[None].repeat(batch, 0).astype(np.int32))
    params = model.trainable_params()

    def loss(input_ids, doc_ids_BS):
        outs = model(input_ids, doc_ids_BS)
        return outs[OUT_HEAD].mean() + outs[OUT_INDEXER_LOSS]

    step = ms.jit(ms.value_and_grad(loss, None, params))
    before = current_rss()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        value, _ = step(ids, doc_ids)
        value.asnumpy()
        times.append(time.perf_counter() - start)
    peak = own_peak_rss()
    return {
        "case": case,
        "seq": seq_len,
        "batch": batch,
        "growth_gib": round((peak - before) / 2**30, 3),
        "step_s": round(times[-1], 3),
        "loss": round(float(value.asnumpy()), 6),
    }


def run_case(case: str, seq_len: int, batch: int) -> dict:
    """:func:`measure_case` in a fresh process (each case's peak is its own)."""
    command = [sys.executable, __file__, "--child", case, "--seq", str(seq_len), "--batch", str(batch)]
    child = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if child.returncode != 0:
        sys.exit(f"{case}: exit {child.returncode}: {child.stderr.strip().splitlines()[-3:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="positions per sequence (a multiple of 4)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_case(args.child, args.seq, args.batch)))
        return
    rows = {}
    for case in args.cases.split(","):
        rows[case] = run_case(case, args.seq, args.batch)
        print(json.dumps(rows[case]), flush=True)
    if set(rows) != set(CASES):
        return
    full, blockwise = rows["full"], rows["blockwise"]
    print(
        json.dumps(
            {
                "case": "dsa_memory",
                "seq": args.seq,
                "batch": args.batch,
                "growth_gib": {case: row["growth_gib"] for case, row in rows.items()},
                "memory_ratio": round(blockwise["growth_gib"] / full["growth_gib"], 3),
                "time_ratio": round(blockwise["step_s"] / full["step_s"], 3),
                "loss_difference": abs(blockwise["loss"] - full["loss"]),
            }
        )
    )


if __name__ == "__main__":
    main()
