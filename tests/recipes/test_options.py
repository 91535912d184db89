"""The CLI's options are generated from the stage configs: the same names, defaults and checks as a recipe."""

from __future__ import annotations

import dataclasses

import pytest

from draftsmith.decode.bench import BenchConfig
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.distill.export import ExportConfig
from draftsmith.distill.pipeline import DistillConfig
from draftsmith.pairing.leaderboard import PairConfig
from draftsmith.recipes.cli import GEN_DATA_SETTINGS, build_parser
from draftsmith.recipes.config import Recipe, build, recipe_from_dict
from draftsmith.recipes.options import field_help, leaf_fields, options_to_config

TARGET = "smollm2-135m-instruct"
DERIVED = f"derive:{TARGET}:keep=2"
CONTROLS = {"--help", "--out", "--restart", "--target", "--candidates", "--draft", "--before", "--plain-data"}  # inputs, not settings


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def options_of(verb: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb").choices[verb]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--")}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("verb,cls,section", [("pair", PairConfig, "pair"), ("distill", DistillConfig, "distill"),
                                              ("export", ExportConfig, "export")])
def test_every_recipe_setting_is_a_cli_option_and_back(verb: str, cls: type, section: str) -> None:
    opts = options_of(verb)
    settings = {f.name for _, f, _, _ in leaf_fields(cls)}
    shared = {"prompts", "limit_per_domain", "device"} if verb != "export" else set()
    for name in settings | shared:
        assert flag(name) in opts, f"recipe setting {section}.{name} has no option {flag(name)} in `{verb}`"
    aliases = {"--lora", "--early-stop", "--format", "--gguf-type"}
    negations = {o for o in opts if o.startswith("--no-") and "--" + o.removeprefix("--no-") in opts}
    for opt in opts - CONTROLS - aliases - negations:
        name = opt.removeprefix("--").replace("-", "_")
        assert name in settings | shared, f"`{verb} {opt}` is no recipe setting"


def test_cli_and_recipe_resolve_to_the_same_settings() -> None:
    args = parse("distill", "--target", TARGET, "--draft", DERIVED, "--steps", "7", "--loss", "rkl", "--lr", "3e-4",
                 "--lora-r", "8", "--teacher", "cache", "--mixed-precision", "bf16", "--data", "mixed", "--mix", "0.25",
                 "--speculative-data", "--out", "x")
    from_cli = options_to_config(DistillConfig, args)
    recipe = recipe_from_dict({
        "name": "r", "target": TARGET, "pair": {"candidates": [DERIVED]},
        "distill": {"draft": DERIVED, "data": "mixed", "mix": 0.25, "speculative_data": True,
                    "train": {"steps": 7, "loss": "rkl", "lr": 3e-4, "lora_r": 8, "teacher": "cache",
                              "mixed_precision": "bf16"}},
    })
    assert from_cli == recipe.distill
    args = parse("pair", "--target", TARGET, "--candidates", f"{TARGET},derive:{TARGET}:layers=0,1,2",
                 "--prompts-per-domain", "3", "--validate", "1", "--draft-quant", "none", "--temperature", "0.5",
                 "--out", "x")
    cfg = options_to_config(PairConfig, args, {"candidates": [TARGET, f"derive:{TARGET}:layers=0,1,2"]})
    assert cfg == build(PairConfig, {"candidates": [TARGET, f"derive:{TARGET}:layers=0,1,2"], "prompts_per_domain": 3,
                                     "validate": 1, "draft_quant": None, "temperature": 0.5})
    args = parse("export", "--draft", "d", "--target", "t", "--gguf-types", "f16,q8_0", "--format", "gguf",
                 "--check-llama-cpp", "--out", "x")
    assert options_to_config(ExportConfig, args) == ExportConfig(formats=["gguf"], gguf_types=["f16", "q8_0"],
                                                                 check_llama_cpp=True)


def test_untouched_options_give_the_dataclass_defaults() -> None:
    assert options_to_config(DistillConfig, parse("distill", "--target", TARGET, "--draft", DERIVED, "--out", "x")) \
        == DistillConfig(draft=DERIVED)
    assert options_to_config(BenchConfig, parse("bench")) == BenchConfig()
    assert options_to_config(ExportConfig, parse("export", "--draft", "d", "--target", "t", "--out", "x")) \
        == ExportConfig()
    assert options_to_config(BenchConfig, parse("bench", "--k", "3,5", "--no-hf-modes")) \
        == BenchConfig(k=[3, 5], hf_modes=False)
    assert options_to_config(BenchConfig, parse("bench", "--policy", "K=8 stop<0.6 siblings=2")) \
        == BenchConfig(policy=["K=8 stop<0.6 siblings=2"])
    with pytest.raises(DraftsmithError, match="expected 'K=N"):
        options_to_config(BenchConfig, parse("bench", "--policy", "K=8 halt<0.6"))


def test_gen_data_takes_only_data_settings_under_their_names_and_old_flags_still_work() -> None:
    opts = options_of("gen-data")
    for name in GEN_DATA_SETTINGS:
        assert flag(name) in opts
    assert "--steps" not in opts and "--loss" not in opts
    args = parse("gen-data", "--target", TARGET, "--draft", DERIVED, "--plain-data", "--batch-size", "3", "--out", "x")
    cfg = options_to_config(DistillConfig, args)
    assert cfg.speculative_data is False and cfg.gen_batch_size == 3


@pytest.mark.parametrize("argv,needle", [
    (("distill", "--target", TARGET, "--draft", DERIVED, "--steps", "0", "--out", "x"), "steps"),
    (("distill", "--target", TARGET, "--draft", DERIVED, "--data", "web", "--out", "x"), "data must be one of"),
    (("pair", "--candidates", TARGET, "--validate", "-1", "--out", "x"), "validate must be >= 0"),
    (("export", "--draft", "d", "--target", "t", "--gguf-types", "q4", "--out", "x"), "GGUF type q4"),
])
def test_a_bad_value_is_the_same_one_line_error_as_in_a_recipe(argv, needle) -> None:
    args = parse(*argv)
    cls = {"distill": DistillConfig, "pair": PairConfig, "export": ExportConfig}[argv[0]]
    extra = {"candidates": [TARGET]} if argv[0] == "pair" else None
    with pytest.raises(DraftsmithError) as e:
        options_to_config(cls, args, extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_every_setting_is_described_once_in_its_class() -> None:
    """The help text of an option is its field's comment: every stage setting has one."""
    for cls in (PairConfig, DistillConfig, ExportConfig, BenchConfig, Recipe):
        helps = field_help(cls)
        sections = ("PairConfig", "DistillConfig", "ValidateConfig", "ExportConfig", "TrainConfig")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in helps and f.type not in sections]
        assert not missing, (cls.__name__, missing)


def test_a_list_option_given_twice_keeps_both() -> None:
    """`--policy A --policy B` times both policies (a second flag used to replace the first without a word);
    comma lists and repeated flags mix."""
    from draftsmith.pairing.grid import GridConfig

    args = parse("grid", "--target", TARGET, "--draft", DERIVED, "--k", "1", "--k", "2,3",
                 "--policy", "K=6 stop<0.6 siblings=2", "--policy", "K=6 stop<0.6 siblings=2 lookup=4")
    cfg = options_to_config(GridConfig, args)
    assert cfg.k == [1, 2, 3]
    assert cfg.policy == ["K=6 stop<0.6 siblings=2", "K=6 stop<0.6 siblings=2 lookup=4"]
    assert options_to_config(GridConfig, parse("grid", "--target", TARGET, "--draft", DERIVED, "--k", "4")).k == [4]
