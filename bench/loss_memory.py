"""How many chunk-sized buffers the LM loss holds at once: ``python bench/loss_memory.py [--tokens 2048]
[--vocab 8192] [--hidden 512] [--rows 1024]``.

One compiled forward and backward of :class:`model.lm_loss.TokenNLL` (head trained) in this process, which does
nothing else: its peak RSS above the RSS before the first call, less the tensors that are not the loss's chunk
buffers (the rows, the head, their gradients and the gradients the forward keeps: ``4 (2 T h + 3 V h)`` bytes),
over the bytes of one chunk's ``[rows, V]`` fp32 logits. The planner's ``LOSS_BUFFERS``
(launch/plan_activations.py) is this figure. Prints one JSON object.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindmoe.bench.peak_memory import own_peak_rss  # noqa: E402

GIB = 2**30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=1024, help="tokens per chunk")
    args = parser.parse_args(argv)

    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    from mindmoe.model.kernels.host_runtime import configure_host_runtime
    from mindmoe.model.lm_loss import TokenNLL

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    configure_host_runtime("CPU")
    rng = np.random.default_rng(0)
    x_TH = Tensor(rng.standard_normal((args.tokens, args.hidden)).astype(np.float32))
    head_VH = Tensor(rng.standard_normal((args.vocab, args.hidden)).astype(np.float32) * 0.02)
    labels_T = Tensor(rng.integers(0, args.vocab, args.tokens).astype(np.int32))
    weight_T = Tensor(np.full(args.tokens, 1.0 / args.tokens, np.float32))
    cell = TokenNLL(args.rows)

    def loss(x, head):
        return cell(x, head, labels_T, weight_T)[0]

    grad_fn = ms.jit(ms.value_and_grad(loss, (0, 1)))
    before = own_peak_rss()
    start = time.perf_counter()
    value, (dx, dhead) = grad_fn(x_TH, head_VH)
    dx.asnumpy()
    growth = own_peak_rss() - before
    fixed = 4 * (2 * args.tokens * args.hidden + 3 * args.vocab * args.hidden)
    chunk = 4 * min(args.rows, args.tokens) * args.vocab
    row = {
        "case": "loss_memory",
        **vars(args),
        "loss": float(value.asnumpy()),
        "first_call_s": round(time.perf_counter() - start, 2),
        "peak_growth_gib": round(growth / GIB, 3),
        "fixed_gib": round(fixed / GIB, 3),
        "chunk_gib": round(chunk / GIB, 4),
        "chunk_buffers": round((growth - fixed) / chunk, 2),
    }
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
