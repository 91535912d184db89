"""One leaderboard across run folders (`draftsmith leaderboard`): rows from every run, sorted, written as
json / md / html; folders without results listed; bad folders and corrupt results are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decode.errors import DraftsmithError
from recipes.compare import merge_runs, write_merged
from tests.helpers import write_run_folder


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path, Path]:
    a = write_run_folder(tmp_path / "a", candidates={"d1": 0.4, "d2": 0.6}, distilled=("d2", 0.6, 0.75),
                         bench={"k": 2, "speedup_vs_target_only": {"draft_before": 1.1, "draft_after": 1.4}})
    b = write_run_folder(tmp_path / "b", candidates={"d3": 0.5})
    empty = tmp_path / "empty"
    empty.mkdir()
    return a, b, empty


def test_merge_runs_takes_every_row_of_every_run_sorted_by_alpha(runs) -> None:
    a, b, empty = runs
    merged = merge_runs([a, b, empty])
    rows = merged["rows"]
    assert [(r["draft"], r["alpha"], r["run"]) for r in rows] == [
        ("d2 + distill(fkl, target, 40 steps)", 0.75, str(a)),
        ("d2", 0.6, str(a)),
        ("d3", 0.5, str(b)),
        ("d1", 0.4, str(a)),
    ]
    distilled = rows[0]
    assert distilled["kind"] == "distilled" and distilled["alpha_before"] == 0.6
    assert distilled["best_k"] == 2 and distilled["measured_speedup"] == 1.4  # from validate/bench.json
    assert rows[1]["best_k"] == 3 and rows[1]["predicted_speedup"] == pytest.approx(1.6)
    assert all(r["target"] == "tiny-target" for r in rows)
    assert merged["runs"] == [str(a), str(b), str(empty)]
    assert merged["without_results"] == [str(empty)]


def test_write_merged_writes_json_markdown_and_html(runs, tmp_path: Path) -> None:
    merged = merge_runs(list(runs))
    out = tmp_path / "board"
    write_merged(merged, out)
    assert json.loads((out / "leaderboard.json").read_text()) == merged
    md = (out / "leaderboard.md").read_text()
    assert md.count("| target | draft |") == 1
    assert "4 rows from 3 run folders" in md
    assert "| tiny-target | d2 + distill(fkl, target, 40 steps) | distilled | 0.750 (from 0.600) |" in md
    assert "1.40x" in md and "1.60x" in md  # measured (distilled) and predicted (d2)
    assert f"Folders without results yet: {runs[2]}" in md
    html = (out / "leaderboard.html").read_text()
    assert html.count("<tr>") == 5 and "d3" in html and "0.750 (from 0.600)" in html


def test_bad_folders_are_one_line_errors(runs, tmp_path: Path) -> None:
    with pytest.raises(DraftsmithError, match="at least one run folder"):
        merge_runs([])
    with pytest.raises(DraftsmithError, match="not a folder"):
        merge_runs([runs[0], tmp_path / "nope"])
    board = runs[1] / "pairing" / "leaderboard.json"
    board.write_text('{"target": "tiny-target", "candidates": [')  # cut short, as by a full disk
    with pytest.raises(DraftsmithError) as e:
        merge_runs([runs[0], runs[1]])
    assert str(board) in str(e.value) and "\n" not in str(e.value)
