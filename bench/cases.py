"""The MindSpore side of the benchmark cases; each runs in its own process (see bench.__main__).

Every function returns a dict of raw measurements; ratios between cases (MFU against
gemm_peak, mindmoe/torch, MoE/dense) are formed by the parent from rows of the same run.
Shape legend: B micro-batch, S sequence, T = B*S tokens, H hidden, E experts, K top-k.
"""

import resource
import tempfile
import time

import numpy as np

from mindmoe.bench.peak_memory import current_rss, own_peak_rss
from mindmoe.bench.specs import BENCH_MOE, BenchSize, activation_bytes, model_config, theoretical_train_bytes


def _graph_mode():
    import mindspore as ms

    from mindmoe.model.kernels.host_runtime import configure_host_runtime

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    configure_host_runtime("CPU")
    return ms


def random_windows(size: BenchSize, batch: int, seed: int, docs_per_window: int = 4) -> dict:
    """Packed ``seq_len + 1`` windows of random tokens, each holding a few documents."""
    rng = np.random.default_rng(seed)
    window = size.seq_len + 1
    input_ids = rng.integers(0, size.vocab_size, size=(batch, window), dtype=np.int32)
    cuts = np.sort(rng.choice(np.arange(1, window), size=(batch, docs_per_window - 1)), axis=-1)
    doc_ids = (np.arange(window)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    return {"input_ids": input_ids, "doc_ids": doc_ids}


def gemm_peak(size: BenchSize, trials: int = 3, repeats: int = 8) -> dict:
    """Best of ``trials`` timings of ``repeats`` square fp32 MatMuls, in MindSpore, NumPy and torch."""
    _graph_mode()
    from mindmoe.train.metrics import measure_peak_gflops

    n = size.gemm_size
    mindspore_gflops = measure_peak_gflops(n, repeats, trials)
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)

    def best(fn):
        fn()
        timings = []
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            timings.append(time.perf_counter() - start)
        return 2.0 * n**3 * repeats / min(timings) / 1e9

    row = {"gflops": mindspore_gflops, "numpy_gflops": best(lambda: a @ a), "matrix_size": n}
    try:
        import torch

        t = torch.from_numpy(a)
        row["torch_gflops"] = best(lambda: t @ t)
    except ImportError:
        pass
    return row


def build_trainer(cfg, seed: int = 0, cell_reuse: bool = False):
    from mindmoe.model.transformer import MoETransformer
    from mindmoe.train.config import TrainConfig
    from mindmoe.train.optim import build_optimizer
    from mindmoe.train.step import CompiledStep

    model = MoETransformer(cfg, seed=seed, cell_reuse=cell_reuse, moe=BENCH_MOE)
    optimizer = build_optimizer(model.trainable_params(), TrainConfig(max_steps=1000, warmup_ratio=0.0))
    trainer = CompiledStep(model, optimizer, grad_clip=1.0, accum_steps=1)
    num_params = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    return trainer, num_params


def cpu_seconds() -> float:
    """CPU time of this process (all threads): less sensitive than wall time to other users' load."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn, *args) -> tuple:
    """``(wall seconds, CPU seconds)`` of ``fn(*args)``."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    fn(*args)
    return time.perf_counter() - wall, cpu_seconds() - cpu


def train_step(size: BenchSize, kind: str, micro_batch: int = 0, steps: int = 0, with_torch: bool = False) -> dict:
    """Tokens/s, compile time and peak RSS of the real train step (train.step.CompiledStep + train.optim).

    With ``with_torch`` the PyTorch baselines (bench.torch_reference) run in this process too: the
    best variant on this machine (chosen after mindmoe's warm-up steps) and the plain eager one,
    their steps alternating with mindmoe's on the same windows, so all see the same load; the peak
    RSS of mindmoe is read before PyTorch allocates anything.
    """
    _graph_mode()
    # MindSpore and mindmoe's optimizer module in the framework baseline; mindformers, which the optimizer imports
    # when it is built, counts above it (as launch/plan.py's CPU_OPTIMIZER_LIBRARY_BYTES does).
    import mindmoe.train.optim  # noqa: F401
    from mindmoe.train.metrics import active_matmul_params, measure_peak_gflops, train_flops_per_token

    framework_rss = current_rss()
    cfg = model_config(size, kind)
    batch = micro_batch or size.micro_batch
    trainer, num_params = build_trainer(cfg)
    steps = steps or size.timed_steps
    batches = [random_windows(size, batch, seed) for seed in range(size.warmup_steps + steps)]
    warmup, timed_windows = batches[: size.warmup_steps], batches[size.warmup_steps :]

    def mindmoe_step(window):
        stats = trainer.step([window])
        if not np.isfinite(stats.loss):
            raise RuntimeError(f"benchmark step produced loss {stats.loss}")

    first_s, _ = timed(mindmoe_step, batches[0])
    for window in warmup[1:]:
        mindmoe_step(window)
    torch_steps = {}
    if with_torch:
        peak_rss = own_peak_rss()
        torch_steps, choice = torch_baselines(size, kind, warmup, timed_windows)
    timings = []
    torch_timings = {name: [] for name in torch_steps}
    for window in timed_windows:
        timings.append(timed(mindmoe_step, window))
        for name, step in torch_steps.items():
            torch_timings[name].append(timed(step, window))
    if not with_torch:
        peak_rss = own_peak_rss()
    step_s, cpu_s = (float(np.median(column)) for column in zip(*timings))
    tokens = batch * size.seq_len
    row = {
        "model": kind,
        "micro_batch": batch,
        "seq_len": size.seq_len,
        "params": num_params,
        "active_matmul_params": active_matmul_params(cfg),
        "flops_per_token": train_flops_per_token(cfg, size.seq_len),
        "step_s": step_s,
        "step_s_all": [t for t, _ in timings],
        "cpu_s": cpu_s,
        "tokens_per_s": tokens / step_s,
        "tokens_per_cpu_s": tokens / cpu_s,
        "first_step_s": first_s,
        "compile_s": max(first_s - step_s, 0.0),
        "framework_rss": framework_rss,
        "mindmoe_peak_rss": peak_rss,
        "theoretical_bytes": theoretical_train_bytes(num_params),
        "activation_bytes": activation_bytes(cfg, batch, size.seq_len),
    }
    if kind == "moe":
        row["dispatch_s"] = dispatch_seconds(cfg, tokens) * cfg.num_moe_layers
    row["local_gflops"] = measure_peak_gflops(size.gemm_size)
    if torch_steps:
        row["torch"] = {
            name: torch_row(kind, torch_steps[name], torch_timings[name], tokens, choice if name == "best" else {})
            for name in torch_steps
        }
    return row


def torch_baselines(size: BenchSize, kind: str, warmup: list, timed_windows: list) -> tuple:
    """``({"best": step, "eager": step}, how best was chosen)``, both warmed up on ``warmup``."""
    from mindmoe.bench.torch_reference import TorchTrainStep, best_torch_step

    best, choice = best_torch_step(size, kind, warmup, timed_windows)
    eager = TorchTrainStep(size, kind)
    for window in warmup:
        eager(window)
    return {"best": best, "eager": eager}, choice


def torch_row(kind: str, step, timings: list, tokens: int, choice: dict) -> dict:
    torch_s, torch_cpu_s = (float(np.median(column)) for column in zip(*timings))
    return {
        "model": kind,
        **step.variant,
        **choice,
        "step_s": torch_s,
        "step_s_all": [t for t, _ in timings],
        "cpu_s": torch_cpu_s,
        "tokens_per_s": tokens / torch_s,
        "tokens_per_cpu_s": tokens / torch_cpu_s,
        "threads": _torch_threads(),
        "params": step.params,
    }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def dispatch_seconds(cfg, num_tokens: int, repeats: int = 5) -> float:
    """Forward + backward of one layer's router selection, capacity slots, gather and combine.

    The expert FFN is left out (identity), so this is the time the MoE step spends moving tokens.
    """
    import mindspore as ms
    from mindspore import Tensor

    from mindmoe.model.moe.dispatch import capacity_slots, combine_from_slots, expert_capacity, gather_to_slots
    from mindmoe.model.moe.router import gather_weights, router_scores, select_experts

    capacity = expert_capacity(num_tokens, cfg.top_k, cfg.num_experts, BENCH_MOE.capacity_factor)

    def route_and_move(x_TH, logits_TE):
        scores_TE = router_scores(logits_TE, cfg.score_func)
        topk_idx_TK = select_experts(scores_TE, cfg.top_k)
        weight_TK = gather_weights(scores_TE, topk_idx_TK, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        slot_A, _ = capacity_slots(topk_idx_TK, cfg.num_experts, capacity)
        x_ECH = gather_to_slots(x_TH, slot_A, cfg.num_experts, capacity)
        return combine_from_slots(x_ECH, slot_A, weight_TK).sum()

    step = ms.jit(ms.value_and_grad(route_and_move, (0, 1)))
    rng = np.random.default_rng(0)
    x_TH = Tensor(rng.standard_normal((num_tokens, cfg.hidden_size)).astype(np.float32))
    logits_TE = Tensor(rng.standard_normal((num_tokens, cfg.num_experts)).astype(np.float32))
    step(x_TH, logits_TE)[0].asnumpy()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss, grads = step(x_TH, logits_TE)
        grads[0].asnumpy()
        timings.append(time.perf_counter() - start)
    return float(np.median(timings))


def compile_time(size: BenchSize, num_layers: int, lazy_inline: bool = False) -> dict:
    """Compile seconds of the MoE train step with ``num_layers`` layers (first step minus a steady step).

    ``lazy_inline`` builds the model as ``train.cell_reuse=true`` does (one compiled layer body
    called L times, MindSpore's ``lazy_inline``); where that fails, the row carries the error instead.
    """
    _graph_mode()
    cfg = model_config(size, "moe", num_layers=num_layers, hidden_size=size.compile_hidden)
    trainer, _ = build_trainer(cfg, cell_reuse=lazy_inline)
    batches = [random_windows(size, 1, seed) for seed in range(3)]
    row = {"layers": num_layers, "hidden_size": cfg.hidden_size, "lazy_inline": lazy_inline}
    try:
        first, _ = timed(trainer.step, [batches[0]])
    except RuntimeError as error:
        if not lazy_inline:
            raise
        message = str(error).strip().splitlines()[0]
        # Drop the generated graph name that follows the reason.
        return {**row, "error": message.split("<FuncGraph>")[0] + ("<FuncGraph>" if "<FuncGraph>" in message else "")}
    step_s = float(np.median([timed(trainer.step, [window])[0] for window in batches[1:]]))
    return {**row, "compile_s": max(first - step_s, 0.0), "first_step_s": first, "step_s": step_s}


def data_pipeline(size: BenchSize) -> dict:
    """Micro-batches/s of the MindRecord WindowLoader over freshly written shards."""
    _graph_mode()
    from mindmoe.data.mindrecord import WindowLoader, write_shards
    from mindmoe.data.packing import PackedWindows

    windows = random_windows(size, size.data_windows, seed=0)
    with tempfile.TemporaryDirectory(prefix="mindmoe_bench_data_") as tmp:
        names = write_shards(
            PackedWindows(windows["input_ids"], windows["doc_ids"]),
            tmp,
            "train",
            shard_windows=max(1, size.data_windows // 4),
        )
        loader = WindowLoader(
            [f"{tmp}/{name}" for name in names],
            micro_batch_size=size.micro_batch,
            global_batch_size=size.micro_batch,
            seed=0,
        )
        next(loader)  # the first batch starts the reader pipeline
        start = time.perf_counter()
        for _ in range(size.data_batches):
            batch = next(loader)
        elapsed = time.perf_counter() - start
    if batch["input_ids"].shape != (size.micro_batch, size.seq_len + 1):
        raise RuntimeError(f"loader returned {batch['input_ids'].shape}")
    return {
        "micro_batch": size.micro_batch,
        "seq_len": size.seq_len,
        "batches": size.data_batches,
        "batches_per_s": size.data_batches / elapsed,
    }
