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


# The opt-in scaling case: its command lines, rows and section, checked without running its 15 trainings.


def test_scaling_is_opt_in_not_a_default_case():
    from mindmoe.bench.__main__ import DEFAULT_CASES, OPT_IN_CASES, parse_cases

    assert "scaling" not in DEFAULT_CASES and "scaling" in OPT_IN_CASES
    assert parse_cases("scaling") == ["scaling"]
    help_text = run_bench("--help").stdout
    assert "opt-in: hf_load_memory,scaling" in " ".join(help_text.split())


def scaling_overrides(run) -> dict:
    return dict(override.split("=", 1) for override in run.overrides)


def test_scaling_runs_are_the_issues_commands_and_compose_into_configs():
    from hydra import compose, initialize_config_module

    from mindmoe.bench.scaling import scaling_runs
    from mindmoe.conf.schema import register_configs

    runs = scaling_runs("full")
    experts = [(r.label, scaling_overrides(r)) for r in runs if r.group == "experts"]
    assert [label for label, _ in experts] == [
        f"{e}/8 {dispatch}" for e in (8, 64, 128, 256) for dispatch in ("capacity", "dropless")
    ]
    for label, overrides in experts:
        assert overrides["model.num_experts"] == label.split("/")[0]
        assert (overrides["model.top_k"], overrides["model.moe_intermediate_size"]) == ("8", "32")
        assert overrides["moe.dispatch"] == label.split()[1]
        assert overrides.get("moe.capacity_factor", "1.25") == "1.25"
    one_sequence = {
        "data.micro_batch_size": "1",
        "data.global_batch_size": "1",
        "model.max_position_embeddings": "8192",
    }
    lengths = [scaling_overrides(r) for r in runs if r.group == "length"]
    assert [o["data.seq_len"] for o in lengths] == ["1024", "2048", "4096", "8192"]
    vocabs = [scaling_overrides(r) for r in runs if r.group == "vocab"]
    assert [(o["data.seq_len"], o["model.vocab_size"]) for o in vocabs] == [
        ("2048", "8192"),
        ("2048", "151552"),
        ("8192", "151552"),  # the step that must fit on the machine
    ]
    for overrides in lengths + vocabs:
        assert one_sequence.items() <= overrides.items()
    # The 64/8 capacity model of the experts group on 2 workers, the two dispatchers back to back.
    gathered, routed = [r for r in runs if r.group == "expert parallel"]
    assert (gathered.label, routed.label) == ("ep 2 allgather", "ep 2 alltoall") and gathered.launcher
    different = dict(scaling_overrides(gathered).items() ^ scaling_overrides(routed).items())
    assert different == {"parallel.ep_dispatcher": "allgather"} or different == {"parallel.ep_dispatcher": "alltoall"}
    experts_64 = scaling_overrides(next(r for r in runs if r.label == "64/8 capacity"))
    assert experts_64.items() <= scaling_overrides(routed).items()
    assert {"launch.procs_per_node": "2", "parallel.ep": "2"}.items() <= scaling_overrides(routed).items()
    # 16 sequences per step in micro-batches of 4: a whole number of them per rank for both layouts.
    assert scaling_overrides(routed)["data.micro_batch_size"] == "4"
    # Only training sizes (and the layout of the two launches) change: nothing else of the default run is touched.
    single = [r for r in runs if not r.launcher]
    assert {key.split(".")[0] for r in single for key in scaling_overrides(r)} == {"model", "moe", "data", "train"}
    for run in runs:
        tool = "mindmoe-launch " if run.launcher else "mindmoe-train "
        assert run.command == tool + " ".join(run.overrides)
    # Every key is a config key, composed as mindmoe-train composes (one run per set of keys: 1.3 s each).
    register_configs()
    with initialize_config_module(config_module="mindmoe.conf", version_base="1.3"):
        for run in {frozenset(scaling_overrides(run)): run for run in runs}.values():
            cfg = compose(config_name="config", overrides=list(run.overrides))
            for key, value in scaling_overrides(run).items():
                section, name = key.split(".")
                assert str(cfg[section][name]).lower() == value, key


def fake_scaling_rows():
    from mindmoe.bench.scaling import GIB, scaling_runs

    speeds = {"64/8 capacity": 4000.0, "64/8 dropless": 3600.0, "128/8 capacity": 4000.0, "128/8 dropless": 2000.0}
    speeds.update({"ep 2 allgather": 1000.0, "ep 2 alltoall": 1500.0})
    rss = {"seq 1024": 2.0, "seq 2048": 2.5, "seq 4096": 4.0}
    rows = []
    for run in scaling_runs("full"):
        ok = run.label != "seq 8192"
        rows.append(
            {
                "case": "scaling",
                "run": "2026-01-01T00:00:00Z",
                "kind": "run",
                "group": run.group,
                "label": run.label,
                "command": run.command,
                "tokens_per_s": speeds.get(run.label, 1000.0) if ok else None,
                "log_rows": 3 if ok else 0,
                "peak_rss": int(rss.get(run.label, 3.0) * GIB),
                "wall_s": 30.0,
                "load_avg": 1.0,
                "status": "ok" if ok else "killed by SIGKILL (out of memory?)",
            }
        )
    return rows


def test_scaling_ratios_are_formed_from_the_rows_they_name():
    from mindmoe.bench.scaling import ratios

    figures = {f["figure"]: f for f in ratios(fake_scaling_rows())}
    assert figures["64/8 dropless / capacity tokens/s"]["value"] == pytest.approx(0.9)
    assert figures["64/8 dropless / capacity tokens/s"]["holds"]
    assert not figures["128/8 dropless / capacity tokens/s"]["holds"]  # 0.5 < 0.7
    assert figures["128/8 dropless / capacity peak RSS"]["value"] == pytest.approx(1.0)
    # (4.0 - 2.5) / max(2.5 - 2.0, 0.25) = 3.0 > 2.3
    growth = figures["peak RSS (4k - 2k) / max(2k - 1k, 0.25 GiB)"]
    assert growth["value"] == pytest.approx(3.0) and not growth["holds"]
    routed = figures["ep 2 alltoall / allgather tokens/s"]
    assert routed["value"] == pytest.approx(1.5) and routed["target"] == ">= 1.3" and routed["holds"]


def test_scaling_section_lists_every_run_with_its_command_and_failures_as_rows(tmp_path):
    from mindmoe.bench import scaling
    from mindmoe.bench.__main__ import write_markdown

    rows = fake_scaling_rows()
    rows += [{"case": "scaling", "kind": "ratio", **f} for f in scaling.ratios(rows)]
    text = "\n".join(scaling.markdown_section(rows))
    assert "One factor at a time" in text
    for row in rows[:15]:
        assert f"`{row['command']}` |" in text
    assert "| length | seq 8192 | - | 3.00 |" in text and "killed by SIGKILL (out of memory?)" in text
    assert "| 64/8 dropless / capacity tokens/s | 0.90 | >= 0.8 | yes |" in text

    # A scaling-only run replaces just its section; a later default run keeps it.
    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n\n## gemm_peak\n\nkept\n")

    class ScalingRun:
        run_id, size = rows[0]["run"], None

    ScalingRun.rows = rows
    write_markdown(markdown, ScalingRun, {})
    assert markdown.read_text() == "# Benchmarks\n\n## gemm_peak\n\nkept\n\n" + text.rstrip("\n") + "\n"
    ScalingRun.rows = rows[:2]  # fewer rows: the section is rewritten, nothing else
    write_markdown(markdown, ScalingRun, {})
    assert "seq 8192" not in markdown.read_text() and "kept" in markdown.read_text()
    assert scaling.existing_section(markdown.read_text()).startswith("## Scaling")


def test_benchmarks_markdown_of_a_default_run_keeps_the_scaling_section(quick_run):
    from mindmoe.bench import scaling

    _, results, markdown = quick_run
    section = "\n".join(scaling.markdown_section(fake_scaling_rows()))
    markdown.write_text(scaling.splice(markdown.read_text(), section))
    child = run_bench("--rerender", "--results", str(results), "--markdown", str(markdown))
    assert child.returncode == 0, child.stderr[-3000:]
    text = markdown.read_text()
    assert "## train_step" in text and scaling.existing_section(text) == section.rstrip("\n") + "\n"


def test_a_failed_scaling_run_is_a_row_saying_so(tmp_path):
    from mindmoe.bench.scaling import ScalingRun, failure, run_one

    assert failure(-9, "") == "killed by SIGKILL (out of memory?)"
    mindspore_style = "Traceback\nRuntimeError:\n\n----\n- Memory not enough: 4096 MiB requested\n----\n"
    assert failure(1, mindspore_style) == "exit 1: RuntimeError: - Memory not enough: 4096 MiB requested"
    row = run_one(ScalingRun("experts", "bad", ("model.num_experts=0",)), ROOT, tmp_path)
    assert row["status"].startswith("exit ") and "num_experts" in row["status"]
    assert row["tokens_per_s"] is None and row["peak_rss"] > 50 * 2**20
