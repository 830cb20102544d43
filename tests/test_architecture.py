"""The package's shape: the import-linter contracts of pyproject.toml hold (layers from the
entry point down to core, the two engines independent, no circle between siblings at any
depth, function-local imports included), every lazily imported kvsim module is declared
where import-linter sees it, and only the entry point sits loose beside the subpackages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvsim"


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _lazy_targets(tree: ast.Module) -> set[str]:
    """kvsim modules named in lazy_module("kvsim....") calls."""
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "lazy_module"
            and node.args and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("kvsim.")}


def _imported_modules(tree: ast.Module) -> set[str]:
    """Every module an import statement of the file names (`from a.b import c` names a.b and
    a.b.c, whichever of them is a module)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_every_lazily_imported_module_is_also_a_visible_import():
    """lazy_module("kvsim.x") is a string import-linter cannot see; the file must also import
    kvsim.x (under TYPE_CHECKING), so the contracts cover it."""
    hidden = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for target in sorted(_lazy_targets(tree) - _imported_modules(tree)):
            hidden.append(f"{path.relative_to(ROOT)}: {target}")
    assert not hidden, hidden


def test_only_the_entry_point_is_loose_beside_the_subpackages():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == ["__main__.py"]
