"""Peak memory of preparing and reading the data as the corpus grows: ``python bench/data_memory.py [--mib 40]``.

Writes a JSONL corpus of about ``--mib`` MiB (the bundled sample's documents, numbered so none
repeats) and one ``--scale`` times larger, then for each, in a fresh process: the writer
(``prepare_data``: tokenise, pack, write the shards; the bundled tiny tokenizer, so no tokenizer is
trained), and a reader (``WindowLoader`` over every window of one epoch, as a training rank reads
them). Reports each process's peak RSS (``VmHWM``: :mod:`bench.peak_memory`) above its baseline (RSS after the imports)
next to the bytes of the packed windows. Streaming keeps the growth far below ``--scale``.
Prints as its last line one JSON object ``{"case": "data_memory", ...}``. Not part of the test suite.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mindmoe.bench.peak_memory import current_rss, own_peak_rss

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"


def _write_corpus(path: Path, mib: float) -> None:
    texts = [json.loads(line)["text"] for line in (SAMPLES / "corpus_train.jsonl").open(encoding="utf-8")]
    written, number = 0, 0
    with open(path, "w", encoding="utf-8") as handle:
        while written < mib * 2**20:
            line = json.dumps({"text": f"No. {number}. {texts[number % len(texts)]}"}, ensure_ascii=False) + "\n"
            handle.write(line)
            written += len(line.encode("utf-8"))
            number += 1


def _child(role: str, corpus: str, cache: str) -> None:
    from mindmoe.data.config import DataConfig
    from mindmoe.data.mindrecord import WindowLoader
    from mindmoe.data.prepare import prepare_data

    cfg = DataConfig(
        train_files=[corpus],
        valid_files=[],
        tokenizer=str(SAMPLES / "tiny_base" / "tokenizer.model"),
        seq_len=256,
        shard_windows=1024,
        num_proc=1,
        cache_dir=cache,
    )
    baseline = current_rss() / 2**20
    started = time.perf_counter()
    prepared = prepare_data(cfg, writer=role == "writer")
    if role == "reader":
        loader = WindowLoader(prepared.train_shards, micro_batch_size=16, global_batch_size=64, seed=0)
        for _ in range(loader.steps_per_epoch * loader.accumulation_steps):
            next(loader)
    windows_mib = prepared.num_train_windows * (cfg.seq_len + 1) * 8 / 2**20
    result = dict(
        role=role,
        baseline_mib=baseline,
        peak_mib=own_peak_rss() / 2**20,
        windows=prepared.num_train_windows,
        windows_mib=windows_mib,
        seconds=time.perf_counter() - started,
    )
    result["growth_mib"] = result["peak_mib"] - baseline
    print(json.dumps(result))


def _measure(role: str, corpus: Path, cache: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", role, "--corpus", str(corpus), "--cache", str(cache)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=40.0, help="size of the smaller corpus")
    parser.add_argument("--scale", type=float, default=4.0, help="how many times larger the second corpus is")
    parser.add_argument("--child", choices=["writer", "reader"])
    parser.add_argument("--corpus")
    parser.add_argument("--cache")
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.corpus, args.cache)
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, mib in (("1x", args.mib), (f"{args.scale:g}x", args.mib * args.scale)):
            corpus = Path(tmp) / f"corpus-{label}.jsonl"
            _write_corpus(corpus, mib)
            for role in ("writer", "reader"):
                rows[f"{role}_{label}"] = _measure(role, corpus, Path(tmp) / "cache")
                print(label, json.dumps(rows[f"{role}_{label}"]), flush=True)
    big = f"{args.scale:g}x"
    summary = {
        "case": "data_memory",
        "scale": args.scale,
        "windows_mib": [rows["writer_1x"]["windows_mib"], rows[f"writer_{big}"]["windows_mib"]],
        "writer_growth_mib": [rows["writer_1x"]["growth_mib"], rows[f"writer_{big}"]["growth_mib"]],
        "reader_growth_mib": [rows["reader_1x"]["growth_mib"], rows[f"reader_{big}"]["growth_mib"]],
    }
    summary["writer_growth_ratio"] = summary["writer_growth_mib"][1] / summary["writer_growth_mib"][0]
    summary["reader_growth_ratio"] = summary["reader_growth_mib"][1] / summary["reader_growth_mib"][0]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
