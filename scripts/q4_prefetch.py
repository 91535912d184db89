"""An int4 draft's step at each prefetch distance of draftsmith's int4 kernel, and the one
`decode.runtime.native.tune_q4_ahead` chose on this machine.

    .venv/bin/python scripts/q4_prefetch.py --out docs/results/pruned/q4-prefetch    # -> .../q4-prefetch.json

One row a step after a `--context`-token prefill and 5 warm-up steps, the mean of `--steps` timed steps; `--passes`
passes, each over every distance in turn (interleaved); the median pass per distance. The outputs are the same bits
at every distance (tests/decode/runtime/test_native.py): only the time moves. Smoke run on a tiny model folder:

    .venv/bin/python scripts/q4_prefetch.py --draft TINY --context 8 --steps 2 --passes 1 --out /tmp/p
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from draftsmith.decode.runtime import native
from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.runtime.runner import make_runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    chosen = native.tune_q4_ahead()
    if not chosen:
        raise SystemExit(f"q4_prefetch: no int4 kernel here ({native.why_not() or 'no AVX-512BW or AVX2'})")
    draft = load(args.draft)
    n = args.context + 5 + args.steps
    runner = make_runner(draft.model, n + 8, quantize="int4")
    kernels = native.kernels()
    vocab = min(1000, draft.model.config.vocab_size)
    tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
    c = args.context

    def step_ms() -> float:
        runner.forward(tokens[:c], 0, keep=1)
        for i in range(5):
            runner.forward(tokens[c + i:c + i + 1], c + i, keep=1)
        start = time.perf_counter()
        for i in range(5, 5 + args.steps):
            runner.forward(tokens[c + i:c + i + 1], c + i, keep=1)
        return 1000 * (time.perf_counter() - start) / args.steps

    passes: dict[int, list[float]] = {b: [] for b in native.Q4_AHEAD_CHOICES}
    for _ in range(args.passes):
        for b in native.Q4_AHEAD_CHOICES:
            kernels.q4_ahead(b)
            passes[b].append(step_ms())
    kernels.q4_ahead(chosen)
    median = {b: sorted(v)[len(v) // 2] for b, v in passes.items()}
    builtin = native.Q4_AHEAD_CHOICES[0]
    print(f"chosen {chosen}: " + ", ".join(f"{b} {m:.2f} ms" for b, m in median.items()), flush=True)
    atomic_write_json(args.out / "q4-prefetch.json", {
        "draft": f"int4:{args.draft}", "context": c, "steps": args.steps, "chosen": chosen,
        "step_ms_passes": passes, "step_ms_median": median, "chosen_over_builtin": median[chosen] / median[builtin],
        "machine": machine_info(), "versions": versions()})


if __name__ == "__main__":
    main()
