"""mindmoe installs as one package, ``mindmoe``: a user's own ``train.py``, ``model.py`` or ``data/`` package
cannot shadow ours, nothing is importable as a bare ``model`` or ``train``, and a non-editable install ships
everything a run needs (the conf YAML, the bundled samples including the tiny base, the cluster script)."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers.processes import free_port, kill_tree
from tests.helpers.runs import REPO, losses_by_step
from tests.helpers.tiny_run import TINY_RUN

PACKAGES = ("model", "data", "train", "launch", "conf", "bench")
BIN = Path(sys.executable).parent
# What a source checkout holds that an install must not copy (and that a build would write into).
NOT_SHIPPED = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist", "runs", "outputs", "multirun")


def environment(**changes) -> dict:
    """This process's environment with ``changes``; a change to None removes the variable."""
    return {name: value for name, value in dict(os.environ, **changes).items() if value is not None}


@pytest.fixture
def user_project(tmp_path):
    """A project directory of a user: its own train.py, model.py and data package, which must never run."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    for module in ("train.py", "model.py", "data/__init__.py"):
        (project / module).write_text(f'raise RuntimeError("the user\'s {module} was imported by mindmoe")\n')
    return project


def test_a_user_project_with_train_model_and_data_does_not_change_a_run(user_project, tmp_path, data_cache):
    run_dir = tmp_path / "run"
    command = [str(BIN / "mindmoe-train"), "train.max_steps=2", f"hydra.run.dir={run_dir}"]
    command += [f"data.cache_dir={data_cache}", *TINY_RUN]
    result = subprocess.run(command, cwd=user_project, env=environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(losses_by_step(run_dir)) == [1, 2]


@pytest.mark.msrun
def test_two_workers_launched_from_a_user_project_succeed(user_project, tmp_path, data_cache):
    run_dir = tmp_path / "run"
    command = [str(BIN / "mindmoe-launch"), "launch.procs_per_node=2", f"launch.master_port={free_port()}"]
    command += ["train.max_steps=2", f"hydra.run.dir={run_dir}", f"data.cache_dir={data_cache}", *TINY_RUN]
    launcher = subprocess.Popen(
        command, cwd=user_project, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = launcher.communicate(timeout=900)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert sorted(losses_by_step(run_dir)) == [1, 2]
    assert sorted(p.name for p in (run_dir / "msrun").glob("worker_*.log")) == ["worker_0.log", "worker_1.log"]


def test_pyproject_lists_every_package_of_the_repository():
    """``[tool.setuptools] packages`` is explicit (the folders map onto ``mindmoe.<folder>``): a new
    subpackage that is not listed would be missing from ``pip install .`` while the editable install works."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"mindmoe"} | {
        ".".join(["mindmoe", *init.parent.relative_to(REPO).parts])
        for package in PACKAGES
        for init in (REPO / package).rglob("__init__.py")
    }
    assert found <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``pip install .`` (not editable) of a copy of the repository into a target directory."""
    source = tmp_path_factory.mktemp("source") / "mindmoe"
    shutil.copytree(REPO, source, ignore=NOT_SHIPPED)
    target = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*command, "--target", str(target), str(source)], check=True, capture_output=True, timeout=600)
    return target


@pytest.fixture
def neutral_dir(tmp_path):
    directory = tmp_path / "elsewhere"
    directory.mkdir()
    return directory


def run_python(code_or_args, cwd, **env):
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=environment(**env), capture_output=True, text=True, timeout=900
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_no_bare_package_name_is_importable_from_the_install(installed, neutral_dir, package):
    result = run_python(f"import {package}", neutral_dir, PYTHONPATH=str(installed))
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_bare_package_name_is_importable_from_the_editable_install(neutral_dir, package):
    result = run_python(f"import {package}", neutral_dir, PYTHONPATH=None)
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, result.stderr[-2000:]


def test_mindmoe_model_imports_from_the_install(installed, neutral_dir):
    result = run_python(
        "import mindmoe, mindmoe.model; print(mindmoe.__file__)", neutral_dir, PYTHONPATH=str(installed)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert Path(result.stdout.strip()).resolve() == (installed / "mindmoe" / "__init__.py").resolve()


def files_under(root: Path, pattern: str = "*") -> set:
    return {
        path.relative_to(root).as_posix()
        for path in root.rglob(pattern)
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".py"
    }


def test_install_ships_the_conf_yaml_the_samples_with_the_tiny_base_and_the_cluster_script(installed):
    shipped = installed / "mindmoe"
    assert files_under(REPO / "conf", "*.yaml") and files_under(REPO / "conf", "*.yaml") == files_under(
        shipped / "conf", "*.yaml"
    )
    samples = files_under(REPO / "data" / "samples")
    assert {"tiny_base/config.json", "tiny_base/model.safetensors", "tiny_base/tokenizer.model"} <= samples
    assert samples == files_under(shipped / "data" / "samples")
    for name in samples:
        assert (shipped / "data" / "samples" / name).read_bytes() == (REPO / "data" / "samples" / name).read_bytes()
    assert (shipped / "launch" / "cluster.sh").read_bytes() == (REPO / "launch" / "cluster.sh").read_bytes()
    assert not (installed / "tests").exists() and not (installed / "tools").exists()


@pytest.mark.slow
def test_lora_business_recipe_runs_from_the_install(installed, neutral_dir, tmp_path, data_cache):
    run_dir = tmp_path / "lora"
    args = ["-m", "mindmoe.train.cli", "recipe=lora_business", "train.max_steps=1", f"hydra.run.dir={run_dir}"]
    args += ["train.eval_every=0", "train.eval_batches=2", "train.progress_bar=false", f"data.cache_dir={data_cache}"]
    # Shorter windows keep it quick; the longer conversations are cut (and counted).
    args += ["data.seq_len=128", "data.sft_overlong=truncate"]
    result = run_python(args, neutral_dir, PYTHONPATH=str(installed))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resolved = (run_dir / "resolved_config.yaml").read_text()
    assert str((installed / "mindmoe" / "data" / "samples" / "tiny_base").resolve()) in resolved
    assert (run_dir / "checkpoints" / "step_000001" / "adapter" / "adapter_config.json").is_file()
