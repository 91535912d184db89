"""Recipes as typed configs: one YAML file fills one dataclass per stage, validated on load.

    from recipes.config import load_recipe
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

from decode import zoo
from decode.errors import DraftsmithError
from distill.train import TrainConfig
from pairing.derive import parse_derive_spec

STAGES = ("pair", "distill", "validate", "export")
EXPORT_FORMATS = ("hf", "gguf")
GGUF_TYPES = ("f32", "f16", "q8_0")
DATA_SOURCES = ("target", "draft", "mixed")
DEVICES = ("cpu", "cuda")


class RecipeError(DraftsmithError):
    """A recipe problem; the message starts with the file and names the key."""


@dataclass
class PromptsConfig:
    """Where prompts come from: built-in suites (code, json, summarize, chat) or a JSONL file."""

    suite: str | None = "code,json,summarize,chat"
    file: str | None = None
    limit_per_domain: int | None = None  # the first N prompts of each domain (held-out ones included)

    def __post_init__(self) -> None:
        if not self.suite and not self.file:
            raise ValueError("give prompts.suite (e.g. code,chat) or prompts.file (a JSONL file)")
        if self.limit_per_domain is not None and self.limit_per_domain < 2:
            raise ValueError(f"prompts.limit_per_domain must be >= 2 (some to train on, some held out), "
                             f"got {self.limit_per_domain}")

    @property
    def source(self) -> str:
        return self.file or self.suite or ""


@dataclass
class PairConfig:
    """The leaderboard stage: candidates ranked by acceptance, measured cost and predicted speedup."""

    candidates: list[str] = field(default_factory=list)
    limit_per_domain: int = 8  # prompts per domain for the acceptance measurement
    max_new_tokens: int = 64  # length of the target's reference continuations
    validate: int = 0  # top N candidates also decoded for a measured speedup
    validate_prompts: int = 4
    draft_quant: str | None = "int8"
    batch_size: int = 4

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("pair.candidates: name at least one draft (zoo name, HF folder, derive:MODEL:keep=N)")
        _positive(self, "limit_per_domain", "max_new_tokens", "validate_prompts", "batch_size")
        if self.validate < 0:
            raise ValueError(f"pair.validate must be >= 0, got {self.validate}")
        if self.draft_quant not in (None, "int8"):
            raise ValueError(f"pair.draft_quant must be int8 or null, got {self.draft_quant!r}")


@dataclass
class DistillConfig:
    """The distillation stage: data from the target (and the draft), then divergence training."""

    draft: str = "best"  # 'best' = the top token-level candidate of the leaderboard; or any model spec
    data: str = "target"  # target | draft | mixed
    mix: float = 0.5  # fraction of draft (on-policy) rows when data = mixed
    max_new_tokens: int = 64
    data_temperature: float = 1.0
    speculative_data: bool = False  # generate the target's data with the draft's proposals (pays once alpha is high)
    eval_per_domain: int = 6  # held-out prompts per domain, never trained on
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.data not in DATA_SOURCES:
            raise ValueError(f"distill.data must be one of {', '.join(DATA_SOURCES)}, got {self.data!r}")
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"distill.mix must be in [0, 1], got {self.mix}")
        if self.data_temperature < 0:
            raise ValueError(f"distill.data_temperature must be >= 0, got {self.data_temperature}")
        _positive(self, "max_new_tokens", "eval_per_domain")


@dataclass
class ValidateConfig:
    """The validation stage: target alone vs un-distilled vs distilled draft, same prompts, same run."""

    prompts_per_domain: int = 2  # held-out prompts per domain
    max_new_tokens: int = 64
    k: int = 0  # 0 = the best K predicted from the measured cost and the distilled draft's alpha
    max_k: int = 8
    draft_quant: str | None = "int8"

    def __post_init__(self) -> None:
        _positive(self, "prompts_per_domain", "max_new_tokens", "max_k")
        if self.k < 0:
            raise ValueError(f"validate.k must be >= 0 (0 = best measured), got {self.k}")
        if self.draft_quant not in (None, "int8"):
            raise ValueError(f"validate.draft_quant must be int8 or null, got {self.draft_quant!r}")


@dataclass
class ExportConfig:
    """The export stage: HF folder and/or GGUF for llama.cpp, plus the vLLM / SGLang lines."""

    formats: list[str] = field(default_factory=lambda: ["hf", "gguf"])
    gguf_type: str = "f16"  # f32 | f16 | q8_0
    check_llama_cpp: bool = False  # run llama-server with the exported GGUF as its draft (builds llama.cpp once)

    def __post_init__(self) -> None:
        bad = [f for f in self.formats if f not in EXPORT_FORMATS]
        if bad or not self.formats:
            raise ValueError(f"export.formats must be a non-empty list of {', '.join(EXPORT_FORMATS)}, got {self.formats}")
        if self.gguf_type not in GGUF_TYPES:
            raise ValueError(f"export.gguf_type must be one of {', '.join(GGUF_TYPES)}, got {self.gguf_type!r}")


@dataclass
class Recipe:
    """A whole run: target, prompts and one config per stage."""

    name: str
    target: str
    pair: PairConfig
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    device: str = "cpu"  # cpu | cuda: where pair, data generation, validation run (training: where accelerate puts it)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not self.name or "/" in self.name:
            raise ValueError(f"name must be a plain folder name, got {self.name!r}")
        bad = [s for s in self.stages if s not in STAGES]
        if bad:
            raise ValueError(f"stages: unknown stage {bad[0]!r} (stages: {', '.join(STAGES)})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(obj, name)}")


# --- building dataclasses from plain data, with errors that name the key -----------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` checked against the annotation `tp` (int, float, str, bool, list[str], X | None, dataclass)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
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
        if isinstance(value, str):  # 'a,b' on the command line is a list too
            value = [v.strip() for v in value.split(",") if v.strip()]
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
        raise RecipeError(f"{prefix or cls.__name__}: {e}") from None


# --- models named in a recipe ---------------------------------------------------------------------


def check_model_spec(spec: str, key: str) -> None:
    """A zoo name, an existing HF folder / .gguf file, or a derive spec over one of those."""
    try:
        parsed = parse_derive_spec(spec)
    except DraftsmithError as e:
        raise RecipeError(f"{key}: {e}") from None
    if parsed is not None:
        check_model_spec(parsed[0], key)
        return
    if spec in zoo.known_models():
        return
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return
    if path.is_file() and path.suffix == ".gguf":
        return
    raise RecipeError(f"{key}: unknown model {spec!r}: expected a zoo name ({', '.join(zoo.known_models())}), "
                      "an HF folder with config.json, a .gguf file, or derive:MODEL:keep=N")


def _check_models(recipe: Recipe) -> None:
    check_model_spec(recipe.target, "target")
    for i, spec in enumerate(recipe.pair.candidates):
        check_model_spec(spec, f"pair.candidates[{i}]")
    if recipe.distill.draft != "best":
        check_model_spec(recipe.distill.draft, "distill.draft")
    if recipe.prompts.file and not Path(recipe.prompts.file).is_file():
        raise RecipeError(f"prompts.file: no such file {recipe.prompts.file!r}")


# --- loading ----------------------------------------------------------------------------------------


def apply_override(data: dict[str, Any], override: str) -> None:
    """'distill.train.steps=200' -> data['distill']['train']['steps'] = 200 (value parsed as YAML)."""
    if "=" not in override:
        raise RecipeError(f"override {override!r}: expected key=value, e.g. distill.train.steps=200")
    key, text = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {override!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def recipe_from_dict(data: dict[str, Any], overrides: list[str] = (), *, check_models: bool = True) -> Recipe:
    data = dict(data)
    for o in overrides:
        apply_override(data, o)
    recipe = build(Recipe, data)
    if check_models:
        _check_models(recipe)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] = (), *, check_models: bool = True) -> Recipe:
    """Read, override and validate a recipe; every error is one line starting with the file name."""
    path = Path(path)
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
