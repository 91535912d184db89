"""The wheel is the package a user installs: one import name (`draftsmith`) and every file the code reads at run
time (the native kernel's source, the built-in prompts and recipes) inside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("decode", "pairing", "distill", "recipes")


def _tracked() -> list[str]:
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.split() if done.returncode == 0 else []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from the tracked files alone (copied out: nothing built or left over in the checkout
    counts, and the build leaves nothing in it), by the venv's setuptools with nothing fetched."""
    tracked = _tracked()
    if not tracked:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in tracked:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=600)
    (found,) = out.glob("draftsmith-*.whl")
    return found


def test_the_wheel_installs_one_import_name_with_every_tracked_package_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"draftsmith"}, tops  # no top-level decode/, pairing/, distill/ or recipes/
    tracked = [f for f in _tracked() if f.split("/")[0] in PACKAGES]
    missing = [f for f in tracked if f"draftsmith/{f}" not in names]
    assert not missing, missing
    for runtime_file in ("draftsmith/decode/runtime/csrc/dsk.c", "draftsmith/recipes/quickstart.yaml",
                         "draftsmith/decode/prompts/code.jsonl", "draftsmith/decode/prompts/test/chat.jsonl"):
        assert runtime_file in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "draftsmith = draftsmith.recipes.cli:main" in entry
