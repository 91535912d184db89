"""Prompt suites for benchmarks, acceptance-rate measurement and held-out distillation evals.

Built-in suites live next to this file as JSONL (one ``{"id", "domain", "prompt"}`` object a line)
and are read with the ``json`` module. User sources (``.jsonl``, ``.json``, ``.csv``, ``.parquet``
files, or a ``datasets.save_to_disk`` folder) need a ``prompt`` column; ``domain`` and ``id`` are
optional. Every problem a user can fix raises :class:`DraftsmithError` with a one-line message.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.decode.runtime.errors import DraftsmithError

SUITES: tuple[str, ...] = ("code", "json", "summarize", "chat")
"""Built-in suite names; the first four ``code`` prompts are the default benchmark prompts."""

DEFAULT_DOMAIN = "user"
_HERE = Path(__file__).resolve().parent
_DATASETS_FORMATS = {".json": "json", ".csv": "csv", ".parquet": "parquet"}
_FORMATS_HINT = ".jsonl, .json, .csv or .parquet file, or a datasets.save_to_disk folder"


@dataclass(frozen=True)
class Prompt:
    """One user message: ``id`` is unique within a source, ``domain`` groups results."""

    id: str
    domain: str
    prompt: str


def chat_messages(prompt: Prompt) -> list[dict]:
    """The prompt as a single-turn chat, ready for ``tokenizer.apply_chat_template``."""
    return [{"role": "user", "content": prompt.prompt}]


def suite_path(name: str) -> Path:
    """Path of the JSONL file behind built-in suite ``name``."""
    if name not in SUITES:
        raise DraftsmithError(f"unknown prompt suite {name!r}; built-in suites are: {', '.join(SUITES)}")
    return _HERE / f"{name}.jsonl"


def load_suite(name: str) -> list[Prompt]:
    """All prompts of built-in suite ``name``, in file order."""
    path = suite_path(name)
    return _to_prompts(_read_jsonl(path), path, default_domain=name)


def load_prompts(source: str | Path, *, limit_per_domain: int | None = None) -> list[Prompt]:
    """Load prompts from suite names (``"code,chat"``), a data file, or a ``save_to_disk`` folder.

    A string whose comma-separated parts are all suite names is read as suites (so a local folder
    called ``code`` never shadows the built-in suite; write ``./code`` for the folder). Anything
    else is a path. ``limit_per_domain`` keeps the first N prompts of each domain, in order.
    """
    if limit_per_domain is not None and limit_per_domain < 1:
        raise DraftsmithError(f"limit_per_domain must be a positive integer, got {limit_per_domain}")

    if isinstance(source, Path):
        prompts = _load_path(source)
    else:
        names = [part.strip() for part in source.split(",") if part.strip()]
        if not names:
            raise DraftsmithError(f"no prompt source given; use suite names ({', '.join(SUITES)}) or a file")
        if all(name in SUITES for name in names):
            prompts = [p for name in dict.fromkeys(names) for p in load_suite(name)]
        else:
            prompts = _load_path(Path(source.strip()), names)

    return prompts if limit_per_domain is None else first_per_domain(prompts, limit_per_domain)


def load_test_prompts(source: str | Path) -> list[Prompt]:
    """The test split of `source`: prompts kept for reporting speedups, never trained on and never used to choose
    anything (a checkpoint, K, a threshold, a recipe setting). Built-in suites each have one
    (``decode/prompts/test/<suite>.jsonl``: 16 prompts for code and chat, 8 for json and summarize, none of them
    in the suite itself; the first split, timed in many runs, closes each suite's dev prompts); for any
    other source it is a file of its own (``test_prompts:`` in a recipe), so this returns [] there."""
    if isinstance(source, Path):
        return []
    names = [part.strip() for part in source.split(",") if part.strip()]
    if not names or not all(name in SUITES for name in names):
        return []
    return [p for name in dict.fromkeys(names) for p in _to_prompts(_read_jsonl(_HERE / "test" / f"{name}.jsonl"),
                                                                     _HERE / "test" / f"{name}.jsonl",
                                                                     default_domain=name)]


def first_per_domain(prompts: list[Prompt], n: int, skip: int = 0) -> list[Prompt]:
    """The first `n` prompts of every domain after its first `skip`, in their order."""
    seen: dict[str, int] = {}
    kept = []
    for p in prompts:
        seen[p.domain] = seen.get(p.domain, 0) + 1
        if skip < seen[p.domain] <= skip + n:
            kept.append(p)
    return kept


def _load_path(path: Path, names: list[str] | None = None) -> list[Prompt]:
    """Prompts from a file or folder; ``names`` is the source split on commas when it was a string."""
    if not path.exists():
        unknown = [n for n in names or [] if n not in SUITES]
        if names is None or path.suffix or len(path.parts) > 1 or not unknown:
            raise DraftsmithError(f"prompt file not found: {path}")
        raise DraftsmithError(
            f"unknown prompt suite {unknown[0]!r} (and no such file); built-in suites are: "
            f"{', '.join(SUITES)}, or give a {_FORMATS_HINT}"
        )

    if path.is_dir():
        columns, rows = _read_saved_dataset(path)
        labelled = ((f"row {i}", row) for i, row in enumerate(rows, 1))
    elif path.suffix.lower() == ".jsonl":
        return _to_prompts(_read_jsonl(path), path)
    elif path.suffix.lower() in _DATASETS_FORMATS:
        columns, rows = _read_with_datasets(path, _DATASETS_FORMATS[path.suffix.lower()])
        labelled = ((f"row {i}", row) for i, row in enumerate(rows, 1))
    else:
        kind = path.suffix or "(no extension)"
        raise DraftsmithError(f"{path}: unsupported prompt file type {kind}; use a {_FORMATS_HINT}")

    if "prompt" not in columns:
        raise DraftsmithError(f"{path}: no 'prompt' column (found: {', '.join(columns) or 'none'})")
    return _to_prompts(labelled, path)


def _read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(``"line N"``, object) pairs from a JSONL file, skipping blank lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DraftsmithError(f"prompt file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{path}: cannot read file ({e})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DraftsmithError(f"{path}: line {n}: malformed JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict):
            raise DraftsmithError(f"{path}: line {n}: expected a JSON object, got {type(row).__name__}")
        rows.append((f"line {n}", row))
    return rows


def _read_with_datasets(path: Path, builder: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of a json/csv/parquet file via ``datasets``, with a throwaway cache."""
    import datasets  # imported lazily: slow to import, and built-in suites don't need it

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating train split" bars are noise for a prompt file
    with tempfile.TemporaryDirectory(prefix="draftsmith-prompts-") as cache:
        try:
            ds = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
        except Exception as e:  # datasets raises many types; the user only needs the gist
            raise DraftsmithError(f"{path}: cannot read as {builder}: {_first_line(e)}") from None
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
        return list(ds.column_names), ds.to_list()


def _read_saved_dataset(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of a ``save_to_disk`` folder (a Dataset, or a DatasetDict's train/only split)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as e:
        raise DraftsmithError(
            f"{path}: not a folder written by datasets.save_to_disk ({_first_line(e)})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            ds = ds["train"]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise DraftsmithError(f"{path}: DatasetDict has no 'train' split (splits: {', '.join(ds)})")
    return list(ds.column_names), ds.to_list()


def _to_prompts(
    rows: Iterable[tuple[str, Mapping[str, Any]]], path: Path, *, default_domain: str = DEFAULT_DOMAIN
) -> list[Prompt]:
    """Validate rows into prompts: text required, ``domain``/``id`` defaulted, ids unique."""
    prompts: list[Prompt] = []
    ids: set[str] = set()
    for index, (where, row) in enumerate(rows):
        text = row.get("prompt")
        if text is None and "prompt" not in row:
            raise DraftsmithError(f"{path}: {where}: no 'prompt' field (found: {', '.join(row) or 'none'})")
        if text is not None and not isinstance(text, str):
            raise DraftsmithError(f"{path}: {where}: prompt is not text (got {type(text).__name__})")
        if text is None or not text.strip():
            raise DraftsmithError(f"{path}: {where}: empty prompt")
        domain = str(row.get("domain") or default_domain).strip() or default_domain
        pid = row.get("id")
        pid = f"{domain}-{index}" if pid is None or str(pid).strip() == "" else str(pid).strip()
        if pid in ids:
            raise DraftsmithError(f"{path}: {where}: duplicate id {pid!r}")
        ids.add(pid)
        prompts.append(Prompt(id=pid, domain=domain, prompt=text))
    if not prompts:
        raise DraftsmithError(f"{path}: no prompts found")
    return prompts


def _first_line(error: BaseException) -> str:
    """The first line of the innermost cause's message (``datasets`` wraps the useful one)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


__all__ = ["DEFAULT_DOMAIN", "SUITES", "Prompt", "chat_messages", "load_prompts", "load_suite", "load_test_prompts",
           "suite_path"]
