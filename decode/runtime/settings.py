"""What the runtime may do on this machine, in one object: kernels, the native kernel, the row plan, threads, the
allocator.

    from draftsmith.decode.runtime.settings import RuntimeSettings, configure, using
    configure(RuntimeSettings(native=False))          # this process: torch's kernels only
    with using(RuntimeSettings(rows=False)):          # within: no row plan, every forward at its own row count
        ...

The runtime reads `current()` and nothing else: no environment variable steers it (the model cache's location
excepted, as `HF_HOME` does for Hugging Face). The `draftsmith` command maps its environment onto one of these
(`draftsmith.recipes.cli.settings_from_env`: DRAFTSMITH_LINEAR, _NATIVE, _Q4_AHEAD, _ROWS, _MALLOC, _THREADS, CXX)
and hands it to every process it starts. A library user builds one and calls `configure`.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, fields, replace

from draftsmith.decode.runtime.errors import DraftsmithError

LAYOUTS = ("auto", "dnn", "xw", "wx")  # how a float Linear runs: `decode.runtime.kernels` (auto: chosen per call)
MALLOC = ("keep", "system")  # keep: glibc keeps freed memory for reuse (`decode.runtime.allocator`); system: as is
Q4_AHEAD_MAX = 1 << 20


@dataclass(frozen=True)
class RuntimeSettings:
    """`linear`: the float Linear layout (`LAYOUTS`). `native`: draftsmith's own kernels where built (False: torch's
    only). `q4_ahead`: the int4 kernel's prefetch distance in bytes (None: chosen once per machine and saved).
    `rows`: plan few-row forwards (padding, BLAS or native per row count, timed once per model and machine and
    saved in the cache: `decode.runtime.plan`); False: every forward at its own row count on oneDNN.
    `malloc`: `MALLOC`. `threads`: torch's intra-op threads (None: torch's default). `compiler`: the C++
    compiler the native kernel is built with (None: c++, g++, gcc or cc on PATH)."""

    linear: str = "auto"
    native: bool = True
    q4_ahead: int | None = None
    rows: bool = True
    malloc: str = "keep"
    threads: int | None = None
    compiler: str | None = None

    def __post_init__(self) -> None:
        if self.linear not in LAYOUTS:
            raise DraftsmithError(f"linear layout must be one of {', '.join(LAYOUTS)}, got {self.linear!r}")
        if self.malloc not in MALLOC:
            raise DraftsmithError(f"malloc must be {' or '.join(MALLOC)}, got {self.malloc!r}")
        if self.q4_ahead is not None and not (isinstance(self.q4_ahead, int) and 0 <= self.q4_ahead <= Q4_AHEAD_MAX):
            raise DraftsmithError(f"q4_ahead must be a byte count 0..{Q4_AHEAD_MAX}, got {self.q4_ahead!r}")
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise DraftsmithError(f"threads must be a count >= 1, got {self.threads!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RuntimeSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DraftsmithError(f"unknown runtime setting {unknown[0]!r} (settings: {', '.join(sorted(known))})")
        return cls(**d)

    def but(self, **changes) -> RuntimeSettings:
        return replace(self, **changes)


_CURRENT = [RuntimeSettings()]


def current() -> RuntimeSettings:
    """The settings the runtime runs under in this process."""
    return _CURRENT[0]


def configure(settings: RuntimeSettings) -> RuntimeSettings:
    """Run this process under `settings` (threads applied now); returns the ones it replaces."""
    before, _CURRENT[0] = _CURRENT[0], settings
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    return before


@contextlib.contextmanager
def using(settings: RuntimeSettings):
    """`configure(settings)` within the block, the previous settings after it."""
    before = configure(settings)
    try:
        yield settings
    finally:
        configure(before)
