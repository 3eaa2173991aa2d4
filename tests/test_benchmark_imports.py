"""The scripts in benchmarks/ name what they use from kvpush by import: every such name
must still exist (a script is run now and then, by hand, long after the code it
measures has moved; this catches the move when it happens). Read from the source, so
no script is run."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.rglob("*.py"))


def kvpush_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of each ``from kvpush... import name`` and (module, None) of each
    ``import kvpush...`` in ``path``."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvpush"):
            assert node.module is not None
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names
                      if alias.name.startswith("kvpush")]
    return found


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 20 and any(p.name == "soak.py" for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_what_a_benchmark_imports_from_kvpush_exists(script: Path):
    for module, name in kvpush_imports(script):
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name):
            importlib.import_module(f"{module}.{name}")  # a submodule, else it fails
