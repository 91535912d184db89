"""One leaderboard across run folders (`draftsmith leaderboard`): rows from every run, sorted, written as
json / md / html; folders without results listed; bad folders and corrupt results are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.recipes.compare import merge_runs, write_merged
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


def lc_run(speedup: float, k: int, accepted: int, drafted: int) -> dict:
    return {"speedup_vs_target_only": speedup, "draft_max": k, "accepted": accepted, "drafted": drafted}


def test_llama_cpp_speedups_stand_beside_ours(tmp_path: Path) -> None:
    """The run's export check served the un-distilled draft (d2) and the distilled one: each row shows llama.cpp's
    speedup beside our decoder's; a candidate llama.cpp did not serve shows none."""
    run = write_run_folder(tmp_path / "a", candidates={"d1": 0.4, "d2": 0.6}, distilled=("d2", 0.6, 0.75),
                           bench={"k": 2, "speedup_vs_target_only": {"draft_before": 1.1, "draft_after": 1.4}},
                           export={"llama_cpp": {"q8_0": lc_run(0.9, 2, 30, 40)},
                                   "llama_cpp_before": {**lc_run(0.8, 2, 20, 40), "draft": "d2"}})
    rows = {r["draft"]: r for r in merge_runs([run])["rows"]}
    assert rows["d2 + distill(fkl, target, 40 steps)"]["llama_cpp"] == {"speedup": 0.9, "k": 2, "accepted": 30,
                                                                         "drafted": 40}
    assert rows["d2"]["llama_cpp"]["speedup"] == 0.8 and rows["d1"]["llama_cpp"] is None
    write_merged(merge_runs([run]), tmp_path / "board")
    md = (tmp_path / "board" / "leaderboard.md").read_text()
    assert "| measured (ours) | llama.cpp |" in md
    assert "| 1.40x | 0.90x (K=2, 30/40) |" in md and "| 0.80x (K=2, 20/40) |" in md


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


def test_every_kind_has_predicted_and_measured_where_its_run_has_them(tmp_path: Path) -> None:
    """A distilled draft's predicted speedup comes from validate's bench.json; a cross-tokenizer candidate's
    measured speedup, made in transformers, says so."""
    run = write_run_folder(tmp_path / "a", candidates={"d1": 0.4, "x": 0.5}, distilled=("d1", 0.4, 0.6),
                           bench={"k": 2, "predicted_speedup": 1.3,
                                  "speedup_vs_target_only": {"draft_before": 1.1, "draft_after": 1.25}})
    path = run / "pairing" / "leaderboard.json"
    board = json.loads(path.read_text())
    for c in board["candidates"]:
        if c["draft"] == "x":
            c.update(kind="cross-tokenizer", measured_speedup=1.05,
                     validation={"engine": "transformers universal assisted generation vs transformers generate"})
    path.write_text(json.dumps(board))
    merged = merge_runs([run])
    rows = {r["draft"]: r for r in merged["rows"]}
    assert rows["d1 + distill(fkl, target, 40 steps)"]["predicted_speedup"] == 1.3
    assert rows["x"]["measured_with"].startswith("transformers") and rows["d1"]["measured_with"] is None
    write_merged(merged, tmp_path / "board")
    md = (tmp_path / "board" / "leaderboard.md").read_text()
    assert "1.05x (transformers)" in md and "1.30x" in md and "1.25x" in md
