"""What a target forward over T rows costs in each Linear layout, side by side in one process.

    .venv/bin/python scripts/linear_bench.py --out docs/linear-bench    # -> docs/linear-bench/bench.json

The lean runner of `--target` first reads a `--context`-token prompt; then, per repeat and per layout
(`RuntimeSettings.linear` = dnn, xw, wx, in turn), it times forwards of T = 1..`--max-rows` tokens at that position (the
verify step of a round drafting T - 1 tokens; T = 1 is a plain decoding step), rolling the cache back each
time. Reports the median of every (layout, T), v(T) = its ratio to the same layout's one-row step, and each
layout's one-row step against the dnn one; with the machine and the versions. Smoke run on a tiny model folder:

    .venv/bin/python scripts/linear_bench.py --target TINY --context 16 --max-rows 2 --repeats 1 --reps 1 --out /tmp/lb
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.settings import configure, current
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.runtime.runner import make_runner

LAYOUTS = ("dnn", "xw", "wx")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--max-rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reps", type=int, default=4, help="timed forwards per (repeat, layout, T)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    target = load(args.target)
    g = torch.Generator().manual_seed(0)
    vocab = target.model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.context,), generator=g)
    rows = range(1, args.max_rows + 1)
    times: dict[str, dict[int, list[float]]] = {lay: {T: [] for T in rows} for lay in LAYOUTS}
    base = current()
    try:
        runners = {}
        for lay in LAYOUTS:  # each made under its layout: the BLAS ones keep their (d, V) output-head copy
            configure(base.but(linear=lay))
            runners[lay] = make_runner(target.model, args.context + args.max_rows + 8)
            runners[lay].forward(prompt, 0)
        for _ in range(args.repeats):
            for lay in LAYOUTS:
                configure(base.but(linear=lay))
                runner = runners[lay]
                for T in rows:
                    tokens = torch.randint(0, vocab, (T,), generator=g)
                    runner.forward(tokens, args.context)  # warm: the layout's first call may pack or time
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        runner.forward(tokens, args.context)
                        times[lay][T].append(time.perf_counter() - t0)
    finally:
        configure(base)
    med = {lay: {T: statistics.median(ts) for T, ts in per.items()} for lay, per in times.items()}
    result = {
        "target": target.name, "context": args.context, "repeats": args.repeats, "reps": args.reps,
        "median_ms": {lay: {str(T): round(s * 1e3, 3) for T, s in per.items()} for lay, per in med.items()},
        "v": {lay: {str(T): round(s / per[1], 3) for T, s in per.items()} for lay, per in med.items()},
        "one_row_vs_dnn": {lay: round(per[1] / med["dnn"][1], 3) for lay, per in med.items()},
        "seconds": {lay: {str(T): ts for T, ts in per.items()} for lay, per in times.items()},
        "machine": machine_info(), "versions": versions(),
    }
    print(json.dumps({k: result[k] for k in ("median_ms", "v", "one_row_vs_dnn")}, indent=1))
    if args.out:
        atomic_write_json(Path(args.out) / "bench.json", result)


if __name__ == "__main__":
    main()
