"""``python -m mindmoe.bench`` on the tiny quick size: the JSON rows it prints and BENCHMARKS.md.

Figures are not checked (the machine is shared); only that every row carries its figures with
the right types and ranges, that the ratios are formed from the rows they name, that the results
file receives the same rows, and that the markdown shows them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run(
        [sys.executable, "-m", "mindmoe.bench", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
        timeout=900,  # a loaded shared machine; torch.compile adds its compile time
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    results, markdown = out / "results.jsonl", out / "BENCHMARKS.md"
    results.write_text(json.dumps({"case": "earlier run"}) + "\n")
    child = run_bench(
        "--quick",
        "--cases",
        "torch_reference,moe_overhead,data_pipeline",
        "--results",
        str(results),
        "--markdown",
        str(markdown),
    )
    assert child.returncode == 0, child.stderr[-3000:]
    printed = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    return printed, results, markdown


def rows_of(printed, case):
    return [row for row in printed if row["case"] == case]


def test_each_case_prints_its_figures_as_numbers(quick_run):
    printed, _, _ = quick_run
    # torch_reference and moe_overhead need the train steps, which need gemm_peak for their MFU.
    assert [row["case"] for row in printed] == [
        "gemm_peak",
        "train_step",
        "train_step",
        *["torch_reference"] * 4,
        "moe_overhead",
        "data_pipeline",
    ]
    assert len({row["run"] for row in printed}) == 1
    assert rows_of(printed, "gemm_peak")[0]["gflops"] > 0
    steps = {row["model"]: row for row in rows_of(printed, "train_step")}
    assert set(steps) == {"dense", "moe"}
    for row in steps.values():
        for key in ("tokens_per_s", "mfu", "compile_s", "peak_rss_ratio", "flops_per_token", "step_s"):
            assert isinstance(row[key], float), (key, row)
        assert 0 < row["mfu"] < 1
        assert row["peak_rss"] > row["framework_rss"] > 0
        assert row["theoretical_bytes"] == 16 * row["params"]
        assert row["peak_rss_ratio"] == pytest.approx(
            (row["peak_rss"] - row["framework_rss"]) / (row["theoretical_bytes"] + row["activation_bytes"])
        )
    # MFU is against the higher of MindSpore's and PyTorch's measured MatMul rates (and the step processes').
    gemm = rows_of(printed, "gemm_peak")[0]
    assert gemm["torch_gflops"] > 0
    peak = max([gemm["gflops"], gemm["torch_gflops"]] + [row["local_gflops"] for row in steps.values()])
    for row in steps.values():
        assert row["peak_gflops"] == peak
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / (peak * 1e9))
    # Equal active parameters by construction: the MoE adds only its router.
    assert (
        0
        < steps["moe"]["active_matmul_params"] - steps["dense"]["active_matmul_params"]
        < 0.05 * steps["dense"]["active_matmul_params"]
    )
    overhead = rows_of(printed, "moe_overhead")[0]
    assert overhead["moe_overhead"] == pytest.approx(steps["moe"]["tokens_per_s"] / steps["dense"]["tokens_per_s"])
    assert overhead["moe_overhead_cpu"] == pytest.approx(
        steps["moe"]["tokens_per_cpu_s"] / steps["dense"]["tokens_per_cpu_s"]
    )
    assert 0 < overhead["dispatch_share"]
    pipeline = rows_of(printed, "data_pipeline")[0]
    assert pipeline["batches_per_s"] > 0 and pipeline["headroom"] > 0


def test_torch_reference_rows_are_the_best_variant_and_plain_eager(quick_run):
    printed, _, _ = quick_run
    steps = {row["model"]: row for row in rows_of(printed, "train_step")}
    torch_rows = {(row["model"], row["variant"]): row for row in rows_of(printed, "torch_reference")}
    assert set(torch_rows) == {(kind, variant) for kind in ("dense", "moe") for variant in ("best", "eager")}
    for kind, mindmoe in steps.items():
        best, eager = torch_rows[(kind, "best")], torch_rows[(kind, "eager")]
        for row in (best, eager):
            assert row["torch_ratio"] == pytest.approx(mindmoe["tokens_per_s"] / best["tokens_per_s"])
            assert row["torch_eager_ratio"] == pytest.approx(mindmoe["tokens_per_s"] / eager["tokens_per_s"])
            assert row["torch_cpu_ratio"] == pytest.approx(mindmoe["tokens_per_cpu_s"] / best["tokens_per_cpu_s"])
            assert row["params"] == mindmoe["params"]  # the same model in both frameworks
        assert (eager["attention"], eager["optimizer"], eager["compiled"]) == ("matmul-softmax", "loop", False)
        assert best["attention"] == "sdpa"
        # The faster AdamW of the two, and torch.compile only when it was faster than eager.
        assert best["optimizer"] == min(best["optimizer_step_s"], key=best["optimizer_step_s"].get)
        if best["compiled"]:
            assert best["compiled_step_s"] < best["eager_step_s"]
            assert best["torch_compile"].endswith(": compiled")
        else:
            assert best["torch_compile"].endswith(": eager")
            assert "fails here" in best["torch_compile"] or best["compiled_step_s"] >= best["eager_step_s"]


def test_results_file_gets_the_printed_rows_appended(quick_run):
    printed, results, _ = quick_run
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert lines[0] == {"case": "earlier run"}
    assert lines[1:] == printed


def test_benchmarks_markdown_shows_the_run(quick_run):
    printed, _, markdown = quick_run
    text = markdown.read_text()
    assert printed[0]["run"] in text
    assert "MindSpore 2." in text and "cores" in text and "GiB RAM" in text
    headings = ("## Against the targets", "## gemm_peak", "## train_step", "## torch_reference", "## moe_overhead")
    for heading in headings + ("## data_pipeline",):
        assert heading in text
    moe = [row for row in rows_of(printed, "train_step") if row["model"] == "moe"][0]
    assert f"| moe MFU (of the best MatMul rate) | {moe['mfu']:.2f} | >= 0.50 |" in text
    # The target is on the ratio against the best PyTorch variant; both variants have a row.
    for row in rows_of(printed, "torch_reference"):
        ratio = row["torch_ratio"] if row["variant"] == "best" else row["torch_eager_ratio"]
        assert f"| {row['model']} | {row['variant']} | {row['attention']} | {row['optimizer']} |" in text
        assert f"| {row['tokens_per_s']:.2f} | {ratio:.2f} |" in text
        if row["variant"] == "best":
            assert f"| {row['model']} tokens/s, mindmoe / best PyTorch | {ratio:.2f} | >= 1.00 |" in text
            assert f"- {row['model']}: AdamW step s" in text and row["torch_compile"] in text


def test_rerender_rebuilds_the_markdown_from_the_results_file(quick_run, tmp_path):
    printed, results, markdown = quick_run
    again = tmp_path / "again.md"
    child = run_bench("--rerender", "--results", str(results), "--markdown", str(again))
    assert child.returncode == 0, child.stderr[-3000:]
    # The same rows give the same tables; only the run's wall time is not in the results file.
    tables = "## Against the targets"
    assert again.read_text().split(tables)[1] == markdown.read_text().split(tables)[1]
    assert printed[0]["run"] in again.read_text()


def test_unknown_case_is_rejected_with_the_valid_names():
    child = run_bench("--cases", "train_stepp", "--markdown", "-")
    assert child.returncode != 0
    assert "train_stepp" in child.stderr and "train_step" in child.stderr
