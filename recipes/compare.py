"""One acceptance-rate leaderboard across run folders: every target, draft and recipe a team has tried.

    .venv/bin/draftsmith leaderboard runs/* [--out leaderboard/]

Each folder may be a recipe run (pairing/leaderboard.json, distill/distill.json, validate/bench.json) or a
`draftsmith pair` output (leaderboard.json). Rows: every candidate measured by a pair stage, plus every
distilled draft with its alpha after training and its measured speedup. Written as leaderboard.{json,md,html}.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, read_json
from draftsmith.distill.export.results import DraftExport, HeadExport, LlamaServerRun, read_export
from draftsmith.distill.results import DistillResult, HeadResult
from draftsmith.pairing.leaderboard import PairLeaderboard, prediction_caveat
from draftsmith.pairing.validate import BenchResult
from draftsmith.recipes.report import Doc, fmt

COLUMNS = ["target", "draft", "kind", "alpha", "positions", "best K", "predicted", "measured (ours)", "llama.cpp",
           "run"]


def _llama_cpp(lc: LlamaServerRun | None) -> dict | None:
    """What the leaderboard keeps of one llama-server run: speedup over the target alone, K, acceptance."""
    if not lc or lc.speedup_vs_target_only is None:
        return None
    return {"speedup": lc.speedup_vs_target_only, "k": lc.draft_max, "accepted": lc.accepted, "drafted": lc.drafted}


def _read(folder: Path, rels: tuple[str, ...], what: str, read: Callable):
    """The first of `rels` in `folder` that holds a result, read through its type; None when none does."""
    for rel in rels:
        d = read_json(folder / rel, missing_ok=True, what=what)
        if d:
            return read(d, str(folder / rel))
    return None


def rows_of_run(folder: Path) -> list[dict]:
    """The leaderboard rows one run folder contributes (empty when it holds no results yet)."""
    rows: list[dict] = []
    board = _read(folder, ("pairing/leaderboard.json", "leaderboard.json"), "leaderboard", PairLeaderboard.from_dict)
    exported = _read(folder, ("export/export.json",), "export result", read_export)
    before = exported.llama_cpp_before if isinstance(exported, DraftExport) else None
    if board:
        for c in board.candidates:
            rows.append({
                "target": board.target, "draft": c["draft"], "kind": c["kind"], "alpha": c["alpha"],
                "alpha_by_domain": c["alpha_by_domain"], "positions": c["positions"], "best_k": c["best_k"],
                "predicted_speedup": c["predicted_speedup"], "measured_speedup": c["measured_speedup"],
                "measured_with": (c.get("validation") or {}).get("engine"),
                "llama_cpp": _llama_cpp(before) if before and before.draft == c["draft"] else None,
                "run": str(folder),
            })
    bench = _read(folder, ("validate/bench.json",), "bench result", BenchResult.from_dict) or BenchResult()
    head = _read(folder, ("distill/head.json",), "head result", HeadResult.from_dict)
    if head:
        runs = exported.llama_cpp.runs if isinstance(exported, HeadExport) and exported.llama_cpp else {}
        lc = runs.get(str(bench.k)) or max(runs.values(), key=lambda r: r.speedup_vs_target_only or 0, default=None)
        rows.append({
            "target": head.target, "draft": f"head (EAGLE-3, {head.train_summary.tokens_seen} tokens seen)",
            "kind": "head", "alpha": head.agreement_after[0], "alpha_before": None, "alpha_by_domain": None,
            "positions": None, "best_k": bench.k, "predicted_speedup": bench.predicted_speedup,
            "measured_speedup": bench.speedup("draft_after"), "llama_cpp": _llama_cpp(lc), "run": str(folder),
        })
    distilled = _read(folder, ("distill/distill.json", "distill.json"), "distill result", DistillResult.from_dict)
    if distilled:
        cfg, steps = distilled.config, distilled.steps_done()
        served = exported.llama_cpp if isinstance(exported, DraftExport) else {}
        rows.append({
            "target": distilled.target,
            "draft": f"{distilled.draft} + distill({cfg.loss}, {distilled.data_source}, {steps} steps)",
            "kind": "distilled", "alpha": distilled.alpha_after, "alpha_before": distilled.alpha_before,
            "alpha_by_domain": None, "positions": None, "best_k": bench.k,
            "predicted_speedup": bench.predicted_speedup,
            "measured_speedup": bench.speedup("draft_after") or distilled.speedup_after(),
            "llama_cpp": _llama_cpp(next(iter(served.values()), None)),
            "run": str(folder),
        })
    return rows


def merge_runs(folders: list[Path]) -> dict:
    """All rows of all runs, sorted by target then alpha (highest first). Folders without results are listed."""
    if not folders:
        raise DraftsmithError("leaderboard needs at least one run folder (e.g. runs/*)")
    rows, empty = [], []
    for f in folders:
        f = Path(f)
        if not f.is_dir():
            raise DraftsmithError(f"{f}: not a folder")
        found = rows_of_run(f)
        rows += found
        if not found:
            empty.append(str(f))
    rows.sort(key=lambda r: (r["target"], -(r["alpha"] or 0.0)))
    return {"rows": rows, "runs": [str(f) for f in folders], "without_results": empty,
            "definitions": {"alpha": "teacher-forced mean of sum_x min(p, q) on held-out / reference continuations",
                            "measured": "tokens/s with the draft / tokens/s of the same decoder without it (our "
                                        "decoder; '(transformers)': a cross-tokenizer draft in transformers' "
                                        "universal assisted generation against transformers' generate)",
                            "llama_cpp": "llama-server's tokens/s with the draft / without it (the export check)"}}


def _table(merged: dict) -> tuple[list[str], list[list[str]]]:
    rows = []
    for r in merged["rows"]:
        alpha = fmt(r["alpha"])
        if r.get("alpha_before") is not None:
            alpha += f" (from {fmt(r['alpha_before'])})"
        rows.append([r["target"], r["draft"], r["kind"], alpha, fmt(r["positions"]), fmt(r["best_k"]),
                     fmt(r["predicted_speedup"], 2) + ("x" if r["predicted_speedup"] else ""),
                     fmt(r["measured_speedup"], 2) + ("x" if r["measured_speedup"] else "")
                     + (" (transformers)" if r.get("measured_with") else "")
                     + (" (!)" if prediction_caveat(r["predicted_speedup"], r["measured_speedup"]) else ""),
                     _llama_cpp_cell(r.get("llama_cpp")), r["run"]])
    return COLUMNS, rows


def _llama_cpp_cell(lc: dict | None) -> str:
    if not lc:
        return "-"
    return f"{lc['speedup']:.2f}x (K={lc['k']}, {lc['accepted']}/{lc['drafted']})"


def write_merged(merged: dict, out: Path) -> Doc:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "leaderboard.json", merged)
    doc = Doc("draftsmith leaderboard")
    doc.p(f"{len(merged['rows'])} rows from {len(merged['runs'])} run folders. alpha: teacher-forced acceptance; "
          "predicted: the leaderboard's (tokens per round walked as the decoder walks them, round cost timed in the "
          "decoder); measured: our decoder with / without the draft; llama.cpp: llama-server with / without it, from "
          "the run's export check (K, accepted/drafted).")
    doc.table(*_table(merged))
    for r in merged["rows"]:
        why = prediction_caveat(r["predicted_speedup"], r["measured_speedup"])
        if why:
            doc.p(f"(!) {r['draft']} ({r['run']}): {why}.")
    if merged["without_results"]:
        doc.p("Folders without results yet: " + ", ".join(merged["without_results"]))
    doc.write(out, "leaderboard")
    return doc
