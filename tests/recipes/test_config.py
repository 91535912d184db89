"""Recipes load into typed configs: every shipped YAML validates; bad keys, types, values and models are
one-line errors naming the file and the key; key=value overrides fill nested settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.recipes.config import Recipe, apply_override, dump_recipe, load_recipe, recipe_from_dict

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
DRAFTSMITH = Path(sys.executable).parent / "draftsmith"

MINIMAL = {"name": "r", "target": "smollm2-135m-instruct",
           "pair": {"candidates": ["derive:smollm2-135m-instruct:keep=2"]}}


def test_the_three_promised_recipes_ship() -> None:
    assert {p.name for p in SHIPPED} >= {"quickstart.yaml", "qwen-coder.yaml", "gpu.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_opens_with_its_run_command(path: Path) -> None:
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe) and recipe.name == path.stem
    head = path.read_text().splitlines()[:12]
    assert any(f"draftsmith run recipes/{path.name}" in line for line in head), "first lines give the run command"
    assert any("minute" in line or "hour" in line for line in head), "first lines give the expected runtime"
    # the resolved recipe round-trips: what the run folder saves loads back to the same config
    assert recipe_from_dict(yaml.safe_load(dump_recipe(recipe))) == recipe


def write(tmp_path: Path, data: dict | str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def with_(key: str, value) -> dict:
    data = yaml.safe_load(yaml.safe_dump(MINIMAL))
    apply_override(data, f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
    return data


@pytest.mark.parametrize(
    "data,needles",
    [
        (with_("distill.train.stepz", 3), ["distill.train.stepz", "unknown key", "'steps'"]),
        (with_("pairr", {}), ["pairr", "unknown key", "'pair'"]),
        (with_("distill.train.steps", "many"), ["distill.train.steps", "expected int", "'many'"]),
        (with_("distill.train.steps", 0), ["distill.train", "steps", "out of range"]),
        (with_("distill.train.loss", "kl"), ["distill.train", "loss"]),
        (with_("distill.data", "web"), ["distill", "distill.data", "web"]),
        (with_("export.formats", ["onnx"]), ["export", "onnx"]),
        (with_("pair.candidates", "derive:nope:keep=2"), ["pair.candidates[0]", "unknown model 'nope'"]),
        (with_("target", "no-such-model"), ["target", "unknown model 'no-such-model'"]),
        (with_("distill.train", 5), ["distill.train", "expected a mapping"]),
        ({"name": "r", "pair": MINIMAL["pair"]}, ["target", "missing"]),
        ("name: [unclosed", ["not valid YAML", "line 1"]),
        ("- just\n- a list\n", ["a recipe is a YAML mapping"]),
    ],
)
def test_bad_recipes_are_one_line_errors_naming_file_and_key(tmp_path: Path, data, needles) -> None:
    path = write(tmp_path, data)
    with pytest.raises(DraftsmithError) as e:
        load_recipe(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_overrides_fill_nested_settings_with_yaml_types(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    r = load_recipe(path, ["distill.train.steps=7", "distill.train.lr=3e-4", "export.formats=[hf]",
                           "pair.candidates=derive:smollm2-135m-instruct:keep=1,derive:smollm2-135m-instruct:keep=3",
                           "prompts.file=null", "validate.draft_quant=null"])
    assert r.distill.train.steps == 7 and r.distill.train.lr == 3e-4 and r.export.formats == ["hf"]
    assert r.pair.candidates == ["derive:smollm2-135m-instruct:keep=1", "derive:smollm2-135m-instruct:keep=3"]
    assert r.validate.draft_quant is None
    assert r.distill.train.batch_size == 4  # untouched settings keep the dataclass defaults
    with pytest.raises(DraftsmithError, match=r"override 'steps': expected key=value"):
        load_recipe(path, ["steps"])
    with pytest.raises(DraftsmithError, match=r"distill\.train\.stepz: unknown key; did you mean 'steps'"):
        load_recipe(path, ["distill.train.stepz=3"])


def test_a_model_path_is_accepted_and_a_missing_prompt_file_is_not(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    r = recipe_from_dict({**MINIMAL, "target": str(folder), "pair": {"candidates": [f"derive:{folder}:keep=1"]}})
    assert r.target == str(folder)
    with pytest.raises(DraftsmithError, match=r"prompts\.file: no such file"):
        recipe_from_dict({**MINIMAL, "prompts": {"file": str(tmp_path / "none.jsonl")}})


def test_cli_run_with_a_bad_recipe_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path, with_("distill.train.stepz", 3))
    r = subprocess.run([str(DRAFTSMITH), "run", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "distill.train.stepz" in lines[0] and str(path) in lines[0], r.stderr


def test_a_pruned_candidate_needs_its_kept_ids_and_is_never_distilled(tmp_path: Path) -> None:
    kept = tmp_path / "kept.json"
    spec = f"prune:smollm2-135m-instruct:vocab={kept}"
    with pytest.raises(DraftsmithError, match=r"pair\.candidates\[0\]: .*no kept-vocabulary file"):
        recipe_from_dict({**MINIMAL, "pair": {"candidates": [spec]}})
    kept.write_text("{}")  # read, and checked against the target, when the pair stage opens it
    assert recipe_from_dict({**MINIMAL, "pair": {"candidates": [spec]}}).pair.candidates == [spec]
    with pytest.raises(DraftsmithError, match=r"pair\.candidates\[0\]: .*unknown model 'nope'"):
        recipe_from_dict({**MINIMAL, "pair": {"candidates": [f"prune:nope:vocab={kept}"]}})
    with pytest.raises(DraftsmithError, match="distill.draft: distillation trains a whole model"):
        recipe_from_dict({**MINIMAL, "distill": {"draft": spec}})


def test_a_recipe_takes_every_spec_the_cli_takes(tmp_path: Path) -> None:
    """int4:, prune: (of an int4 copy, calibrated) and head: candidates validate as the CLI reads them
    (`decode.spec.DraftSpec`); their files are checked, and the target must be a whole model."""
    kept, calib, head = tmp_path / "kept.json", tmp_path / "calib.json", tmp_path / "head"
    kept.write_text("{}"), calib.write_text("{}"), head.mkdir()
    (head / "config.json").write_text("{}"), (head / "model.safetensors").write_bytes(b"")
    specs = ["int4:smollm2-135m-instruct", f"int4:smollm2-135m-instruct:calib={calib}",
             f"prune:int4:smollm2-135m-instruct:vocab={kept}", f"head:{head}"]
    assert recipe_from_dict({**MINIMAL, "pair": {"candidates": specs}}).pair.candidates == specs
    with pytest.raises(DraftsmithError, match=r"pair\.candidates\[0\]: .*no head at"):
        recipe_from_dict({**MINIMAL, "pair": {"candidates": [f"head:{tmp_path / 'none'}"]}})
    with pytest.raises(DraftsmithError, match="target: .*whole model"):
        recipe_from_dict({**MINIMAL, "target": "int4:smollm2-135m-instruct"})
    # the served int4 draft trains (LoRA over its int4 weights); a pruned one or one with an adapter does not
    assert recipe_from_dict({**MINIMAL, "distill": {"draft": specs[0]}}).distill.draft == specs[0]
    with pytest.raises(DraftsmithError, match="distill.draft: distillation trains a whole model or its int4 copy"):
        recipe_from_dict({**MINIMAL, "distill": {"draft": specs[2]}})


def test_the_fastest_kind_is_now_the_race_stage_and_says_so() -> None:
    with pytest.raises(DraftsmithError, match="fastest: the fastest kind is now the race stage"):
        recipe_from_dict({**MINIMAL, "fastest": {"sizes": [8]}})
    with pytest.raises(DraftsmithError, match="distill.draft: 'fastest' is now the race stage"):
        recipe_from_dict({**MINIMAL, "distill": {"draft": "fastest"}})
    assert "race" not in recipe_from_dict(MINIMAL).stages  # a recipe names the race stage to run it
    assert recipe_from_dict({**MINIMAL, "stages": ["race", "validate"], "race": {"top": 2}}).race.top == 2


def test_a_built_in_recipe_runs_by_name_from_any_folder(tmp_path, monkeypatch) -> None:
    from draftsmith.recipes.config import built_in_recipes, recipe_path

    monkeypatch.chdir(tmp_path)  # an installed draftsmith, no checkout: `draftsmith run quickstart`
    assert "quickstart" in built_in_recipes()
    assert load_recipe("quickstart", check_models=False).name == "quickstart"
    assert recipe_path("mine.yaml") == Path("mine.yaml")  # a file name stays a file name (its own error if absent)
    with pytest.raises(DraftsmithError, match="nor a built-in recipe .*quickstart"):
        load_recipe("quickstrat", check_models=False)
