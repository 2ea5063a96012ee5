"""``python -m mindmoe.bench.ms_options --model dense --setting jit_level=O1``: does a MindSpore context option
speed up the benchmark train step here?

Two trainers of the ``train_step`` case (bench.cases.build_trainer) in one process: the first compiled with
the process's settings, then the option is set (``ms.set_context``, read when a graph compiles) and the second
compiled under it. Their steps then alternate on the same windows, so both see the same load from other
users of the machine; the JSON line has the median step and tokens/s of each, and the compile time of each.
No model code changes: only what MindSpore itself offers.

Settings: ``jit_level=O0|O1|O2`` (``set_context(jit_config=...)``), ``jit=O0|O1`` (``ms.jit(fn, jit_level=...)``
for the step functions, see :func:`jit_level_of_new_graphs`), ``graph_kernel`` (``enable_graph_kernel=True``; on CPU it
builds its fused kernels with the AKG compiler bundled in MindSpore, which imports the ``decorator``
package) and ``graph_kernel_flags=<flags>``.
"""

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time

SETTINGS = "jit_level=O0|O1|O2, jit=O0|O1, graph_kernel or graph_kernel_flags=..."


@contextlib.contextmanager
def jit_level_of_new_graphs(setting: str):
    """With ``jit=<level>``: ``ms.jit`` applied while the trainer is built (train/step.py decorates its step
    functions with a bare ``@ms.jit``, whose own ``jit_level`` is ``O0``) passes that level, as
    ``ms.jit(fn, jit_level=...)`` would; the model code is unchanged."""
    import mindspore as ms

    name, _, value = setting.partition("=")
    if name != "jit":
        yield
        return
    original = ms.jit
    ms.jit = functools.partial(original, jit_level=value)
    try:
        yield
    finally:
        ms.jit = original


def context_of(setting: str) -> dict:
    """``ms.set_context`` keyword arguments of one ``--setting`` ({} for ``jit=``, which is no context option)."""
    name, _, value = setting.partition("=")
    if name == "jit" and value in ("O0", "O1"):
        return {}
    if name == "jit_level" and value in ("O0", "O1", "O2"):
        return {"jit_config": {"jit_level": value}}
    if name == "graph_kernel" and not value:
        return {"enable_graph_kernel": True}
    if name == "graph_kernel_flags" and value:
        return {"enable_graph_kernel": True, "graph_kernel_flags": value}
    raise ValueError(f"--setting {setting!r}: expected {SETTINGS}")


def compare(kind: str, setting: str, layers: int, steps: int, size_name: str) -> dict:
    import mindspore as ms

    @contextlib.contextmanager
    def under_option():
        ms.set_context(**context_of(setting))
        with jit_level_of_new_graphs(setting):
            yield

    return {"setting": setting, **alternate(kind, layers, steps, size_name, under_option)}


def alternate(kind: str, layers: int, steps: int, size_name: str, under_option) -> dict:
    """Two trainers of the ``train_step`` case in one process, the second built and compiled (its first step)
    inside the context manager ``under_option()``; then their steps alternate on the same windows."""
    from mindmoe.bench import cases
    from mindmoe.bench.specs import SIZES, model_config

    ms = cases._graph_mode()
    size = SIZES[size_name]
    cfg = model_config(size, kind, num_layers=layers)
    windows = [cases.random_windows(size, size.micro_batch, seed) for seed in range(steps + 2)]
    default_jit = ms.get_context("jit_config")
    baseline, _ = cases.build_trainer(cfg)
    base_first, _ = cases.timed(baseline.step, [windows[0]])
    with under_option():
        option, _ = cases.build_trainer(cfg)
        try:
            option_first, _ = cases.timed(option.step, [windows[0]])
        except RuntimeError as error:
            return {"model": kind, "error": str(error).strip().splitlines()[0][:300]}
    baseline.step([windows[1]])
    option.step([windows[1]])
    times = {"baseline": [], "option": []}
    losses = {"baseline": [], "option": []}
    for window in windows[2:]:
        for name, trainer in (("baseline", baseline), ("option", option)):
            start = time.perf_counter()
            stats = trainer.step([window])
            times[name].append(time.perf_counter() - start)
            losses[name].append(stats.loss)
    tokens = size.micro_batch * size.seq_len
    step_s = {name: statistics.median(values) for name, values in times.items()}
    return {
        "model": kind,
        "layers": cfg.num_layers,
        "default_jit_config": default_jit,
        "baseline_step_s": step_s["baseline"],
        "option_step_s": step_s["option"],
        "baseline_tokens_per_s": tokens / step_s["baseline"],
        "option_tokens_per_s": tokens / step_s["option"],
        "speedup": step_s["baseline"] / step_s["option"],
        "baseline_compile_s": base_first - step_s["baseline"],
        "option_compile_s": option_first - step_s["option"],
        # Same windows, same initial weights: the losses say whether the option changed the numerics.
        "max_loss_difference": max(abs(a - b) for a, b in zip(losses["baseline"], losses["option"])),
        "step_s_all": times,
    }


def main(argv=None) -> int:
    from mindmoe.conf.quiet import quiet_framework_logs

    quiet_framework_logs()
    parser = argparse.ArgumentParser(prog="python -m mindmoe.bench.ms_options", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "moe"), required=True)
    parser.add_argument("--setting", required=True, help=SETTINGS)
    parser.add_argument("--layers", type=int, default=0, help="layer count (default: the size's, 8 at full)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps of each trainer")
    parser.add_argument("--size", choices=("full", "quick"), default="full")
    args = parser.parse_args(argv)
    context_of(args.setting)  # a typo fails before minutes of compiling
    print(json.dumps(compare(args.model, args.setting, args.layers, args.steps, args.size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
