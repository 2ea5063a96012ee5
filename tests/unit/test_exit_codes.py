"""One module of exit codes and one error -> exit code mapping for every command; launch/ needs nothing of train/."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mindmoe.conf.exit_codes import CONFIG_ERROR, OK, STOPPED_ON_SIGNAL, WORKER_FAILED, exit_status, reports_errors

REPO = Path(__file__).resolve().parents[2]


def run_reporting(error, capsys):
    @reports_errors("mindmoe-test")
    def main():
        raise error

    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, capsys.readouterr()


@pytest.mark.parametrize(
    "error",
    [
        ValueError("train.max_steps=0 must be >= 1"),
        FileNotFoundError("data.train_files[0]: no such file"),
        FloatingPointError("3 consecutive steps"),
        NotImplementedError("export.format=onnx"),
    ],
)
def test_a_config_error_prints_prog_error_message_and_exits_2(error, capsys):
    code, printed = run_reporting(error, capsys)
    assert code == CONFIG_ERROR == 2
    assert printed.err == f"mindmoe-test: error: {error}\n" and printed.out == ""


def test_a_signal_stop_exits_3_and_a_failed_worker_1_with_their_labels(capsys):
    from mindmoe.launch.cli import WorkerFailed
    from mindmoe.train.checkpoints.resume import TrainingStopped

    code, printed = run_reporting(TrainingStopped("received SIGTERM: checkpoint of step 4 written"), capsys)
    assert (code, printed.err) == (3, "mindmoe-test: stopped: received SIGTERM: checkpoint of step 4 written\n")
    code, printed = run_reporting(WorkerFailed("rank 1 (pid 7) exited with code -9"), capsys)
    assert (code, printed.err) == (1, "mindmoe-test: error: rank 1 (pid 7) exited with code -9\n")
    assert (OK, WORKER_FAILED, STOPPED_ON_SIGNAL) == (0, 1, 3)


def test_an_unexpected_error_keeps_its_traceback_and_a_result_passes_through():
    assert exit_status(KeyError("bug")) is None

    @reports_errors("mindmoe-test")
    def buggy():
        raise KeyError("bug")

    with pytest.raises(KeyError):
        buggy()
    assert reports_errors("mindmoe-test")(lambda value: value + 1)(1) == 2


def test_exit_codes_import_neither_mindspore_nor_another_mindmoe_module():
    probe = (
        "import sys, mindmoe.conf.exit_codes; "
        "print(sorted(m for m in sys.modules if m.startswith(('mindspore', 'mindmoe.')) and m != 'mindmoe.conf'))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "['mindmoe.conf.exit_codes']"


def imported_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_launch_imports_nothing_of_train():
    offending = {
        f"{path.name}: {module}"
        for path in (REPO / "launch").glob("*.py")
        for module in imported_modules(path)
        if module.startswith("mindmoe.train")
    }
    assert not offending


def test_a_moved_key_exits_2_naming_its_new_place_and_the_check_is_a_leaf(capsys):
    from mindmoe.conf.moved_keys import exit_on_moved_keys

    with pytest.raises(SystemExit) as exited:
        exit_on_moved_keys("mindmoe-test", ["train.lr=0.1", "model.dispatch=dropless"])
    printed = capsys.readouterr()
    assert exited.value.code == CONFIG_ERROR and printed.out == ""
    assert printed.err.startswith("mindmoe-test: error: model.dispatch is now moe.dispatch")
    assert exit_on_moved_keys("mindmoe-test", ["moe.dispatch=dropless", "model.expert_bias=true"]) is None
    # a leaf (conf/moved_keys.py): the key lists and exit codes, no MindSpore, no Hydra, nothing of train/ or launch/
    probe = (
        "import sys, mindmoe.conf.moved_keys; "
        "print(sorted(m for m in sys.modules if m.startswith(('mindspore', 'hydra', 'omegaconf', 'mindmoe.'))))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    leaf = (
        "mindmoe.conf",
        "mindmoe.conf.exit_codes",
        "mindmoe.conf.moved_keys",
        "mindmoe.conf.ranges",
        "mindmoe.model",
        "mindmoe.model.dsa_config",
        "mindmoe.model.moe_config",
        "mindmoe.model.records",
    )
    assert result.stdout.strip() == str(list(leaf))


def test_every_command_taking_config_keys_checks_for_moved_keys_first():
    """Hydra alone would answer ``Could not override 'model.dispatch'`` without saying where the key went."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    checked = set()
    for prog, target in scripts.items():
        path = REPO / (target.split(":")[0].removeprefix("mindmoe.").replace(".", "/") + ".py")
        if not any(module.split(".")[0] == "hydra" for module in imported_modules(path)):
            continue  # argparse commands (mindmoe-generate, mindmoe-bench) take no config key
        main = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
        calls = [n for n in ast.walk(main) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        names = [call.func.id for call in calls]
        assert "exit_on_moved_keys" in names and "_main" in names, prog
        assert names.index("exit_on_moved_keys") < names.index("_main"), prog  # before Hydra composes
        assert calls[names.index("exit_on_moved_keys")].args[0].value == prog
        checked.add(prog)
    assert {
        "mindmoe-train",
        "mindmoe-data",
        "mindmoe-plan",
        "mindmoe-eval",
        "mindmoe-export",
        "mindmoe-launch",
    } <= checked
