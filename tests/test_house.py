"""The house rules that keep the code base readable, checked on the source: no function in the packages runs over
80 lines; every import of the project goes through its one import name, `draftsmith`; imports only flow downward
(recipes -> distill -> pairing -> decode, and inside decode, the decoder -> decode.runtime); no import circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
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


def _imports(tree: ast.Module, module: str, is_package: bool):
    """(line, absolute module name) of every import in `tree`, function-level ones included, relative ones resolved;
    those under `if TYPE_CHECKING:` are left out (they never run)."""
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + [base] if base else parts)
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{a.name}") for a in node.names)


def _graph() -> dict[str, set[str]]:
    """The project's modules (`draftsmith.decode.runtime.lean`, ...) -> the project modules each imports."""
    files = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(("draftsmith",) + parts[: -1 if parts[-1] == "__init__" else None])] = path
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        for _, target in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
    return {name: edges[name] for name in files}


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_use_the_one_import_name_and_only_flow_downward(pkg: str) -> None:
    above = set(PACKAGES[PACKAGES.index(pkg) + 1:])
    bad = []
    for path, tree in _modules(pkg):
        module = ".".join(("draftsmith",) + path.relative_to(ROOT).with_suffix("").parts)
        for line, name in _imports(tree, module, path.name == "__init__.py"):
            where = f"{path.relative_to(ROOT)}:{line}"
            if name.split(".")[0] in PACKAGES:
                bad.append(f"{where} imports {name}: the installed name is draftsmith.{name}")
            elif name.startswith("draftsmith.") and name.split(".")[1] in above:
                bad.append(f"{where} imports {name}, a package above {pkg}")
            elif (module.startswith("draftsmith.decode.runtime") and name.startswith("draftsmith.decode.")
                  and not name.startswith("draftsmith.decode.runtime")):
                bad.append(f"{where} imports {name}: decode.runtime is the floor, it imports nothing above it")
    assert not bad, bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_project_has_no_import_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail
    assert _cycles(_graph()) == []


def test_importing_the_decoder_loads_no_kernel() -> None:
    code = ("import sys, draftsmith.decode.speculative\n"
            "print(sorted(m for m in sys.modules if m.startswith('draftsmith.decode.runtime.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for heavy in ("native", "kernels", "lean", "quant", "plan"):
        assert f"draftsmith.decode.runtime.{heavy}'" not in loaded, loaded
