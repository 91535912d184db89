"""The runner's fresh process for stages that time decoders: a stage body really runs in another process, its
result and its errors come back, and `run_recipe` uses it for validate only after another stage ran in this one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.recipes import runner
from draftsmith.recipes.config import recipe_from_dict
from draftsmith.recipes.runner import RunFolder, run_recipe, run_stage_fresh


def _pid_stage(recipe, run: RunFolder) -> dict:  # module level: a spawned process imports it by name
    return {"pid": os.getpid(), "out": str(run.out), "name": recipe.name}


def _failing_stage(recipe, run: RunFolder) -> dict:
    raise DraftsmithError(f"validate: no trained head in {run.out}")


def _recipe():
    return recipe_from_dict({"name": "fresh", "target": "smollm2-135m-instruct",
                             "pair": {"candidates": ["derive:smollm2-135m-instruct:keep=4"]}}, check_models=False)


def test_a_fresh_stage_runs_in_another_process_and_returns_its_result(tmp_path: Path) -> None:
    got = run_stage_fresh(_pid_stage, _recipe(), RunFolder(tmp_path))
    assert got["pid"] != os.getpid()
    assert got == {"pid": got["pid"], "out": str(tmp_path), "name": "fresh"}


def test_a_fresh_stage_error_comes_back_as_itself(tmp_path: Path) -> None:
    with pytest.raises(DraftsmithError, match="no trained head in"):
        run_stage_fresh(_failing_stage, _recipe(), RunFolder(tmp_path))


@pytest.mark.parametrize(("stages", "fresh"), [(["pair", "validate"], ["validate"]), (["validate"], []),
                                               (["pair", "distill", "export"], [])])
def test_validate_gets_a_fresh_process_only_after_another_stage_ran_here(tmp_path: Path, monkeypatch, stages,
                                                                         fresh) -> None:
    in_child, in_place = [], []

    def fake_fresh(func, recipe, run):
        in_child.append(func.__name__)
        return {}

    def body(name):
        def stage(recipe, run):
            in_place.append(name)
            return {}
        stage.__name__ = name
        return stage

    monkeypatch.setattr(runner, "run_stage_fresh", fake_fresh)
    monkeypatch.setattr(runner, "STAGE_FUNCS", {s: body(s) for s in runner.STAGE_FUNCS})
    monkeypatch.setattr(runner, "write_report", lambda out: None)
    run_recipe(_recipe(), tmp_path / "run", stages=stages, say=lambda line: None)
    assert in_child == fresh
    assert in_place == [s for s in stages if s not in fresh]
