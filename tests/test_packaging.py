"""Packaging and structure: the wheel ships every mapping file and every package; the package has no import cycle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "reshard"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(out), str(REPO)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path_factory.mktemp("build-cwd"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("reshard-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_holds_every_package_and_mapping(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(REPO)) for p in PACKAGE.rglob("__init__.py")}
    for package in packages:
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel (pyproject's packages)"
    for toml in (REPO / "mappings").glob("*.toml"):
        assert f"reshard/mappings/{toml.name}" in names


def test_installed_wheel_lists_every_mapping_from_another_folder(wheel, tmp_path):
    target = tmp_path / "installed"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(target))
    where = subprocess.run([sys.executable, "-c", "import reshard; print(reshard.__file__)"], capture_output=True,
                           text=True, env=env, cwd=elsewhere)
    assert where.stdout.strip() == str(target / "reshard" / "__init__.py"), where.stdout + where.stderr
    listed = subprocess.run([str(target / "bin" / "reshard"), "mappings", "list"], capture_output=True, text=True,
                            env=env, cwd=elsewhere, timeout=120)
    assert listed.returncode == 0, listed.stderr
    shipped = sorted(p.stem for p in (REPO / "mappings").glob("*.toml"))
    assert shipped and [line.split(":")[0] for line in listed.stdout.splitlines()] == shipped


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every reshard module ``path`` imports, at module level or inside functions (lazy imports count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycle():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imports(path, name, set(files)) for name, path in files.items()}
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert graph["reshard.conversion"], "the walker found no imports: it is broken"
    assert cycles == [], f"import cycles: {cycles}"
