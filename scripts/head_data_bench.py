"""How fast the target writes a head's training data at different batch sizes, side by side in one process.

    .venv/bin/python scripts/head_data_bench.py --batch-sizes 64,256 --out docs/head-data-bench
    .venv/bin/python scripts/head_data_bench.py --prompts runs/smollm2-head-9/distill/prompts --limit 256 \
        --out docs/head-data-bench/written

Each repeat builds the same head data (`distill.heads.data.build_head_data`: the target's sampled answers with its
features, in a bfloat16 copy) once per batch size, in alternating order (64, 256, 256, 64, ...), into a scratch
folder; prints and writes bench.json with every timing, the machine and the versions. Smoke run on a tiny model
folder (a Llama of >= 4 layers):

    .venv/bin/python scripts/head_data_bench.py --target TINY --limit 4 --samples 1 --max-new-tokens 4 \
        --batch-sizes 2,4 --repeats 1 --dtype float32 --out /tmp/hdb
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from draftsmith.decode.runtime.allocator import keep_freed_memory
from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.prompts import load_prompts
from draftsmith.distill.heads.data import HeadDataConfig, build_head_data
from draftsmith.distill.heads.pipeline import aux_layers_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="code,json,summarize,chat", help="suite names, a file or a prompts folder")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts (0 = all)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("docs/head-data-bench"))
    args = ap.parse_args()
    keep_freed_memory()
    target = load(args.target)
    prompts = load_prompts(args.prompts)
    prompts = prompts[: args.limit] if args.limit else prompts
    aux = aux_layers_for(target.model.config.num_hidden_layers)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.repeats):
            for bs in sizes if r % 2 == 0 else sizes[::-1]:
                folder = Path(scratch) / f"b{bs}"
                shutil.rmtree(folder, ignore_errors=True)
                stats = build_head_data(target, prompts, folder, HeadDataConfig(
                    samples=args.samples, max_new_tokens=args.max_new_tokens, temperature=0.8, batch_size=bs,
                    aux_layers=aux, dtype=args.dtype), progress=False)
                runs.append({"batch_size": bs, "new_tokens": stats["new_tokens"], "seconds": stats["generate_seconds"],
                             "tokens_per_s": stats["new_tokens"] / stats["generate_seconds"]})
                print(json.dumps(runs[-1]), flush=True)
    by = {bs: sum(x["new_tokens"] for x in runs if x["batch_size"] == bs)
          / sum(x["seconds"] for x in runs if x["batch_size"] == bs) for bs in sizes}
    result = {"target": args.target, "prompts": args.prompts, "rows": len(prompts) * args.samples,
              "samples": args.samples, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "runs": runs,
              "tokens_per_s": {str(b): v for b, v in by.items()},
              "ratio_vs_first": {str(b): v / by[sizes[0]] for b, v in by.items()},
              "machine": machine_info(), "versions": versions()}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "bench.json", result)
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "ratio_vs_first")}, indent=1))


if __name__ == "__main__":
    main()
