"""Command-line options generated from the stage configs, so a CLI verb and a recipe section share every setting.

    add_options(parser, DistillConfig)                   # --draft, --data, ..., --loss, --steps (train flattened)
    cfg = options_to_config(DistillConfig, args)         # the same build() and checks a recipe goes through

One option per dataclass field: `--name-with-dashes`, nested dataclasses flattened (their fields' names are
unique within a verb, which `add_options` checks), the default and the help text taken from the field (its
trailing `# comment` in the class source). Values are parsed as YAML scalars, exactly as a recipe's
`key=value` overrides are, then checked by `recipes.config.build`: a bad value is the same one-line error
wherever it comes from. Booleans are `--flag` / `--no-flag`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import typing
from typing import Any

from draftsmith.recipes.config import build, parse_value

_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+?)\s*$")


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Field name -> the `# comment` written after it in the class body (the one place a setting is described)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        for line in lines:
            m = _COMMENT.match(line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def leaf_fields(cls: type, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dataclasses.Field, type, type]]:
    """(dotted path, field, annotation, owning class) of every non-dataclass field, nested ones flattened."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += leaf_fields(tp, (*path, f.name))
        else:
            out.append(((*path, f.name), f, tp, cls))
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "null" if value is None else str(value)


def add_options(parser: argparse.ArgumentParser, cls: type, *, only: set[str] | None = None,
                skip: set[str] = frozenset(), required: set[str] = frozenset(),
                aliases: dict[str, list[str]] | None = None, taken: set[str] | None = None,
                title: str | None = None) -> None:
    """One option per leaf field of `cls` (or those in `only`, minus `skip`). `taken` collects the names across
    calls; a name used twice in one verb is a programming error, raised at once."""
    taken = set() if taken is None else taken
    aliases = aliases or {}
    group = parser.add_argument_group(title or f"settings ({cls.__name__})")
    for path, f, tp, owner in leaf_fields(cls):
        name = f.name
        if (only is not None and name not in only) or name in skip:
            continue
        if name in taken:
            raise ValueError(f"option --{name.replace('_', '-')} comes from two settings in one verb")
        taken.add(name)
        default = _default(f)
        flag = "--" + name.replace("_", "-")
        help_text = field_help(owner).get(name, "")
        if default is not dataclasses.MISSING and name not in required:
            help_text += f" (default {_show(default)})"
        kwargs: dict[str, Any] = dict(dest=f"cfg:{'.'.join(path)}", default=argparse.SUPPRESS, help=help_text)
        if tp is bool:
            group.add_argument(flag, *aliases.get(name, []), action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(tp) is list:  # given twice, both count: '--k 1 --k 2,3' is 1,2,3
            group.add_argument(flag, *aliases.get(name, []), metavar=name.upper(), required=name in required,
                               action="append", **kwargs)
        else:
            group.add_argument(flag, *aliases.get(name, []), metavar=name.upper(), required=name in required,
                               **kwargs)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave on the command line, as a nested dict of parsed values."""
    data: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith("cfg:"):
            continue
        *parents, leaf = dest.removeprefix("cfg:").split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        if isinstance(value, list) and all(isinstance(v, str) for v in value):  # a list option given n times
            value = ",".join(value)
        node[leaf] = parse_value(value) if isinstance(value, str) else value
    return data


def options_to_config(cls: type, args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Any:
    """The `cls` instance the options describe (defaults for the rest), through the recipes' own `build`."""
    data = given(args)
    for key, value in (extra or {}).items():
        data.setdefault(key, value)
    names = {f.name for f in dataclasses.fields(cls)}
    return build(cls, {k: v for k, v in data.items() if k in names})


__all__ = ["add_options", "field_help", "given", "leaf_fields", "options_to_config"]
