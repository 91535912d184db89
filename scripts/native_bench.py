"""What an int8 draft's one-row step costs on draftsmith's own kernel (decode.runtime.native) and on fbgemm's, side by side.

    .venv/bin/python scripts/native_bench.py --out docs/results/pruned/native    # -> .../bench.json

The int8 lean runner of `--draft` (as the decoder runs it: q, k, v and gate, up stacked) reads a `--context`-token
prompt; then, per repeat, it times `--steps` one-row steps (unpadded) on the native kernel and the same steps on
fbgemm's dynamic int8 Linear, in turn, rolling the cache back; it records which rows the row plan gave the native
kernel on this machine. Reports each path's median step per repeat,
the median over repeats, and the ratio in each repeat; with the machine and the versions. Smoke run on a tiny model
folder:

    .venv/bin/python scripts/native_bench.py --draft TINY --context 8 --steps 2 --repeats 1 --out /tmp/nb
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from draftsmith.decode.runtime import native
from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.runtime.runner import make_runner


def step_ms(runner, prompt: torch.Tensor, steps: int) -> float:
    """The median of `steps` one-row forwards at positions after the prompt (each token a prompt token)."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        runner.forward(prompt[i % len(prompt)].view(1), len(prompt) + i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kernels = native.kernels()
    if kernels is None:
        raise SystemExit(f"native_bench: no native kernels on this machine: {native.why_not()}")
    draft = load(args.draft)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, draft.model.config.vocab_size, (args.context,), generator=g)
    runner = make_runner(draft.model, args.context + args.steps + 8, quantize="int8")
    runner.forward(prompt, 0)
    planned = sorted(runner.native_rows)  # what the row plan chose on this machine (large models only)
    runner.row_plan, times = {}, {"native": [], "fbgemm": []}  # one-row steps as they are, unpadded
    t_start = time.perf_counter()
    for _ in range(args.repeats):
        for path in times:
            runner.native_rows = frozenset({1}) if path == "native" else frozenset()
            times[path].append(step_ms(runner, prompt, args.steps))
    result = {
        "draft": args.draft, "context": args.context, "steps": args.steps, "repeats": args.repeats,
        "vector_lanes": kernels.lanes, "plan_native_rows": planned, "step_ms": times,
        "median_ms": {p: statistics.median(t) for p, t in times.items()},
        "fbgemm_over_native": [f / n for f, n in zip(times["fbgemm"], times["native"])],
        "seconds": time.perf_counter() - t_start, "machine": machine_info(), "versions": versions(),
    }
    ratio = result["fbgemm_over_native"]
    print(f"{args.draft} int8 one-row step: native {result['median_ms']['native']:.2f} ms, fbgemm "
          f"{result['median_ms']['fbgemm']:.2f} ms; fbgemm / native {statistics.median(ratio):.3f} "
          f"({min(ratio):.3f}-{max(ratio):.3f}) over {args.repeats} repeats")
    if args.out:
        atomic_write_json(args.out / "bench.json", result)


if __name__ == "__main__":
    main()
