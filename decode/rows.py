"""Rows generated prompt by prompt into a partial JSONL file, resumable, finished as a `datasets` folder.

    rows = read_partial(part, prompts)                # what an interrupted run saved (checked against the prompts)
    with part.open("a", encoding="utf-8") as f:
        append_rows(f, [row])                         # on disk before the next prompt starts: a checkpoint
    ds = save_rows(rows, FEATURES, {"draftsmith_reference": settings}, final)

Row i carries "index": i and "id": the id of prompt i, so a partial file is read back only as far as it
matches the prompts. `save_rows` saves beside `final` and renames into place: a folder under its final name
is always complete (another run that finished the same folder first wins; its rows are the same).
What `pairing.reference` (the target's reference continuations) and `distill.data` (training rows) share.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from draftsmith.decode.runtime.io import atomic_dir, atomic_write_text
from draftsmith.decode.prompts import Prompt


def read_partial(part: str | Path, prompts: Sequence[Prompt]) -> list[dict]:
    """The rows saved so far in `part`, in prompt order; a torn last line or a row that does not fit the
    prompts ends them (and the file is rewritten without the rest) so that appending continues cleanly."""
    part = Path(part)
    if not part.is_file():
        return []
    rows: list[dict] = []
    lines = part.read_text(encoding="utf-8").split("\n")
    complete = lines[:-1]  # whatever follows the last newline was being written when the run stopped
    for line in complete:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        i = len(rows)
        if not isinstance(row, dict) or i >= len(prompts) or row.get("index") != i or row.get("id") != prompts[i].id:
            break
        rows.append(row)
    if len(rows) != len(complete) or lines[-1]:
        atomic_write_text(part, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def append_rows(f: IO[str], rows: Iterable[dict]) -> None:
    """Append `rows` to the open partial file `f` as JSON lines and push them to disk (flush, fsync): a
    checkpoint per call, which costs nothing next to a generation."""
    for row in rows:
        f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())


def save_rows(rows: list[dict], features: Any, description: dict, final: str | Path):
    """The rows (the columns of `features`, a `datasets.Features`) as a `datasets.save_to_disk` folder at
    `final` with `description` (JSON) in its info, written beside it and renamed into place; returns it loaded."""
    import datasets

    ds = datasets.Dataset.from_list(
        [{name: r[name] for name in features} for r in rows], features=features,
        info=datasets.DatasetInfo(description=json.dumps(description), features=features),
    )
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Saving the dataset" is noise after the generation bar
    try:
        with atomic_dir(final, keep_existing=True) as tmp:
            ds.save_to_disk(str(tmp))
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    return datasets.load_from_disk(str(final))


__all__ = ["append_rows", "read_partial", "save_rows"]
