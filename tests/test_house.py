"""The house rules that keep the code base readable, checked on the source: no function in the packages runs over
80 lines, and imports only flow downward (recipes -> distill -> pairing -> decode)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("decode", "pairing", "distill", "recipes")  # each may import only those before it in this order
MAX_LINES = 80


def _modules(pkg: str):
    for path in sorted((ROOT / pkg).rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_function_runs_over_80_lines(pkg: str) -> None:
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules(pkg) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, long


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_only_flow_downward(pkg: str) -> None:
    above = set(PACKAGES[PACKAGES.index(pkg) + 1:])
    bad = []
    for path, tree in _modules(pkg):
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in above]
    assert not bad, bad
