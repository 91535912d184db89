"""One recipe run a folder: a second `draftsmith run` on a folder in use refuses in one line and writes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.recipes.runner import run_lock

DRAFTSMITH = Path(sys.executable).parent / "draftsmith"


def test_a_held_folder_refuses_a_second_lock_and_frees_when_released(tmp_path: Path) -> None:
    with run_lock(tmp_path):
        with pytest.raises(DraftsmithError, match="another draftsmith run is working in this folder") as e:
            with run_lock(tmp_path):
                pass
        assert "\n" not in str(e.value) and "pid" in str(e.value)
    with run_lock(tmp_path):  # released: the next run takes it
        pass


def test_a_second_run_on_a_folder_in_use_exits_2_in_one_line_and_touches_nothing(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "target": "smollm2-135m-instruct", "stages": ["pair"],
                                      "pair": {"candidates": ["derive:smollm2-135m-instruct:keep=2"]}}))
    out = tmp_path / "run"
    out.mkdir()
    (out / "state.json").write_text('{"stages": {"pair": {"status": "running"}}}')  # the first run's
    with run_lock(out):  # the first run, holding the folder
        r = subprocess.run([str(DRAFTSMITH), "run", str(recipe), "--out", str(out)], capture_output=True, text=True,
                           timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "another draftsmith run" in lines[0], r.stderr
    assert (out / "state.json").read_text() == '{"stages": {"pair": {"status": "running"}}}'
    assert sorted(p.name for p in out.iterdir()) == [".lock", "state.json"]  # no recipe.yaml, no report
