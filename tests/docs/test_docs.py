"""The docs stay small and linked (issue 53): docs/check_links.py passes (no broken link, docs/ under 1 MB without
design.md), every tracked run record is a summary of at most 20 KB, and plots stay small. Plain Python: no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD_CAP = 20_000  # bytes: a run record is a summary (pick, policy, medians and ranges, machine, command)
PNG_CAP = 150_000  # bytes: a plot a page embeds (palette PNGs of 7-32 KB today; a plain matplotlib one ~80 KB)


def tracked(folder: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_check_links_passes():
    run = subprocess.run([sys.executable, "docs/check_links.py"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_records_are_small():
    """Every tracked file under docs/results/ but the pages (.md), and every JSON record anywhere under docs/, is at
    most 20 KB; a plot (.png) at most 150 KB."""
    too_big = []
    for name in tracked("docs"):
        suffix = Path(name).suffix
        if suffix == ".md" or not (name.startswith("docs/results/") or suffix in (".json", ".jsonl")):
            continue
        cap = PNG_CAP if suffix == ".png" else RECORD_CAP
        size = (ROOT / name).stat().st_size
        if size > cap:
            too_big.append(f"{name}: {size} bytes > {cap}")
    assert not too_big, "\n".join(too_big)


def test_records_are_summaries():
    """Each tracked JSON / JSON Lines record under docs/ is what docs/summarize_record.py makes of it."""
    records = [n for n in tracked("docs") if n.endswith((".json", ".jsonl"))]
    run = subprocess.run([sys.executable, "docs/summarize_record.py", "--check", *records], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_summarize_out_writes_beside_never_over_the_source(tmp_path):
    """`--out DIR FILE` with an absolute FILE writes DIR/<FILE without its root>, and the source stays as it was."""
    src = tmp_path / "run" / "bench.json"
    src.parent.mkdir()
    raw = json.dumps({"k": 2, "stats": {"target_only": {"tokens": 1}}, "tok_per_s": {"a": 1.23456789}})
    src.write_text(raw)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "docs/summarize_record.py", "--out", str(out), str(src)], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert src.read_text() == raw
    written = out / src.relative_to(src.anchor)
    assert "stats" not in json.loads(written.read_text())


def test_summarize_is_idempotent_when_drops_empty_a_dict(tmp_path):
    """A dict whose every key is dropped goes in the same pass: the summary is a summary of itself at once."""
    src = tmp_path / "distill.json"
    src.write_text(json.dumps({"served": {"forms": {"groups": {"stats": {"a": 1}}}, "pick": "groups"}, "k": 1}))
    run = subprocess.run([sys.executable, "docs/summarize_record.py", str(src)], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(src.read_text())["served"] == {"pick": "groups"}
    check = subprocess.run([sys.executable, "docs/summarize_record.py", "--check", str(src)], cwd=ROOT,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
