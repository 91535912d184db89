"""What `decode.runtime.allocator.keep_freed_memory` is worth: head data and head training, with glibc's allocator as it
is and with freed memory kept, each in its own process, one after the other, twice (system, keep, system, keep).

    .venv/bin/python scripts/allocator_bench.py --out docs/allocator   # -> docs/allocator/bench.json

Each process: the target (SmolLM2 by default) writes `--samples` continuations of `--prompts` training prompts
(bfloat16 copy, features kept, as the head recipe does), then a head trains `--steps` steps on them (bfloat16
matmuls). Tokens per second of both are reported per process, and the ratios keep / system of the medians.
Smoke run on a tiny model folder (a Llama of >= 4 layers), one process per setting:

    .venv/bin/python scripts/allocator_bench.py --target TINY --prompts 4 --samples 1 --max-new-tokens 4 \
        --steps 2 --draft-vocab 16 --settings system,keep --out /tmp/allocator
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
    from draftsmith.decode.runtime.allocator import keep_freed_memory
    from draftsmith.decode.runtime.settings import configure
    from draftsmith.recipes.cli import settings_from_env
    from draftsmith.decode.runtime.loading import load
    from draftsmith.decode.prompts import load_prompts
    from draftsmith.distill.heads.data import HeadDataConfig, build_head_data, load_head_data
    from draftsmith.distill.heads.pipeline import aux_layers_for
    from draftsmith.distill.heads.train import HeadTrainConfig, train_head

    configure(settings_from_env(os.environ))  # DRAFTSMITH_MALLOC, as the parent set it for this process
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
            draft_vocab_size=args.draft_vocab, ttt_steps=2, epochs=args.steps * 8 / len(rows), eval_every=10 ** 6,
            dtype="bfloat16"), aux_layers=aux, progress=False)
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
    ap.add_argument("--draft-vocab", type=int, default=8192, help="ids the head can propose")
    ap.add_argument("--settings", default="system,keep,system,keep", help="DRAFTSMITH_MALLOC of each process, in turn")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args)))
        return
    runs = []
    settings = args.settings.split(",")
    if not {"system", "keep"} <= set(settings) or not set(settings) <= {"system", "keep"}:
        raise SystemExit(f"--settings: a list of system and keep, both present; got {args.settings!r}")
    for setting in settings:
        env = {**os.environ, "DRAFTSMITH_MALLOC": setting}
        cmd = [sys.executable, __file__, "--child", "--target", args.target, "--prompts", str(args.prompts),
               "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps),
               "--draft-vocab", str(args.draft_vocab)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"the {setting} process failed (exit {proc.returncode})")
        runs.append({"setting": setting, **json.loads(proc.stdout.strip().splitlines()[-1])})
        print(json.dumps(runs[-1]), flush=True)
    from draftsmith.decode.runtime.io import atomic_write_json
    from draftsmith.decode.runtime.machine import machine_info, versions

    def med(setting: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["setting"] == setting)

    result = {"runs": runs, "machine": {k: v for k, v in machine_info().items() if k != "allocator"},
              "versions": versions(),
              "args": {k: v for k, v in vars(args).items() if k != "child"} | {"out": str(args.out)},
              "ratio_keep_over_system": {key: med("keep", key) / med("system", key)
                                         for key in ("data_tokens_per_s", "train_tokens_per_s")}}
    atomic_write_json(args.out / "bench.json", result)
    print(json.dumps(result["ratio_keep_over_system"]))


if __name__ == "__main__":
    main()
