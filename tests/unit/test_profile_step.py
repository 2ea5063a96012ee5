"""bench/profile_step.py without a profiling run: the op-type table, the MatMul FLOP count from the recorded
input shapes, the summary of a hand-made trace, and that a regenerated BENCHMARKS.md keeps the profile section.

The categories are what the speed work is steered by, so a known kernel landing in the wrong one (or an
unknown one hidden in a category) would point it at the wrong cost."""

import pytest

from mindmoe.bench.profile_step import (
    CATEGORIES,
    PROFILE_SECTION,
    categorize,
    keep_profile_section,
    matmul_flops,
    op_type_of,
    parse_shapes,
    summarize,
)


@pytest.mark.parametrize(
    "op_type, category",
    [
        ("MatMul", "matmul"),
        ("BatchMatMul", "matmul"),
        ("Mul", "elementwise"),
        ("AddN", "elementwise"),
        ("SigmoidGrad", "elementwise"),
        ("Select", "elementwise"),
        ("ReduceSum", "reduction"),
        ("ReduceMax", "reduction"),
        ("ReduceMean", "reduction"),
        ("Softmax", "reduction"),
        ("Transpose", "data_movement"),
        ("Concat", "data_movement"),
        ("StridedSlice", "data_movement"),
        ("StridedSliceGrad", "data_movement"),
        ("Gather", "data_movement"),
        ("Reshape", "data_movement"),
        ("Cast", "data_movement"),
        ("ScatterNd", "data_movement"),
        ("Adam", "optimizer"),
        ("Assign", "optimizer"),
    ],
)
def test_known_op_types_land_in_their_category(op_type, category):
    assert categorize(op_type) == category


def test_an_unknown_op_type_is_other_and_every_category_is_listed():
    assert categorize("FancyFusedKernel") == "other"
    assert categorize("matmul") == "other"  # the table is case-sensitive, as the profiler's op types
    assert set(CATEGORIES) >= {"matmul", "elementwise", "reduction", "data_movement", "optimizer", "other"}


def test_the_gradient_norm_dot_products_count_as_optimizer_not_matmul():
    assert categorize("MatMul", ((1, 4096), (1, 4096))) == "optimizer"
    assert categorize("BatchMatMul", ((2048, 1, 4096), (2048, 1, 4096))) == "optimizer"  # per expert row pieces
    assert categorize("BatchMatMul", ((8, 1, 512), (8, 512, 64))) == "matmul"  # one-row products of the model
    assert categorize("MatMul", ((1, 512), (512, 512))) == "matmul"
    assert categorize("MatMul", ((2048, 512), (1024, 512))) == "matmul"


def test_op_names_and_shapes_from_the_profiler_files():
    assert op_type_of("Gradients/Default/BatchMatMul-op12") == "BatchMatMul"
    assert op_type_of("Default/Adam-op3") == "Adam"
    fields = ["input_1:[2048, 512]", "input_2:[1024, 512]", "input_3:NoShape", "input_4:NoShape"]
    assert parse_shapes(fields) == ((2048, 512), (1024, 512), None, None)


def test_matmul_flops_from_input_shapes():
    # x [T, H] W^T with W [I, H]: 2 T H I, one reading.
    assert matmul_flops("MatMul", ((2048, 512), (1024, 512))) == (2 * 2048 * 512 * 1024, None)
    # A TN product (key gradient dscores^T q inside attention's bprop): contracts over the 512 query rows.
    assert matmul_flops("BatchMatMul", ((4, 2, 512, 128), (4, 2, 512, 64))) == (2 * 8 * 128 * 512 * 64, None)
    # Broadcast batch dimensions: [B, G, R, D] x [G, K, D]^T.
    assert matmul_flops("BatchMatMul", ((4, 2, 512, 64), (2, 256, 64)))[0] == 2 * 4 * 2 * 512 * 256 * 64
    # The same shapes twice: a weight gradient dy^T x contracts over tokens...
    assert matmul_flops("MatMul", ((2048, 512), (2048, 512))) == (2 * 512 * 2048 * 512, 2 * 2048 * 512 * 2048)
    # ... while attention's q k^T (head dim 64, or 65 with the row-sum column) contracts over the head dim.
    qk = 2 * 8 * 512 * 512 * 64
    assert matmul_flops("BatchMatMul", ((4, 2, 512, 64), (4, 2, 512, 64)), head_dim=64) == (qk, 2 * 8 * 64 * 512 * 64)
    assert matmul_flops("BatchMatMul", ((4, 2, 512, 65), (4, 2, 512, 65)), head_dim=64)[0] == qk * 65 // 64
    assert matmul_flops("Mul", ((2, 2), (2, 2))) == (0, None)


def test_summary_of_a_hand_made_trace():
    ms = 1_000_000  # ns
    windows = [(0, 10 * ms), (20 * ms, 30 * ms)]
    executions = []
    for base in (0, 20 * ms):
        executions += [
            (base + 1 * ms, 4.0, "Default/MatMul-op1", "MatMul", ((1000, 1000), (1000, 1000))),
            (base + 5 * ms, 1.0, "Gradients/Default/Mul-op2", "Mul", ((8,), (8,))),
            (base + 7 * ms, 2.0, "Default/Mystery-op3", "Mystery", ()),
        ]
    executions.append((15 * ms, 5.0, "Default/Mul-op9", "Mul", ()))  # between the steps: not counted
    summary = summarize(executions, windows, peak_gflops=1000.0)
    assert summary["ms_per_step"]["matmul"] == pytest.approx(4.0)
    assert summary["ms_per_step"]["elementwise"] == pytest.approx(1.0)
    assert summary["ms_per_step"]["other"] == pytest.approx(2.0)
    assert summary["other_op_types"] == {"Mystery": pytest.approx(2.0)}
    assert summary["ms_per_step"]["host"] == pytest.approx(3.0)  # 10 ms wall - 7 ms kernels
    assert summary["host_in_graph_ms"] == pytest.approx(1.0)  # 1..9 ms span - 7 ms kernels
    assert summary["host_outside_graph_ms"] == pytest.approx(2.0)
    assert summary["matmul_gflops"] == pytest.approx(500.0)  # 2e9 FLOP in 4 ms
    assert summary["matmul_of_peak"] == pytest.approx(0.5)
    assert summary["top_op_types"][0]["op_type"] == "MatMul"
    (row,) = summary["matmul_shapes"]
    assert row["shapes"] == [[1000, 1000], [1000, 1000]] and row["per_step"] == 1
    assert row["ms_per_step"] == pytest.approx(4.0) and row["gflops"] == pytest.approx(500.0)


def test_matmuls_by_shape_most_time_first_with_their_own_rate():
    """A weight gradient that runs below the rate of the forward product shows up as its own row."""
    ms = 1_000_000  # ns
    forward = ((2048, 512), (512, 512))  # NT or NN: 2 * 2048 * 512 * 512 FLOPs
    weight_grad = ((2048, 512), (2048, 512))  # TN: the same FLOPs
    executions = [
        (1 * ms, 1.5, "Default/MatMul-op1", "MatMul", forward),
        (3 * ms, 1.5, "Default/MatMul-op2", "MatMul", forward),
        (5 * ms, 4.0, "Gradients/MatMul-op3", "MatMul", weight_grad),
    ]
    summary = summarize(executions, [(0, 10 * ms)], peak_gflops=1000.0)
    rows = summary["matmul_shapes"]
    assert [row["shapes"] for row in rows] == [[[2048, 512], [2048, 512]], [[2048, 512], [512, 512]]]
    assert [row["per_step"] for row in rows] == [1, 2]
    flop = 2 * 2048 * 512 * 512
    assert rows[0]["gflops"] == pytest.approx(flop / 4e-3 / 1e9)
    assert rows[1]["gflops"] == pytest.approx(2 * flop / 3e-3 / 1e9)


def test_a_regenerated_benchmarks_file_keeps_the_profile_section_after_train_step():
    section = f"{PROFILE_SECTION}\n\n| category | ms |\n|---|---|\n| matmul | 1 |\n"
    old = f"# Benchmarks\n\n## train_step\n\nold\n\n{section}\n## torch_reference\n\nold\n"
    rendered = "# Benchmarks\n\n## train_step\n\nnew\n\n## torch_reference\n\nnew\n"
    kept = keep_profile_section(rendered, old)
    assert kept == f"# Benchmarks\n\n## train_step\n\nnew\n\n{section}\n## torch_reference\n\nnew\n"
    assert keep_profile_section(kept, old) == kept  # already there: unchanged
    assert keep_profile_section(rendered, rendered) == rendered  # nothing to keep
    assert keep_profile_section("# B\n", old) == "# B\n\n" + section  # no train_step section: appended
