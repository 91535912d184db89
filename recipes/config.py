"""Recipes as typed configs: one YAML file fills one dataclass per stage, validated on load.

    from draftsmith.recipes.config import load_recipe
    recipe = load_recipe("recipes/quickstart.yaml", ["distill.train.steps=200", "pair.validate=1"])

The dataclasses below are the one source of truth for defaults. Every problem is a one-line
DraftsmithError naming the file and the dotted key: an unknown key (with the closest known one),
a wrong type, a value out of range, a model that is neither a zoo name, a derive spec nor a path.
`key=value` overrides are parsed as YAML scalars (`200` is an int, `null` is None, `[a, b]` a list).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.spec import DraftSpec
from draftsmith.distill.export import ExportConfig
from draftsmith.distill.heads.pipeline import HeadRunConfig
from draftsmith.distill.kinds import is_model_spec
from draftsmith.distill.pipeline import DataConfig, DistillConfig
from draftsmith.pairing.leaderboard import PairConfig
from draftsmith.pairing.race import RaceConfig
from draftsmith.pairing.validate import ValidateConfig

STAGES = ("pair", "data", "distill", "race", "validate", "export")  # data runs only when the recipe's data.n > 0
DEVICES = ("cpu", "cuda")
# recipe keys renamed since the first recipes: an old key gets a one-line error naming the new one
RENAMED = {"pair.limit_per_domain": "pair.prompts_per_domain", "export.gguf_type": "export.gguf_types"}


class RecipeError(DraftsmithError):
    """A recipe problem; the message starts with the file and names the key."""


@dataclass
class Recipe:
    """A whole run: the target, its prompts, where it runs, and one config per stage."""

    name: str  # the run folder's name: runs/<name>/
    target: str  # zoo name, HF folder or .gguf file
    pair: PairConfig
    prompts: str = "code,json,summarize,chat"  # built-in suite names, or a .jsonl/.csv/.parquet file or datasets folder
    limit_per_domain: int | None = None  # keep the first N prompts of each domain (held-out ones included)
    test_prompts: str = ""  # the prompts speedups are reported on (never trained on, never used to choose): a
    # file or suite names; "" = the built-in test split of `prompts` (none for a file: validate then times the
    # held-out dev prompts and says so)
    device: str = "cpu"  # cpu | cuda: where models run (training: where accelerate puts it)
    data: DataConfig = field(default_factory=DataConfig)  # prompts and answers the target writes (n > 0)
    distill: DistillConfig = field(default_factory=DistillConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    head: HeadRunConfig = field(default_factory=HeadRunConfig)  # used when distill.draft is 'head'
    race: RaceConfig = field(default_factory=RaceConfig)  # the race stage: the stock draft, its int4 copy, pruned
    # variants and trained drafts ranked and raced at their walked policies; validate then times their ladder
    stages: list[str] = field(default_factory=lambda: [s for s in STAGES if s != "race"])  # a subset of STAGES

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not self.name or "/" in self.name:
            raise ValueError(f"name must be a plain folder name, got {self.name!r}")
        if not self.prompts:
            raise ValueError("prompts: give built-in suite names (e.g. code,chat) or a file")
        if self.limit_per_domain is not None and self.limit_per_domain < 2:
            raise ValueError(f"limit_per_domain must be >= 2 (some to train on, some held out), "
                             f"got {self.limit_per_domain}")
        bad = [s for s in self.stages if s not in STAGES]
        if bad:
            raise ValueError(f"stages: unknown stage {bad[0]!r} (stages: {', '.join(STAGES)})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- building dataclasses from plain data, with errors that name the key -----------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` checked against the annotation `tp` (int, float, str, bool, list[str], X | None, dataclass)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"{key}: expected a mapping of settings, got {type(value).__name__} {value!r}")
        return build(tp, value, key)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # 'a,b' on the command line is a list too (items parsed as YAML scalars)
            value = [_scalar(v.strip()) for v in value.split(",") if v.strip()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # '--k 3' is the list [3]
        if not isinstance(value, list):
            raise RecipeError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if isinstance(value, tp) and not (tp is not bool and isinstance(value, bool)):
            return value
        raise RecipeError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    raise RecipeError(f"{key}: unsupported setting type {_type_name(tp)}")


def parse_value(text: str) -> Any:
    """A `key=value` value (recipe override or CLI option) read as YAML: '200' is 200, 'null' None, '' None;
    text YAML cannot read stays text."""
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return text


def _scalar(text: str) -> Any:
    value = parse_value(text)
    return value if isinstance(value, (int, float, str, bool)) else text


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """An instance of dataclass `cls` from `data`; unknown keys, wrong types and bad values name the key."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls) if f.init]
    values: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
            raise RecipeError(f"{dotted}: unknown key{hint}")
        values[key] = _coerce(value, hints[key], dotted)
    missing = [f.name for f in fields(cls) if f.init and f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise RecipeError(f"{prefix + '.' if prefix else ''}{missing[0]}: missing (required)")
    try:
        return cls(**values)
    except (ValueError, DraftsmithError) as e:
        if isinstance(e, RecipeError):
            raise
        msg = str(e)
        first = msg.split(" ", 1)[0].split(":", 1)[0]
        if first in known:  # 'data must be ...' from the config's own check: name the dotted key
            raise RecipeError(f"{prefix + '.' if prefix else ''}{msg}") from None
        raise RecipeError(f"{prefix or cls.__name__}: {msg}") from None


# --- models named in a recipe ---------------------------------------------------------------------


def check_model_spec(spec: str, key: str, *, target: bool = False) -> None:
    """A draft spec the CLI takes (`decode.spec.DraftSpec`: a zoo name, an HF folder / .gguf file, derive:, int4:,
    prune: or head:), each file and model it names existing; a target is a whole model (zoo name, folder, .gguf)."""
    try:
        d = DraftSpec.parse(spec)
        d.check(set(zoo.known_models()))
    except DraftsmithError as e:
        raise RecipeError(f"{key}: {e}") from None
    if target and d.kind != "model":
        raise RecipeError(f"{key}: {spec!r}: the target is a whole model: a zoo name "
                          f"({', '.join(zoo.known_models())}), an HF folder with config.json or a .gguf file")


def _check_models(recipe: Recipe) -> None:
    check_model_spec(recipe.target, "target", target=True)
    for i, spec in enumerate(recipe.pair.candidates):
        check_model_spec(spec, f"pair.candidates[{i}]")
    if is_model_spec(recipe.distill.draft):
        check_model_spec(recipe.distill.draft, "distill.draft")
        d = DraftSpec.parse(recipe.distill.draft)
        if d.kind == "prune" or d.adapter is not None:
            raise RecipeError("distill.draft: distillation trains a whole model or its int4 copy (int4:MODEL), not a "
                              "vocabulary-pruned one or one with an adapter: name its MODEL (prune the result: "
                              "prune:RUN/distill/best:vocab=FILE)")
    if "race" in recipe.stages and recipe.race.base != "best":
        check_model_spec(recipe.race.base, "race.base")
    check_prompts(recipe.prompts, "prompts")
    if recipe.test_prompts:
        check_prompts(recipe.test_prompts, "test_prompts")


def check_prompts(source: str, key: str) -> None:
    """Suite names, or an existing file / folder: anything else is a one-line error naming the key."""
    from draftsmith.decode.prompts import SUITES

    names = [n.strip() for n in source.split(",") if n.strip()]
    if names and all(n in SUITES for n in names):
        return
    if not names or not Path(source).expanduser().exists():
        raise RecipeError(f"{key}: no such file {source!r} (nor built-in suite names: code, json, summarize, chat)")


# --- loading ----------------------------------------------------------------------------------------


def apply_override(data: dict[str, Any], override: str) -> None:
    """'distill.train.steps=200' -> data['distill']['train']['steps'] = 200 (value parsed as YAML)."""
    if "=" not in override:
        raise RecipeError(f"override {override!r}: expected key=value, e.g. distill.train.steps=200")
    key, text = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {override!r}: bad key {key!r}")
    value = parse_value(text)
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Older recipes: `prompts: {suite|file, limit_per_domain}` becomes `prompts` + `limit_per_domain`; renamed keys
    are one-line errors naming the new key."""
    data = dict(data)
    old = data.get("prompts")
    if isinstance(old, dict):
        old = dict(old)
        file = old.pop("file", None)
        if file is not None:
            check_prompts(str(file), "prompts.file")
        source = file or old.pop("suite", None)
        if "limit_per_domain" in old:
            data.setdefault("limit_per_domain", old.pop("limit_per_domain"))
        old.pop("suite", None)
        if old:
            raise RecipeError(f"prompts.{next(iter(old))}: unknown key (prompts is now one setting: suite names "
                              "or a file, with limit_per_domain beside it)")
        if source is not None:
            data["prompts"] = source
        else:
            data.pop("prompts")
    if "fastest" in data:
        raise RecipeError("fastest: the fastest kind is now the race stage: put race in stages (e.g. [race, validate]) "
                          "and its settings under race: (race -> top, race_prompts -> timed_prompts, race_reference -> "
                          "reference)")
    if isinstance(data.get("distill"), dict) and data["distill"].get("draft") == "fastest":
        raise RecipeError("distill.draft: 'fastest' is now the race stage (stages: [race, validate], settings under "
                          "race:); a distill stage trains")
    for dotted, new in RENAMED.items():
        section, key = dotted.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            raise RecipeError(f"{dotted}: renamed to {new}")
    return data


def recipe_from_dict(data: dict[str, Any], overrides: list[str] = (), *, check_models: bool = True) -> Recipe:
    data = dict(data)
    for o in overrides:
        apply_override(data, o)
    data = _upgrade(data)
    recipe = build(Recipe, data)
    if check_models:
        _check_models(recipe)
    return recipe


BUILT_IN = Path(__file__).resolve().parent  # the recipes that ship in the package: `draftsmith run quickstart`


def built_in_recipes() -> list[str]:
    return sorted(p.stem for p in BUILT_IN.glob("*.yaml"))


def recipe_path(name: str | Path) -> Path:
    """A recipe file as given, or a built-in recipe's name (`quickstart`, `qwen-draft`: the YAML that ships in the
    package, so an installed draftsmith runs them from any folder)."""
    path = Path(name)
    if path.exists() or path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        return path
    if (BUILT_IN / f"{path}.yaml").is_file():
        return BUILT_IN / f"{path}.yaml"
    raise DraftsmithError(f"{name}: no such recipe file, nor a built-in recipe ({', '.join(built_in_recipes())})")


def load_recipe(path: str | Path, overrides: list[str] = (), *, check_models: bool = True) -> Recipe:
    """Read, override and validate a recipe (a file, or a built-in one's name: `recipe_path`); every error is one
    line starting with the file name."""
    path = recipe_path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot read the recipe ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise DraftsmithError(f"{path}:{line} not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise DraftsmithError(f"{path}: a recipe is a YAML mapping (name:, target:, pair:, ...)")
    try:
        return recipe_from_dict(data, overrides, check_models=check_models)
    except RecipeError as e:
        raise RecipeError(f"{path}: {e}") from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)
