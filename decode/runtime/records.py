"""Result records: what a stage writes as JSON, read back typed.

    @dataclass
    class BenchResult(Record):
        target: str = ""
    r = BenchResult.from_dict(read_json(path), what=str(path))    # typed; unknown keys kept as written
    atomic_write_json(path, r.to_dict())                            # the same JSON back: to_dict(from_dict(d)) == d

A record without a `version` reads as version 1; a newer one than the reader knows, a missing required key or a
value that is not a JSON object is a one-line DraftsmithError naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from draftsmith.decode.runtime.errors import DraftsmithError


@dataclass
class Part:
    """A part of a stage's result as JSON: the keys its readers use as typed fields (a key absent from the JSON
    reads as the field's default), every other key kept as it is (`extra`), so that `to_dict(from_dict(d)) == d`:
    a key absent when read stays absent when written. `NESTED` names the fields whose values are parts
    themselves: {key: ("one" | "map" | "list", the part's class)}; `OMIT_NONE`: keys written only when set."""

    NESTED: ClassVar[dict[str, tuple[str, type]]] = {}
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()
    extra: dict = field(default_factory=dict, kw_only=True, repr=False)
    absent: frozenset = field(default=frozenset(), kw_only=True, repr=False, compare=False)

    @classmethod
    def keys(cls) -> list[str]:
        """The JSON keys this type names (fields with metadata key=False are not keys)."""
        return [f.name for f in fields(cls)
                if f.name not in ("extra", "absent", "version") and f.metadata.get("key", True)]

    @classmethod
    def from_dict(cls, d: Any, what: str = ""):
        """The typed record; a one-line DraftsmithError naming `what` (a file) when `d` does not fit."""
        what = what or cls.__name__
        if not isinstance(d, dict):
            raise DraftsmithError(f"{what}: expected a JSON object, got {type(d).__name__}")
        names = cls.keys()
        try:
            kw = {n: _read_part(cls.NESTED.get(n), d[n], f"{what} {n}") for n in names if n in d}
            return cls(**kw, extra={k: v for k, v in d.items() if k not in names and k != "version"},
                       absent=frozenset(n for n in names if n not in d))
        except TypeError as e:  # a required key missing
            raise DraftsmithError(f"{what}: not a {cls.__name__} ({e})") from None

    def __bool__(self) -> bool:  # as its JSON object: an empty one is false
        return bool(self.to_dict())

    def to_dict(self) -> dict:
        out = dict(self.extra)
        for n in self.keys():
            v = getattr(self, n)
            if n not in self.absent and not (v is None and n in self.OMIT_NONE):
                out[n] = _write_part(self.NESTED.get(n), v)
        return out


@dataclass
class Record(Part):
    """A stage's result file: a `Part` with a `version`. A record written before versions were (no key) reads as
    version 1; one newer than this code reads (`VERSION`) is a one-line DraftsmithError."""

    VERSION: ClassVar[int] = 1
    version: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        self.version = self.version or self.VERSION

    @classmethod
    def from_dict(cls, d: Any, what: str = ""):
        v = d.get("version", 1) if isinstance(d, dict) else 1
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= cls.VERSION:
            raise DraftsmithError(f"{what or cls.__name__}: {cls.__name__} version {v!r}, this draftsmith reads "
                                  f"versions 1 to {cls.VERSION} (a newer draftsmith wrote it?)")
        obj = super().from_dict(d, what)
        obj.version = v
        return obj

    def to_dict(self) -> dict:
        return {**super().to_dict(), "version": self.version}


def _read_part(how: tuple[str, type] | None, v: Any, what: str) -> Any:
    if how is None or v is None:
        return v
    shape, part = how
    if shape == "one":
        return part.from_dict(v, what)
    if shape == "map":
        return {k: None if x is None else part.from_dict(x, f"{what} {k}") for k, x in v.items()}
    return [part.from_dict(x, what) for x in v]


def _write_part(how: tuple[str, type] | None, v: Any) -> Any:
    if how is None or v is None:
        return v
    shape = how[0]
    if shape == "one":
        return v.to_dict()
    if shape == "map":
        return {k: None if x is None else x.to_dict() for k, x in v.items()}
    return [x.to_dict() for x in v]
