"""What `decode.allocator.keep_freed_memory` is worth: head data and head training, with glibc's allocator as it
is and with freed memory kept, each in its own process, one after the other, twice (system, keep, system, keep).

    .venv/bin/python scripts/allocator_bench.py --out docs/allocator   # -> docs/allocator/bench.json

Each process: the target (SmolLM2 by default) writes `--samples` continuations of `--prompts` training prompts
(bfloat16 copy, features kept, as the head recipe does), then a head trains `--steps` steps on them (bfloat16
matmuls). Tokens per second of both are reported per process, and the ratios keep / system of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(args: argparse.Namespace) -> dict:
    """In this process: data, then training; tokens per second of each."""
    from decode.allocator import keep_freed_memory
    from decode.loading import load
    from decode.prompts import load_prompts
    from distill.heads.data import HeadDataConfig, build_head_data, load_head_data
    from distill.heads.pipeline import aux_layers_for
    from distill.heads.train import HeadTrainConfig, train_head

    setting = keep_freed_memory()
    target = load(args.target)
    aux = aux_layers_for(target.model.config.num_hidden_layers)
    prompts = load_prompts("code,json,summarize,chat")[: args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        data = build_head_data(target, prompts, Path(tmp) / "data", HeadDataConfig(
            samples=args.samples, max_new_tokens=args.max_new_tokens, batch_size=64, aux_layers=aux,
            dtype="bfloat16"), progress=False)
        rows = load_head_data(Path(tmp) / "data")
        t0 = time.perf_counter()
        summary = train_head(target, rows, rows[:4], Path(tmp) / "head", HeadTrainConfig(
            ttt_steps=2, epochs=args.steps * 8 / len(rows), eval_every=10 ** 6, dtype="bfloat16"),
            aux_layers=aux, progress=False)
        train_s = time.perf_counter() - t0
    gen_s = data["generate_seconds"] + data["feature_seconds"]
    return {"allocator": setting, "data_new_tokens": data["new_tokens"], "data_seconds": gen_s,
            "data_tokens_per_s": data["new_tokens"] / gen_s, "train_tokens": summary["tokens_seen"],
            "train_seconds": train_s, "train_tokens_per_s": summary["tokens_seen"] / train_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=Path("docs/allocator"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args)))
        return
    runs = []
    for setting in ("system", "keep", "system", "keep"):
        env = {**os.environ, "DRAFTSMITH_MALLOC": setting}
        cmd = [sys.executable, __file__, "--child", "--target", args.target, "--prompts", str(args.prompts),
               "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        runs.append({"setting": setting, **json.loads(out.strip().splitlines()[-1])})
        print(json.dumps(runs[-1]), flush=True)
    from decode.io import atomic_write_json
    from decode.machine import machine_info, versions

    def med(setting: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["setting"] == setting)

    result = {"runs": runs, "machine": {k: v for k, v in machine_info().items() if k != "allocator"},
              "versions": versions(), "args": {k: v for k, v in vars(args).items() if k != "child"} | {"out": str(args.out)},
              "ratio_keep_over_system": {key: med("keep", key) / med("system", key)
                                         for key in ("data_tokens_per_s", "train_tokens_per_s")}}
    atomic_write_json(args.out / "bench.json", result)
    print(json.dumps(result["ratio_keep_over_system"]))


if __name__ == "__main__":
    main()
