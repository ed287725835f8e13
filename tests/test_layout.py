"""The layout rules that keep the standard library's `platform` module importable."""

import subprocess
import sys

from conftest import REPO


def test_platform_folder_is_not_a_package():
    assert not (REPO / "platform" / "__init__.py").exists()


def test_stdlib_platform_still_works_from_the_repository_root():
    code = "import platform, towerflow; print(platform.system()); print(platform.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    system, location = out.stdout.split()
    assert system
    assert not location.startswith(str(REPO / "platform"))


def test_models_and_pipelines_are_not_installed_packages():
    code = "import importlib.util as u; print(u.find_spec('models'))"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_data_and_checkpoint_import_nothing_of_the_runtime():
    """They share types with it through towerflow/shared_types.py, never its internals."""
    import ast

    package = REPO / "platform" / "towerflow"
    found = []
    for layer in ("data", "checkpoint"):
        for path in sorted((package / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                found += [
                    f"{path.relative_to(package)}: {n}" for n in names if n.startswith("towerflow.runtime")
                ]
    assert found == []


def test_only_the_command_line_prints():
    """The library logs (towerflow/messages.py says how its lines show); the CLI decides what to print."""
    import ast

    package = REPO / "platform" / "towerflow"
    found = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in sorted(package.rglob("*.py"))
        if path.parent.name != "cli" and path.name != "__main__.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    ]
    assert found == []
