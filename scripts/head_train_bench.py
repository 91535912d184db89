"""How fast a head trains: seconds per optimizer step of `distill.heads.train.train_head` on synthetic rows.

    .venv/bin/python scripts/head_train_bench.py --steps 40 --out docs/head-train-bench/after
    git worktree add /tmp/old b2e6029 && (cd /tmp/old && PYTHONPATH=. "$OLDPWD/.venv/bin/python" \
        "$OLDPWD/scripts/head_train_bench.py" --out "$OLDPWD/docs/head-train-bench/before")

The rows have the shapes of the SmolLM2 head recipe's data (random tokens, float16 features and final hidden
states, ~205 tokens with an 80-token prompt); the head trains on them with the recipe's settings (8 rows a
step, 2 depths unrolled, bfloat16 matmuls, `--draft-vocab` draft ids, the aux layers
`distill.heads.pipeline.aux_layers_for` gives), `--steps` steps per repeat, with no held-out evaluation but the
one at the start and the end. Writes bench.json: seconds per step of every repeat (the
first repeat's first steps include warm-up), the machine and the versions. Old code runs the same script
(PYTHONPATH), as above. Smoke run on a tiny model folder (a Llama of >= 4 layers):

    .venv/bin/python scripts/head_train_bench.py --target TINY --steps 2 --repeats 1 --draft-vocab 16 --out /tmp/htb
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.decode.runtime.allocator import keep_freed_memory
from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.distill.heads.pipeline import aux_layers_for
from draftsmith.distill.heads.train import HeadTrainConfig, train_head


def synthetic_rows(n: int, vocab: int, hidden: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        T = int(torch.randint(180, 230, (1,), generator=g))
        rows.append({"tokens": torch.randint(0, vocab, (T,), generator=g),
                     "features": torch.randn(T, 3 * hidden, generator=g).half(),
                     "final": torch.randn(T, hidden, generator=g).half(),
                     "next": torch.randint(0, vocab, (T,), generator=g).int(), "prompt_len": 80})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="ids the head can propose")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    keep_freed_memory()
    target = load(args.target)
    c = target.model.config
    rows = synthetic_rows(8 * args.steps, c.vocab_size, c.hidden_size, 0)
    held = synthetic_rows(1, c.vocab_size, c.hidden_size, 1)
    aux = aux_layers_for(c.num_hidden_layers)  # (2, 15, 27) for SmolLM2's 30 layers
    cfg = HeadTrainConfig(draft_vocab_size=args.draft_vocab, ttt_steps=2, lr=6e-3, epochs=1.0, rows_per_step=8,
                          eval_every=10**9, dtype="bfloat16")
    per_step = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            summary = train_head(target, rows, held, Path(tmp), cfg, aux_layers=aux, progress=False)
            per_step.append((time.perf_counter() - t0) / summary["steps"])
    result = {"target": args.target, "steps": args.steps, "rows_per_step": 8, "ttt_steps": 2, "dtype": "bfloat16",
              "draft_vocab_size": args.draft_vocab, "aux_layers": list(aux), "seconds_per_step": per_step,
              "median_seconds_per_step": statistics.median(per_step), "machine": machine_info(), "versions": versions()}
    atomic_write_json(args.out / "bench.json", result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "versions")}, indent=1))


if __name__ == "__main__":
    main()
