"""Where a LoRA step's memory goes in one GLM-4.5-Air-shaped routed-expert layer on CPU:
``python bench/lora_expert_memory.py [--tokens 768]``.

Each case runs in a fresh process: one ``LoraRoutedExperts.grouped`` forward and backward (gradients of the
input and of the adapters, as a LoRA step takes them) over the expert-sorted rows of ``--tokens`` tokens at
top-8 of 128 experts (hidden and expert width 512, fp16 frozen base, as ``bench/lora_ep_memory.py``'s
checkpoint), compiled and run twice, and reports the peak RSS growth over the RSS after building the layer
(``VmHWM``: :mod:`bench.peak_memory`; compilation included). Cases, each adding one thing to the one before:

- ``base``: the frozen experts alone (grouped matmuls without weight gradients);
- ``adapters``: rank-8 adapters on gate, up and down (no dropout);
- ``dropout``: adapter dropout 0.05 (``model/lora/dropout.py``'s hashed masks);
- ``base_weight_grad``: as ``dropout``, but the frozen weights' grouped matmuls computing their unused
  weight gradient (what every LoRA step paid before ``grouped_matmul(weight_grad=False)``).

Prints one JSON line per case and a summary JSON object as its last line. Not part of the test suite.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindmoe.bench.peak_memory import current_rss, own_peak_rss  # noqa: E402

CASES = ("base", "adapters", "dropout", "base_weight_grad")
EXPERTS, HIDDEN, WIDTH, TOP_K, RANK = 128, 512, 512, 8, 8


def measure_case(case: str, tokens: int) -> dict:
    """One forward and backward of the case's layer, twice; the peak RSS growth over the built layer's RSS."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    from mindmoe.model.kernels import grouped_alignment
    from mindmoe.model.kernels.host_runtime import configure_host_runtime
    from mindmoe.model.lora.layers import AdapterSpec
    from mindmoe.model.moe.experts import RoutedExperts
    from mindmoe.model.moe.lora_experts import LoraRoutedExperts

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    configure_host_runtime("CPU")
    projections = ("gate_proj", "up_proj", "down_proj")
    frozen = () if case == "base_weight_grad" else projections
    dtypes = {p: ms.float16 for p in projections}
    rng = np.random.default_rng(0)
    if case == "base":
        layer = RoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.02, rng, None, dtypes, frozen)
    else:
        spec = AdapterSpec(RANK, 2.0, 0.0 if case == "adapters" else 0.05, np.random.default_rng(1))
        layer = LoraRoutedExperts(EXPERTS, HIDDEN, WIDTH, 0.02, rng, projections, spec, None, "experts", dtypes, frozen)
    for proj in projections:
        getattr(layer, proj).requires_grad = False
    layer.set_train(True)
    block = grouped_alignment()(tokens * TOP_K, EXPERTS)
    per_expert = -(-tokens * TOP_K // EXPERTS // block) * block  # every expert the mean load, whole blocks
    sizes = Tensor(np.full(EXPERTS, per_expert, np.int32))
    rows = per_expert * EXPERTS
    x_NbH = Tensor(rng.normal(size=(rows // block, block, HIDDEN)).astype(np.float32))
    params = layer.trainable_params()

    def loss(x):
        return layer(x, sizes).sum()

    step = ms.jit(ms.value_and_grad(loss, 0, params or None))
    before = current_rss()
    step(x_NbH)
    step(x_NbH)
    peak = own_peak_rss()
    return {
        "case": case,
        "rows": rows,
        "growth_gib": round((peak - before) / 2**30, 3),
        "peak_gib": round(peak / 2**30, 3),
    }


def run_case(case: str, tokens: int) -> dict:
    """:func:`measure_case` in a fresh process (each case's peak is its own)."""
    child = subprocess.run(
        [sys.executable, __file__, "--child", case, "--tokens", str(tokens)], capture_output=True, text=True, cwd=ROOT
    )
    if child.returncode != 0:
        sys.exit(f"{case}: exit {child.returncode}: {child.stderr.strip().splitlines()[-1:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=768, help="tokens routed (lora_ep_memory: 2 x 384)")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_case(args.child, args.tokens)))
        return
    rows = {}
    for case in CASES:
        rows[case] = run_case(case, args.tokens)
        print(json.dumps(rows[case]), flush=True)
    growth = {case: row["growth_gib"] for case, row in rows.items()}
    print(
        json.dumps(
            {
                "case": "lora_expert_memory",
                "tokens": args.tokens,
                "rows": rows["base"]["rows"],
                "growth_gib": growth,
                "adapters_add_gib": round(growth["adapters"] - growth["base"], 3),
                "dropout_adds_gib": round(growth["dropout"] - growth["adapters"], 3),
                "base_weight_grad_adds_gib": round(growth["base_weight_grad"] - growth["dropout"], 3),
                "peak_rss_gib": max(row["peak_gib"] for row in rows.values()),
            }
        )
    )


if __name__ == "__main__":
    main()
