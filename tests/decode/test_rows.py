"""decode.rows: a partial JSONL read back only as far as it fits the prompts; the finished folder renamed in."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

from draftsmith.decode.prompts import Prompt
from draftsmith.decode.rows import append_rows, read_partial, save_rows

PROMPTS = [Prompt(id=str(i), domain="code", prompt=f"p{i}") for i in range(4)]
FEATURES = datasets.Features({"id": datasets.Value("string"), "n": datasets.Value("int64")})


def test_partial_rows_stop_at_a_torn_or_foreign_line_and_appending_continues(tmp_path: Path) -> None:
    part = tmp_path / "rows.jsonl"
    assert read_partial(part, PROMPTS) == []
    rows = [{"index": i, "id": str(i), "n": i} for i in range(2)]
    with part.open("a", encoding="utf-8") as f:
        append_rows(f, rows)
        f.write('{"index": 2, "id": "2", "n')  # torn by an interruption
    assert read_partial(part, PROMPTS) == rows
    assert part.read_text() == "".join(json.dumps(r) + "\n" for r in rows)  # rewritten without the torn line
    with part.open("a", encoding="utf-8") as f:
        append_rows(f, [{"index": 3, "id": "3", "n": 3}])  # not prompt 2's row: ends what is read back
    assert read_partial(part, PROMPTS) == rows


def test_saved_rows_appear_complete_and_a_finished_folder_is_kept(tmp_path: Path) -> None:
    rows = [{"index": i, "id": str(i), "n": i} for i in range(3)]
    final = tmp_path / "data"
    ds = save_rows(rows, FEATURES, {"what": "test"}, final)
    assert ds.to_list() == [{"id": str(i), "n": i} for i in range(3)]
    assert json.loads(ds.info.description) == {"what": "test"}
    again = save_rows(rows[:1], FEATURES, {"what": "other"}, final)  # another run finished it first: kept
    assert again.to_list() == ds.to_list()
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no temporary left behind
