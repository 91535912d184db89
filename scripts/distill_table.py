"""Issue 4's table: what each loss (fkl, rkl, jsd, tvd) x data source (target, draft, mixed) gives at equal budget.

    nohup .venv/bin/python scripts/distill_table.py > runs/distill-table/log.txt 2>&1 &

Expected runtime on the 2-core machine: data for the draft and mixed sources about 5-8 min (the target's data
is reused from runs/distill-smollm2/data when its settings match), then about 5-8 min per 60-step run when the
machine is quiet (more when it is shared): about 1-1.5 h for the full 4 x 3 grid of 12 runs.
A smoke test of the whole pipeline (2 steps per run, written under runs/distill-table/smoke; it generates the
shared data-<source> folders, which the real run then reuses):

    .venv/bin/python scripts/distill_table.py --steps 2 --runs fkl-target,fkl-draft,tvd-mixed \
        --root runs/distill-table/smoke --docs runs/distill-table/smoke/distill-table

A tiny run (seconds: a tiny model folder as the target, a derived 1-layer draft, a prompts file with a few
prompts per domain; nothing is read from or written to runs/):

    .venv/bin/python scripts/distill_table.py --target TINY --draft derive:TINY:keep=1 --prompts PROMPTS.jsonl \
        --eval-per-domain 1 --max-new-tokens 4 --steps 2 --runs fkl-target,fkl-draft --earlier-target-data '' \
        --root /tmp/dt --data-root /tmp/dt --docs /tmp/dt/distill-table

Pair (by default; `--target`, `--draft`): target smollm2-135m-instruct, draft derive:smollm2-135m-instruct:keep=4
(its first 4 layers, own final norm, tied head). Everything happens in ONE process: the models are loaded once,
the held-out split is the one `draftsmith distill` makes (the first 6 prompts of each of code, json, summarize,
chat), the reference continuations (48 tokens, greedy) are built once (cached), the training data is generated
once per source, and every run trains a fresh copy of the same draft (`train` deep-copies it; a fingerprint of
the draft's weights is checked before each run) with the same TrainConfig apart from `loss`: 60 steps of 4 rows,
lr 5e-4, 6 warm-up steps, cosine, seed 0 (the same data order for every source).

Runs are ordered so that the table is usable if it stops early (fkl/tvd on target data, fkl on draft data,
the other losses on target data, then the rest). A finished run (its `table_row.json`) is skipped on a
rerun; an interrupted one resumes from its checkpoint. After every run docs/distill-table.{json,md} are
rewritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.decode.runtime.errors import DraftsmithError  # noqa: E402
from draftsmith.decode.runtime.io import atomic_write_json, atomic_write_text  # noqa: E402
from draftsmith.decode.runtime.loading import load  # noqa: E402
from draftsmith.decode.runtime.machine import machine_info, versions  # noqa: E402
from draftsmith.decode.prompts import load_prompts  # noqa: E402
from draftsmith.distill.data import generate_data  # noqa: E402
from draftsmith.distill.pipeline import split_prompts  # noqa: E402
from draftsmith.distill.train import TrainConfig, train  # noqa: E402
from draftsmith.pairing.derive import resolve_candidate  # noqa: E402
from draftsmith.pairing.reference import reference_continuations  # noqa: E402

TARGET = "smollm2-135m-instruct"
DRAFT = "derive:smollm2-135m-instruct:keep=4"
SUITES = "code,json,summarize,chat"
EVAL_PER_DOMAIN = 6
MAX_NEW_TOKENS = 48
DATA_TEMPERATURE = 1.0
MIX = 0.5
LOSSES = ("fkl", "rkl", "jsd", "tvd")
SOURCES = ("target", "draft", "mixed")
# most informative first: the table must be usable if the run is stopped early
ORDER = ["fkl-target", "tvd-target", "fkl-draft", "rkl-target", "jsd-target", "fkl-mixed", "tvd-draft",
         "tvd-mixed", "rkl-draft", "jsd-draft", "rkl-mixed", "jsd-mixed"]
EARLIER_TARGET_DATA = "runs/distill-smollm2/data"  # the target's data of an earlier run, copied when it matches


def config(loss: str, steps: int) -> TrainConfig:
    return TrainConfig(loss=loss, steps=steps, batch_size=4, lr=5e-4, warmup_steps=6, eval_every=steps,
                       save_every=steps, seed=0, wandb="disabled")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fingerprint(model: torch.nn.Module) -> float:
    """A cheap checksum of the draft's weights: it must not change between runs (each run trains a copy)."""
    with torch.no_grad():
        return float(sum(p.detach().double().abs().sum().item() + p.detach().double().sum().item()
                         for p in model.parameters()))


def data_stats(ds) -> dict:
    lens = [len(c) for c in ds["continuation_ids"]]
    src = list(ds["source"])
    return {"rows": len(ds), "continuation_tokens": sum(lens), "mean_continuation_tokens": sum(lens) / len(lens),
            "rows_from_draft": src.count("draft"), "rows_from_target": src.count("target")}


def shown(path: Path) -> str:
    """`path` as written in the results: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def get_data(target, draft, train_p, data_root: Path, source: str, max_new_tokens: int,
             earlier: Path | None) -> tuple[object, dict]:
    """The training data of `source` in data_root/data-<source> (made, reused, or copied from `earlier`, the
    target's data of an earlier run, when `generate_data` accepts it); with what was done, for the results."""
    out = data_root / f"data-{source}"
    info: dict = {"folder": shown(out)}
    earlier = earlier if earlier is not None and (earlier / "dataset").is_dir() else None
    if source == "target" and not out.exists() and earlier is not None:
        shutil.copytree(earlier, out)
        info["copied_from"] = shown(earlier)
        say(f"copied {earlier} -> {out}")
    had_dataset = (out / "dataset").is_dir()
    t0 = time.perf_counter()

    def generate():
        return generate_data(target, draft, train_p, out, source=source, mix=MIX, max_new_tokens=max_new_tokens,
                             temperature=DATA_TEMPERATURE, seed=0, speculative=False)

    try:
        ds = generate()
    except DraftsmithError as e:
        if "copied_from" not in info:
            raise
        say(f"the copied data was refused ({e}); regenerating")
        shutil.rmtree(out)
        info["copy_refused"] = str(e)
        had_dataset = False
        ds = generate()
    info["reused"] = had_dataset
    info["seconds"] = time.perf_counter() - t0
    info.update(data_stats(ds))
    first = out / "table_data_info.json"  # how the folder was made, kept for later (reusing) runs
    if had_dataset and first.is_file():
        info["first_made"] = json.loads(first.read_text(encoding="utf-8"))
    elif not had_dataset or "copied_from" in info:
        atomic_write_json(first, dict(info))
    if source == "target" and "copied_from" not in info and earlier is not None:
        from datasets import load_from_disk

        orig = load_from_disk(str(earlier / "dataset"))
        info["identical_to_earlier_run_data"] = list(orig["continuation_ids"]) == list(ds["continuation_ids"])
    if "copied_from" in info and had_dataset:
        from datasets import load_from_disk

        orig = load_from_disk(str(earlier / "dataset"))
        same = list(orig["continuation_ids"]) == list(ds["continuation_ids"])
        info["copy_accepted_identical_rows"] = same
        say(f"generate_data accepted the copied target data ({len(ds)} rows, identical rows: {same})")
    else:
        say(f"data {source}: {'reused' if had_dataset else 'generated'} {len(ds)} rows in {info['seconds']:.0f}s")
    return ds, info


def read_log(path: Path, steps: int) -> dict:
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    evals = {x["step"]: x for x in lines if x.get("eval")}
    train_lines = sorted((x for x in lines if not x.get("eval")), key=lambda x: x["step"])
    losses = [x["loss"] for x in train_lines]
    last = evals.get(steps) or (evals[max(evals)] if evals else None)
    tail = losses[-10:]
    return {
        "alpha_final": last["alpha"] if last else None,
        "alpha_final_step": last["step"] if last else None,
        "alpha_by_domain_final": last["alpha_by_domain"] if last else None,
        "positions": last["positions"] if last else None,
        "alpha_before_by_domain": evals[0]["alpha_by_domain"] if 0 in evals else None,
        "loss_first": losses[0] if losses else None,
        "loss_final": losses[-1] if losses else None,
        "loss_last10_mean": sum(tail) / len(tail) if tail else None,
        "train_tokens": sum(x["tokens"] for x in train_lines),
        "skipped_steps": sum(bool(x.get("skipped")) for x in train_lines),
    }


def run_one(name: str, target, draft, data, refs, root: Path, steps: int, draft_print: float) -> dict:
    loss, source = name.split("-")
    out = root / name
    row_path = out / "table_row.json"
    cfg = config(loss, steps)
    if row_path.is_file():
        row = json.loads(row_path.read_text(encoding="utf-8"))
        if row.get("config") == asdict(cfg):
            say(f"{name}: done already (alpha {row['alpha_before']:.3f} -> {row['alpha_after']:.3f}), skipped")
            return row
        raise DraftsmithError(f"{row_path} was made with another config; remove {out} to rerun it")
    if fingerprint(draft.model) != draft_print:
        raise DraftsmithError("the draft's weights changed between runs: runs would not start from the same draft")
    resumed = (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step-*"))
    say(f"{name}: training {loss} on {source} data, {steps} steps{' (resuming)' if resumed else ''}")
    t0 = time.perf_counter()
    summary = train(target, draft, data, refs, out, cfg, resume=True)
    wall = time.perf_counter() - t0
    log = read_log(out / "log.jsonl", steps)
    row = {
        "run": name, "loss": loss, "data_source": source, "out": shown(out),
        "alpha_before": summary["alpha_before"],
        "alpha_after": log["alpha_final"],  # at the last step (not the best eval, which could be step 0)
        "alpha_gain": log["alpha_final"] - summary["alpha_before"],
        "alpha_best": summary["alpha_after"], "best_step": summary["best_step"],
        **{k: v for k, v in log.items() if k != "alpha_final"},
        "train_seconds": wall, "resumed": resumed,
        "load_avg_after": os.getloadavg(),
        "config": asdict(cfg),
    }
    atomic_write_json(row_path, row)
    say(f"{name}: alpha {row['alpha_before']:.3f} -> {row['alpha_after']:.3f} ({row['alpha_gain']:+.3f}), "
        f"{loss} {row['loss_last10_mean']:.4f} (mean of last 10 steps), {wall:.0f}s")
    return row


def annotate_pauses(root: Path, rows: dict[str, dict]) -> None:
    """Seconds each run's process spent stopped (SIGSTOP by other work on the shared machine), when known:
    `root/pauses.txt` holds one "<epoch seconds> stopped" line per 10-second sample of a stopped process, and
    `root/log.txt` the start and end time (HH:MM:SS, same day) of each run."""
    pauses, log = root / "pauses.txt", root / "log.txt"
    if not pauses.is_file() or not log.is_file():
        return
    import datetime as dt
    import re

    samples = [int(x.split()[0]) for x in pauses.read_text().splitlines() if x.strip()]
    day = dt.datetime.fromtimestamp(log.stat().st_mtime, dt.timezone.utc).date()
    times: dict[str, dict[str, float]] = {}
    for line in log.read_text(encoding="utf-8", errors="replace").replace("\r", "\n").splitlines():
        m = re.match(r"\[(\d\d):(\d\d):(\d\d)\] (\w+-\w+): (training|alpha)", line)
        if m:
            t = dt.datetime(day.year, day.month, day.day, int(m[1]), int(m[2]), int(m[3]), tzinfo=dt.timezone.utc)
            times.setdefault(m[4], {})["start" if m[5] == "training" else "end"] = t.timestamp()
    for name, r in rows.items():
        t = times.get(name, {})
        if "start" in t and "end" in t and not r.get("resumed"):
            stopped = 10 * sum(t["start"] <= x <= t["end"] for x in samples)
            r["stopped_seconds"] = stopped
            r["active_seconds"] = r["train_seconds"] - stopped


def write_docs(docs: Path, meta: dict, rows: dict[str, dict]) -> None:
    docs.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(docs.with_suffix(".json"), {**meta, "runs": [rows[n] for n in ORDER if n in rows]})
    steps = meta["train_config"]["steps"]
    settings = meta["data_settings"]
    published = (meta["target"], meta["draft"]) == (TARGET, DRAFT)  # the pair of docs/distill-table.md
    n_train = meta["train_prompts"]
    lines = [
        "# Distillation: loss x data source at equal budget (issue 4)",
        "",
        f"Target `{meta['target']}`, draft `{meta['draft']}`"
        + (" (SmolLM2's first 4 layers, its final norm and tied head)" if meta["draft"] == DRAFT else "") + ". "
        f"Cells: teacher-forced greedy α on the {meta['held_out_prompts']} held-out prompts after {steps} steps "
        "(gain over the untouched draft in brackets). Made by `scripts/distill_table.py` "
        f"(command: `{meta['command']}`).",
        "",
        "| loss \\ data | " + " | ".join(SOURCES) + " |",
        "|---|" + "---|" * len(SOURCES),
    ]
    for loss in LOSSES:
        cells = []
        for source in SOURCES:
            r = rows.get(f"{loss}-{source}")
            cells.append(f"{r['alpha_after']:.3f} ({r['alpha_gain']:+.3f})" if r else "not run")
        lines.append(f"| {loss} | " + " | ".join(cells) + " |")
    done = [rows[n] for n in ORDER if n in rows]
    if done:
        before = done[0]["alpha_before"]
        pos = done[0].get("positions") or 0
        se = (0.25 / pos) ** 0.5 if pos else float("nan")
        lines += [
            "",
            "Per run (α by domain after training; `loss` is the run's own divergence in nats per token, the mean of "
            "its last 10 steps: comparable down a column of one loss, not across losses):",
            "",
            "| run | α before | α after | gain | best α (step) | chat | code | json | summarize | loss (first -> last 10) "
            "| train tokens | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in done:
            d = r["alpha_by_domain_final"] or {}
            lines.append(
                f"| {r['run']} | {r['alpha_before']:.3f} | {r['alpha_after']:.3f} | {r['alpha_gain']:+.3f} | "
                f"{r['alpha_best']:.3f} ({r['best_step']}) | "
                + " | ".join(f"{d.get(k, float('nan')):.3f}" for k in ("chat", "code", "json", "summarize"))
                + f" | {r['loss_first']:.3f} -> {r['loss_last10_mean']:.3f} | {r['train_tokens']} | "
                f"{r['train_seconds']:.0f}{' (resumed)' if r['resumed'] else ''}"
                + (f" ({r['stopped_seconds']:.0f} stopped)" if r.get("stopped_seconds") else "") + " |"
            )
        best = max(done, key=lambda r: r["alpha_after"])
        lines += [
            "",
            "## Notes",
            "",
            f"- **Budget**: every run is the same: {steps} optimizer steps of "
            f"{meta['train_config']['batch_size']} rows (prompt + continuation), full fine-tuning, AdamW lr "
            f"{meta['train_config']['lr']}, {meta['train_config']['warmup_steps']} warm-up steps then cosine, "
            "gradient clipping 1.0, seed 0 (so the same prompts in the same order for every source), each from a "
            "fresh copy of the same untouched draft (α before = "
            f"{before:.3f}). Only `loss` and the training rows differ. Rows per step are equal; continuation "
            f"tokens per step differ a little between sources (text stops at EOS or at {settings['max_new_tokens']} "
            "tokens): see 'train tokens'.",
            f"- **Data sources** ({meta['train_prompts']} training prompts, {settings['max_new_tokens']} new tokens, "
            f"temperature {settings['temperature']}, generated once per source): `target` = the target's own sampled "
            "continuations; `draft` = on-policy continuations sampled from the un-distilled draft (generated once "
            "before training, not refreshed as the student changes), scored by the target at training time "
            "(the loss compares the student's and the target's distributions at every position of that text); "
            f"`mixed` = {meta['data'].get('mixed', {}).get('rows_from_draft', round(settings['mix'] * n_train))} "
            f"prompts (a seeded choice of round({settings['mix']} x n)) "
            "with draft text, the rest with target text (row for row the same text as in the pure sources). Mean "
            "continuation length: " + ", ".join(f"{s} {meta['data'][s]['mean_continuation_tokens']:.1f}"
                                                 for s in SOURCES if s in meta["data"]) + " tokens.",
            f"- **Evaluation**: α is measured teacher-forced and greedy on the target's own greedy continuations "
            f"of the held-out prompts ({pos} positions); positions are not independent, so treat differences "
            f"below about 2 x {se:.3f} (the binomial standard error at α = 0.5) as noise.",
            f"- Best cell: **{best['loss']} on {best['data_source']} data, α {best['alpha_after']:.3f} "
            f"({best['alpha_gain']:+.3f})**."
            + (" For comparison, the earlier fkl/target run (docs/distill-smollm2.json: 150 steps, 10 warm-up) "
               "reached α 0.196 at step 50 and 0.250 at step 100." if published else ""),
        ]
        for loss in LOSSES:
            have = [(s, rows[f"{loss}-{s}"]["alpha_after"]) for s in SOURCES if f"{loss}-{s}" in rows]
            if len(have) > 1:
                lines.append(f"- {loss} by data source: " + ", ".join(f"{s} {a:.3f}" for s, a in have) + ".")
        tgt = [(l, rows[f"{l}-target"]["alpha_after"]) for l in LOSSES if f"{l}-target" in rows]
        if len(tgt) > 1:
            tgt.sort(key=lambda x: -x[1])
            lines.append("- Losses on target data, best first: " + ", ".join(f"{l} {a:.3f}" for l, a in tgt) + ".")
        total = sum(r["train_seconds"] for r in done)
        stopped = sum(r.get("stopped_seconds", 0) for r in done)
        lines += [
            f"- Machine: {meta['machine']['cpu']}, {meta['machine']['cpu_count']} cores, torch "
            f"{meta['versions']['torch']}, transformers {meta['versions']['transformers']}; shared with other work "
            f"while this ran (load average at start {meta['load_avg_start'][0]:.1f}), so wall seconds are "
            f"indicative only. Training wall time of the runs above: {total / 60:.1f} min"
            + (f", of which {stopped / 60:.1f} min with the process stopped (SIGSTOP) by other work's benchmarks "
               "(sampled every 10 s)" if stopped else "") + ".",
        ]
        walls = sorted(r["train_seconds"] for r in done)
        median = walls[len(walls) // 2]
        slow = [n for n in ORDER if n in rows and rows[n]["train_seconds"] > 2 * median]
        if slow:
            lines.append(f"- {', '.join(slow)} took over twice the median run's {median:.0f} s: they shared the 2 "
                         "cores with other work (paused, or oversubscribed threads). Their α is not affected: the "
                         "same steps on the same rows in the same order.")
        if meta.get("total_seconds_this_process"):
            reused = [s for s in ("draft", "mixed") if meta["data"].get(s, {}).get("reused")]
            lines.append(f"- The script's last invocation took {meta['total_seconds_this_process'] / 60:.1f} min in "
                         "one process (it resumes: runs finished earlier are loaded, not redone)"
                         + (f"; the {' and '.join(reused)} data had been generated by the smoke run (see `data` in "
                            "the JSON)" if reused else "") + ".")
    atomic_write_text(docs.with_suffix(".md"), "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT, help="a model, or derive:<target>:keep=N (pairing.derive)")
    ap.add_argument("--prompts", default=SUITES, help="suite names or a prompts file")
    ap.add_argument("--eval-per-domain", type=int, default=EVAL_PER_DOMAIN, help="held-out prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="of the data and the references")
    ap.add_argument("--earlier-target-data", default=EARLIER_TARGET_DATA,
                    help="an earlier run's data folder of the target, copied in when it matches ('' for none)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", default=",".join(ORDER), help="comma-separated LOSS-SOURCE names, run in ORDER's order")
    ap.add_argument("--root", default="runs/distill-table")
    ap.add_argument("--data-root", default="runs/distill-table", help="data-<source>/ folders (shared by smoke runs)")
    ap.add_argument("--docs", default="docs/distill-table", help="writes DOCS.json and DOCS.md")
    ap.add_argument("--docs-only", action="store_true",
                    help="rebuild DOCS.json/.md from the finished runs and DOCS.json's metadata; loads no model")
    args = ap.parse_args()
    wanted = [n for n in ORDER if n in set(args.runs.split(","))]
    unknown = set(args.runs.split(",")) - set(ORDER)
    if unknown:
        raise SystemExit(f"unknown runs: {sorted(unknown)}")
    root, docs = ROOT / args.root, ROOT / args.docs
    root.mkdir(parents=True, exist_ok=True)
    if args.docs_only:
        meta = json.loads(docs.with_suffix(".json").read_text(encoding="utf-8"))
        meta.pop("runs", None)
        rows = {n: json.loads((root / n / "table_row.json").read_text(encoding="utf-8")) for n in ORDER
                if (root / n / "table_row.json").is_file()}
        rows = {n: r for n, r in rows.items() if r["config"]["steps"] == args.steps}
        for s in meta.get("data", {}):
            first = ROOT / args.data_root / f"data-{s}" / "table_data_info.json"
            if first.is_file():
                meta["data"][s]["first_made"] = json.loads(first.read_text(encoding="utf-8"))
        annotate_pauses(root, rows)
        write_docs(docs, meta, rows)
        say(f"rebuilt {docs}.json and {docs}.md from {len(rows)} runs")
        return
    t_start = time.perf_counter()
    load_avg_start = os.getloadavg()
    say(f"start; load average {load_avg_start}; runs: {', '.join(wanted)}")

    target = load(args.target)
    draft = load(resolve_candidate(args.draft))
    draft.name = args.draft
    draft_print = fingerprint(draft.model)
    train_p, held = split_prompts(load_prompts(args.prompts), args.eval_per_domain)
    say(f"{len(train_p)} training prompts, {len(held)} held out")
    refs = reference_continuations(target, held, max_new_tokens=args.max_new_tokens)
    earlier = ROOT / args.earlier_target_data if args.earlier_target_data else None

    sources = [s for s in SOURCES if any(n.endswith(f"-{s}") for n in wanted)]
    data, data_info = {}, {}
    for s in sources:
        data[s], data_info[s] = get_data(target, draft, train_p, ROOT / args.data_root, s, args.max_new_tokens,
                                         earlier)
    if set(data) == set(SOURCES):  # each prompt has its own seed: mixed rows must equal the pure sources' rows
        mixed = data["mixed"]
        same = sum(list(c) == list(data[src][i]["continuation_ids"])
                   for i, (src, c) in enumerate(zip(mixed["source"], mixed["continuation_ids"])))
        data_info["mixed"]["rows_identical_to_pure_source"] = same
        say(f"mixed data: {same}/{len(mixed)} rows identical to the same prompt's row in the pure source")

    meta = {
        "issue": 4, "target": args.target, "draft": args.draft, "prompts": args.prompts,
        "eval_per_domain": args.eval_per_domain, "train_prompts": len(train_p), "held_out_prompts": len(held),
        "reference_max_new_tokens": args.max_new_tokens, "data": data_info,
        "data_settings": {"max_new_tokens": args.max_new_tokens, "temperature": DATA_TEMPERATURE, "seed": 0, "mix": MIX,
                          "speculative": False},
        "train_config": asdict(config("fkl", args.steps)) | {"loss": "varies"},
        "command": " ".join([".venv/bin/python", "scripts/distill_table.py", *map(shlex.quote, sys.argv[1:])]),
        "machine": machine_info(), "versions": versions(), "load_avg_start": load_avg_start,
    }
    rows: dict[str, dict] = {}
    for name in ORDER:  # rows finished earlier (even if not asked for now) stay in the table
        p = root / name / "table_row.json"
        if p.is_file():
            r = json.loads(p.read_text(encoding="utf-8"))
            if r.get("config", {}).get("steps") == args.steps:
                rows[name] = r
    for name in wanted:
        if name.split("-")[1] not in data:
            continue
        rows[name] = run_one(name, target, draft, data[name.split("-")[1]], refs, root, args.steps, draft_print)
        meta["total_seconds_this_process"] = time.perf_counter() - t_start
        annotate_pauses(root, rows)
        write_docs(docs, meta, rows)
    meta["total_seconds_this_process"] = time.perf_counter() - t_start
    write_docs(docs, meta, rows)
    say(f"done in {meta['total_seconds_this_process'] / 60:.1f} min; wrote {docs}.json and {docs}.md")


if __name__ == "__main__":
    main()
