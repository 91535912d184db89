"""On-policy training data at throughput, side by side with the target writing the data itself, in one process.

    .venv/bin/python scripts/onpolicy_bench.py --out docs/onpolicy-bench
    .venv/bin/python scripts/onpolicy_bench.py --from docs/onpolicy-bench/bench.json

The same prompts (by default the first 2 dev prompts of each built-in suite, 8 in all; never the test split), the
same per-prompt seeds and length (--max-new-tokens, 32 by default: 2 rounds of the three paths in about 10 minutes
on 2 cores; longer answers weigh the prompts' prefill less), written by each path into a scratch folder of its own
(nothing resumes):

- speculative: the target's rows as `gen-data --speculative-data` writes them (`distill.data.generate_data`,
  source target: the draft's int8 copy proposes, the target verifies, one prompt at a time); no top-k kept.
- batched: the target's rows as `gen-data` writes them by default (plain, --batch-size rows at once through
  `decode.batch`), the target's top-k kept as it decodes (the teacher cache without a second pass).
- onpolicy: the draft's int4 copy (`draft_quant`, `decode.batch.quantized_writer`) writes --batch-size rows at
  once (source draft), then the target scores them by a batched prefill (`distill.teacher_cache.build_teacher_cache`,
  top-k in float16 with int32 ids): the seconds of both phases count.

Tokens are the continuation tokens each path produced; a path's seconds are its generation's (stats.json's:
making runners and quantised copies is setup, reported apart, as every path pays it once per run, not per row)
plus, for onpolicy, the scorer's. One untimed warm-up of each path first (row plans, weight packing, the int4
copy); then --repeats rounds in alternating order (A B C, C B A, ...) so drift hits every path alike. Prints a
table and writes <out>/bench.json (atomically) with every run's raw seconds and tokens, tokens/s per path, the
ratios of onpolicy to each target path and to the faster one (the goal: >= 5x), the scorer's tokens/s alone over the
faster one (what onpolicy would reach with a writer of no cost), the machine, the versions and the command.
`--device cuda` runs both models on a GPU (the writer is then the draft as loaded). `--from FILE` prints a
bench.json again. Smoke run on tiny model folders:

    .venv/bin/python scripts/onpolicy_bench.py --target TINY --draft TINY --prompts prompts.jsonl --per-domain 1 \
        --max-new-tokens 4 --repeats 1 --out /tmp/opb
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, read_json
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.prompts import load_prompts
from draftsmith.distill.data import data_stats, generate_data, training_rows
from draftsmith.distill.pipeline import repeat_prompts
from draftsmith.distill.teacher_cache import build_teacher_cache

PATHS = ("speculative", "batched", "onpolicy")
TARGET_PATHS = ("speculative", "batched")
GOAL = 5.0


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", default="code,json,summarize,chat", help="suite names (dev prompts) or a file")
    ap.add_argument("--per-domain", type=int, default=2, help="the first N prompts of each domain")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="32: 2 rounds in ~10 min on 2 cores")
    ap.add_argument("--samples", type=int, default=1, help="answers to each prompt (rows ID, ID~2, ...: each its "
                    "own seed), on every path; the scorer prefills a prompt once for all of its answers")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8, help="rows written at once (batched, onpolicy)")
    ap.add_argument("--quant", default="int4", choices=["int4", "int8"], help="the on-policy writer's copy")
    ap.add_argument("--teacher-topk", type=int, default=32, help="k kept by the batched and onpolicy paths")
    ap.add_argument("--teacher-cache-dtype", default="float16", choices=["float16", "float32"])
    ap.add_argument("--score-batch-size", type=int, default=8, help="rows a prefill when the target scores")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both models run (off the CPU the "
                    "on-policy writer is the draft as loaded: the int4 / int8 copies are CPU kernels)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--progress", action="store_true", help="show the writers' and the scorer's bars")
    ap.add_argument("--out", type=Path, default=Path("docs/onpolicy-bench"))
    ap.add_argument("--from", dest="from_file", type=Path, help="print this bench.json again; nothing runs")
    args = ap.parse_args()
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not args.paths or any(p not in PATHS for p in args.paths):
        ap.error(f"--paths: comma-separated names of {', '.join(PATHS)}")
    if args.samples < 1:
        ap.error("--samples: at least 1")
    return args


def run_path(path: str, target, draft, prompts, folder: Path, args, *, max_new_tokens: int) -> dict:
    """One path over `prompts` into `folder` -> its tokens and seconds (generation, scoring, setup apart)."""
    kw = dict(max_new_tokens=max_new_tokens, temperature=args.temperature, seed=args.seed, progress=args.progress,
              batch_size=args.batch_size)
    if path == "speculative":
        ds = generate_data(target, draft, prompts, folder, source="target", speculative=True, **kw)
    elif path == "batched":
        ds = generate_data(target, draft, prompts, folder, source="target", topk=args.teacher_topk, **kw)
    else:
        ds = generate_data(target, draft, prompts, folder, source="draft", draft_quant=args.quant, **kw)
    stats = data_stats(folder)
    run = {"path": path, "rows": len(ds), "tokens": stats["new_tokens"], "write_seconds": stats["seconds"],
           "setup_seconds": stats.get("setup_seconds", 0.0)}
    score = 0.0
    if path == "onpolicy":
        rows = training_rows(ds)
        t0 = time.perf_counter()
        build_teacher_cache(target, rows, folder / "teacher-topk", k=args.teacher_topk,
                            dtype=args.teacher_cache_dtype, batch_size=args.score_batch_size, progress=args.progress)
        score = time.perf_counter() - t0
        settings = read_json(folder / "settings.json", what="data settings")
        run.update(score_seconds=score, prefill_tokens=sum(len(p) + len(c) for p, c in rows),
                   writer=settings.get("draft_quant") or "as loaded")
    run["seconds"] = run["write_seconds"] + score
    run["tokens_per_s"] = run["tokens"] / max(run["seconds"], 1e-9)
    return run


def summarize(runs: list[dict], paths: list[str]) -> dict:
    """Tokens/s per path (its tokens over its seconds, all rounds) and the ratios of onpolicy to the target's."""
    per = {}
    for p in paths:
        mine = [r for r in runs if r["path"] == p]
        tokens, seconds = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
        per[p] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
                  "rounds_tokens_per_s": [r["tokens_per_s"] for r in mine]}
        if p == "onpolicy":
            write, score = sum(r["write_seconds"] for r in mine), sum(r["score_seconds"] for r in mine)
            per[p].update(write_seconds=write, score_seconds=score, write_tokens_per_s=tokens / max(write, 1e-9),
                          score_tokens_per_s=tokens / max(score, 1e-9))
    ratios = {}
    if "onpolicy" in per:
        b = per["onpolicy"]["tokens_per_s"]
        for p in TARGET_PATHS:
            if p in per:
                ratios[f"onpolicy_over_{p}"] = b / per[p]["tokens_per_s"]
        best = [per[p]["tokens_per_s"] for p in TARGET_PATHS if p in per]
        if best:
            ratios["onpolicy_over_best_target"] = b / max(best)
            # the bound with a writer of no cost: the target's scoring alone against the target writing
            ratios["score_alone_over_best_target"] = per["onpolicy"]["score_tokens_per_s"] / max(best)
    return {"per_path": per, "ratios": ratios}


def table(result: dict) -> str:
    """The result as lines: tokens/s per path, the ratios, the goal."""
    lines = [f"{result['prompts']} rows ({result.get('samples', 1)} a prompt) x {result['max_new_tokens']} new tokens, temperature "
             f"{result['temperature']}, batch {result['batch_size']}, {result['repeats']} round(s); "
             f"target {result['target']}, draft {result['draft']} (on-policy writer: {result.get('writer')})"]
    for p, s in result["per_path"].items():
        extra = (f"  (write {s['write_tokens_per_s']:.1f} tokens/s, score {s['score_tokens_per_s']:.1f} tokens/s)"
                 if p == "onpolicy" else "")
        lines.append(f"{p:12s} {s['tokens']:6d} tokens {s['seconds']:8.1f} s {s['tokens_per_s']:8.2f} tokens/s{extra}")
    for name, r in result["ratios"].items():
        lines.append(f"{name}: {r:.2f}x")
    if "onpolicy_over_best_target" in result["ratios"]:
        met = result["ratios"]["onpolicy_over_best_target"] >= result["goal"]
        lines.append(f"goal >= {result['goal']:.0f}x over the faster target path: {'met' if met else 'not met'}")
    return "\n".join(lines)


def measure(args) -> dict:
    """Load, warm up, run the rounds -> the result (not yet written)."""
    t_start = time.perf_counter()
    target, draft = load(args.target, device=args.device), load(args.draft, device=args.device)
    prompts = repeat_prompts(load_prompts(args.prompts, limit_per_domain=args.per_domain), args.samples)
    loaded = time.perf_counter() - t_start
    runs, warmup = [], []
    with tempfile.TemporaryDirectory() as scratch:
        longest = max(prompts, key=lambda p: len(p.prompt))  # the int4 copy then holds every timed run's positions
        for p in args.paths:  # untimed: row plans, weight packing, quantised copies
            n = args.max_new_tokens if p == "onpolicy" else 2
            warmup.append(run_path(p, target, draft, [longest], Path(scratch) / f"warmup-{p}", args, max_new_tokens=n))
        for r in range(args.repeats):
            for p in args.paths if r % 2 == 0 else args.paths[::-1]:
                run = run_path(p, target, draft, prompts, Path(scratch) / f"{r}-{p}", args,
                               max_new_tokens=args.max_new_tokens)
                runs.append({"round": r, **run})
                print(json.dumps(runs[-1]), flush=True)
    writer = next((r["writer"] for r in runs if r["path"] == "onpolicy"), None)
    return {"target": args.target, "draft": args.draft, "prompts": len(prompts), "prompt_source": args.prompts,
            "per_domain": args.per_domain, "samples": args.samples, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "seed": args.seed, "batch_size": args.batch_size, "quant": args.quant, "writer": writer,
            "teacher_topk": args.teacher_topk, "teacher_cache_dtype": args.teacher_cache_dtype,
            "score_batch_size": args.score_batch_size, "device": args.device, "repeats": args.repeats,
            "paths": args.paths, "runs": runs,
            "warmup": warmup, **summarize(runs, args.paths), "goal": GOAL, "load_seconds": loaded,
            "wall_seconds": time.perf_counter() - t_start, "machine": machine_info(), "versions": versions(),
            "command": shlex.join(["python", *sys.argv])}


def main() -> None:
    args = parse()
    if args.from_file is not None:
        print(table(read_json(args.from_file, what="bench result")))
        return
    try:
        result = measure(args)
    except DraftsmithError as e:  # an unknown model, a GPU torch does not see: one line
        raise SystemExit(f"error: {e}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "bench.json", result)
    print(table(result))
    print(f"wrote {args.out / 'bench.json'}")


if __name__ == "__main__":
    main()
