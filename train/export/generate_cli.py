"""``mindmoe-generate``: text from an export directory (prefill.mindir + decode.mindir) on CPU.

    mindmoe-generate exported --prompt "Once upon a time" --max-new-tokens 32
    mindmoe-generate exported --prompt "Once upon a time" --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1

The reference for serving code: it loads the graphs with ``mindspore.load`` + ``nn.GraphCell``
(:class:`model.export.runner.ExportedModel`) and the tokenizer copied beside them. Prompts start with
the tokenizer's BOS token, as training documents do; generation stops at EOS.
"""

import argparse
from pathlib import Path

from mindmoe.conf.exit_codes import reports_errors
from mindmoe.conf.quiet import quiet_framework_logs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="mindmoe-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", type=Path, help="directory written by mindmoe-export export.format=mindir")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def prompt_ids(tokenizer, prompts) -> list:
    """Token ids of each prompt, BOS first (as training documents start)."""
    return [([tokenizer.bos_id] if tokenizer.bos_id >= 0 else []) + tokenizer.encode(prompt) for prompt in prompts]


def check_lengths(prompts, ids, max_new_tokens: int, max_positions: int) -> None:
    """Every prompt with ``--max-new-tokens`` must fit the model's positions; checked for all prompts
    before any is generated, naming the prompt and how many new tokens would fit."""
    from mindmoe.model.export.runner import length_problem

    for prompt, prompt_ids_S in zip(prompts, ids):
        problem = length_problem(len(prompt_ids_S), max_new_tokens, max_positions, "--max-new-tokens")
        if problem:
            shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
            raise ValueError(f"--prompt {shown!r} ({len(prompt_ids_S)} tokens): {problem}")


@reports_errors("mindmoe-generate")
def main(argv=None) -> None:
    quiet_framework_logs()
    args = parse_args(argv)
    import mindspore as ms

    from mindmoe.data.tokenizer_files import open_export_tokenizer
    from mindmoe.model.export.runner import ExportedModel
    from mindmoe.model.kernels.host_runtime import configure_host_runtime

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    configure_host_runtime("CPU")
    exported = ExportedModel(args.export_dir)
    tokenizer = open_export_tokenizer(args.export_dir)
    ids = prompt_ids(tokenizer, args.prompt)
    check_lengths(args.prompt, ids, args.max_new_tokens, exported.max_positions)
    for prompt, prompt_ids_S in zip(args.prompt, ids):
        new_ids = exported.generate(
            [prompt_ids_S], args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, tokenizer.eos_id
        )[0].tolist()
        if tokenizer.eos_id in new_ids:
            new_ids = new_ids[: new_ids.index(tokenizer.eos_id)]
        print(prompt + tokenizer.decode(new_ids))


if __name__ == "__main__":
    main()
