"""Layering of the packages, read from the source with ``ast`` (nothing is imported).

The rules (docs/architecture.md, "Layering"): ``model/`` and ``data/`` are leaves that import no other part of
the pipeline (a model can be built and a corpus prepared without the trainer); ``train/`` and ``launch/`` do not
import each other both ways (the launcher validates a layout without importing the trainer, or the trainer does
not import the launcher). Imports inside functions count: a lazy import is still a dependency.
"""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("model", "data", "train", "launch", "conf", "bench")
FORBIDDEN = {
    "model": {"data", "train", "launch"},
    "data": {"model", "train", "launch"},
}
MAX_SOURCE_LINES = 400
# Directories that hold no source of the project: virtual environments, build output, run directories.
NOT_SOURCE = {"build", "dist", "runs", "outputs", "mindmoe.egg-info", "__pycache__"}


def python_files(root: Path):
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(REPO).parts
        if not any(part.startswith(".") or part in NOT_SOURCE for part in relative[:-1]):
            yield path


def module_parts(path: Path, root: Path) -> list:
    """``model/hf/export.py`` -> ``["model", "hf", "export"]``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path, root: Path = REPO) -> list:
    """(line, dotted name) of every import in ``path``; relative imports resolved to ``mindmoe.<...>``."""
    parts = module_parts(path, root)
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            found.append((node.lineno, ".".join(["mindmoe", *base, *([node.module] if node.module else [])])))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module))
    return found


def package_edges() -> dict:
    """(importing package, imported package) -> ["file:line imports module", ...] for the six packages."""
    edges = {}
    for package in PACKAGES:
        for path in python_files(REPO / package):
            for line, name in imported_modules(path):
                segments = name.split(".")
                if segments[0] == "mindmoe" and len(segments) > 1 and segments[1] in PACKAGES:
                    if segments[1] != package:
                        where = f"{path.relative_to(REPO)}:{line} imports {name}"
                        edges.setdefault((package, segments[1]), []).append(where)
    return edges


def test_relative_imports_resolve_into_the_mindmoe_namespace(tmp_path):
    source = tmp_path / "model" / "hf" / "export.py"
    source.parent.mkdir(parents=True)
    source.write_text("from ..config import X\nfrom . import weights\nimport mindmoe.data.tokenizer\n")
    init = tmp_path / "model" / "hf" / "__init__.py"
    init.write_text("from .export import export_hf\n")
    expected = [(1, "mindmoe.model.config"), (2, "mindmoe.model.hf"), (3, "mindmoe.data.tokenizer")]
    assert imported_modules(source, tmp_path) == expected
    assert imported_modules(init, tmp_path) == [(1, "mindmoe.model.hf.export")]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_leaf_package_imports_no_other_part_of_the_pipeline(package):
    edges = package_edges()
    violations = [where for target in sorted(FORBIDDEN[package]) for where in edges.get((package, target), [])]
    assert not violations, f"{package}/ must not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(violations)


def test_train_and_launch_do_not_import_each_other_both_ways():
    edges = package_edges()
    train_to_launch, launch_to_train = edges.get(("train", "launch"), []), edges.get(("launch", "train"), [])
    assert not (train_to_launch and launch_to_train), "import cycle between train/ and launch/:\n" + "\n".join(
        train_to_launch + launch_to_train
    )


def test_no_module_imports_a_bare_top_level_package_name():
    """``import model`` would find a user's model.py first: every import goes through ``mindmoe.``."""
    bare = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for package in (*PACKAGES, "tools")
        for path in python_files(REPO / package)
        for line, name in imported_modules(path)
        if name.split(".")[0] in PACKAGES
    ]
    assert not bare, "import these as mindmoe.<package>:\n" + "\n".join(bare)


def test_no_source_file_is_over_the_line_limit():
    too_long = []
    for path in python_files(REPO):
        if path.relative_to(REPO).parts[0] != "tests":
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_SOURCE_LINES:
                too_long.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert not too_long, f"split these into modules of at most {MAX_SOURCE_LINES} lines:\n" + "\n".join(too_long)


def test_no_python_file_cites_a_document_that_is_not_in_the_repository():
    """Comments cite a public source or docs/architecture.md; DESIGN and REFERENCES are not shipped."""
    absent = [name for name in ("DESIGN.md", "REFERENCES.md") if not (REPO / name).exists()]
    citation = re.compile("|".join([*(re.escape(name) for name in absent), r"\bDESIGN §"]))
    cited = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in python_files(REPO)
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if citation.search(line)
    ]
    assert not cited, "cite a public source or docs/architecture.md instead:\n" + "\n".join(cited)
