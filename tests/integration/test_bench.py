"""``python -m mindmoe.bench`` on the tiny quick size: the JSON rows it prints and BENCHMARKS.md.

Figures are not checked (the machine is shared); only that every row carries its figures with
the right types and ranges, that the results file receives the same rows, and that the
markdown shows them.
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
        timeout=600,
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    results, markdown = out / "results.jsonl", out / "BENCHMARKS.md"
    results.write_text(json.dumps({"case": "earlier run"}) + "\n")
    child = run_bench(
        "--quick", "--cases", "moe_overhead,data_pipeline", "--results", str(results), "--markdown", str(markdown)
    )
    assert child.returncode == 0, child.stderr[-3000:]
    printed = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    return printed, results, markdown


def rows_of(printed, case):
    return [row for row in printed if row["case"] == case]


def test_each_case_prints_its_figures_as_numbers(quick_run):
    printed, _, _ = quick_run
    # moe_overhead needs the train steps, which need gemm_peak for their MFU.
    assert [row["case"] for row in printed] == [
        "gemm_peak",
        "train_step",
        "train_step",
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
    for heading in ("## Against the targets", "## gemm_peak", "## train_step", "## moe_overhead", "## data_pipeline"):
        assert heading in text
    moe = [row for row in rows_of(printed, "train_step") if row["model"] == "moe"][0]
    assert f"| moe MFU (of the best MatMul rate) | {moe['mfu']:.2f} | >= 0.50 |" in text


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
