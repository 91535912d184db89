"""The wheel is the package a user installs: one import name (`draftsmith`) and every file the code reads at run
time (the native kernel's source, the built-in prompts and recipes) inside it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("decode", "pairing", "distill", "recipes")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: the venv's setuptools builds it, nothing is fetched
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    (found,) = out.glob("draftsmith-*.whl")
    return found


def test_the_wheel_installs_one_import_name_with_every_tracked_package_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"draftsmith"}, tops  # no top-level decode/, pairing/, distill/ or recipes/
    tracked = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    missing = [f for f in tracked if f"draftsmith/{f}" not in names]
    assert not missing, missing
    for runtime_file in ("draftsmith/decode/runtime/csrc/dsk.c", "draftsmith/recipes/quickstart.yaml",
                         "draftsmith/decode/prompts/code.jsonl", "draftsmith/decode/prompts/test/chat.jsonl"):
        assert runtime_file in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "draftsmith = draftsmith.recipes.cli:main" in entry
