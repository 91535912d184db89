"""Train an EAGLE-3 draft head for a target on its own text and time it against the target alone, side by side.

    .venv/bin/python scripts/head_run.py --target smollm2-135m-instruct --out runs/head-smollm2 \
        [--samples 8 --max-new-tokens 128 --train-minutes 15 --ks 1,2,3,4]

Stages (each resumes): data/ (the target's continuations of the built-in training prompts with its features),
held/ (greedy continuations of the held-out prompts: the first `--held-per-domain` of every domain, never
trained on), head/ (training; best/ by held-out depth-1 agreement), bench.json (our decoder: the target alone
and with the head at each K, on the held-out prompts, interleaved in one run; greedy equality checked).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from decode.allocator import keep_freed_memory
from decode.batch import GEN_DTYPES
from decode.bench import validate_drafts
from decode.head import HeadDraft, load_head
from decode.io import atomic_write_json
from decode.loading import eos_ids, load
from decode.machine import machine_info, versions
from decode.prompts import load_prompts
from decode.runner import make_runner
from decode.textgen import prompt_ids
from distill.head_data import HeadDataConfig, build_head_data, load_head_data
from distill.head_pipeline import aux_layers_for
from distill.head_train import HeadTrainConfig, prompt_key, train_head
from distill.pipeline import split_prompts


def thin_rows(rows: list[dict], stride: int = 1, per_prompt: int = 0) -> list[dict]:
    """Every `stride`-th distinct prompt (in order of first appearance) with at most `per_prompt` of its rows
    (0 = all), in their order."""
    if stride < 1 or per_prompt < 0:
        raise SystemExit("--prompt-stride must be >= 1 and --rows-per-prompt >= 0")
    groups: dict[bytes, list[dict]] = {}
    for r in rows:
        groups.setdefault(prompt_key(r), []).append(r)
    keep = {id(r) for g in list(groups.values())[::stride] for r in (g[:per_prompt] if per_prompt else g)}
    return [r for r in rows if id(r) in keep]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=Path("runs/head-smollm2"))
    ap.add_argument("--prompts", default="code,json,summarize,chat")
    ap.add_argument("--held-per-domain", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--rows-per-step", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    ap.add_argument("--prompt-stride", type=int, default=1,
                    help="train: keep every S-th distinct prompt's rows (with --rows-per-prompt: what diversity buys)")
    ap.add_argument("--rows-per-prompt", type=int, default=0, help="train: keep at most N rows (samples) per prompt")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--train-minutes", type=float, default=15.0)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--bench-new-tokens", type=int, default=64)
    ap.add_argument("--stages", default="data,train,bench")
    ap.add_argument("--extra-prompts", type=Path, help="more training prompts (e.g. a gen-prompts folder), in data/")
    ap.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the target's)")
    ap.add_argument("--data-dirs", default="", help="comma-separated head data folders trained on beside data/")
    ap.add_argument("--held-dir", type=Path, help="the held-out references to evaluate on (default OUT/held)")
    ap.add_argument("--gen-dtype", default="float32", choices=list(GEN_DTYPES))
    ap.add_argument("--train-dtype", default="float32", choices=list(GEN_DTYPES))
    ap.add_argument("--label-temperature", type=float, default=1.0)
    ap.add_argument("--head-quant", default="none", choices=["none", "int8", "both"],
                    help="bench the head in float32, with int8 Linear weights, or both side by side")
    ap.add_argument("--siblings", default="0",
                    help="bench with --confidences: also run every (K, threshold > 0) proposing the head's top N "
                         "first tokens side by side below the threshold, for each N of a comma-separated list")
    ap.add_argument("--sibling-depths", default="1",
                    help="bench: with --siblings, 1 (siblings only), 2 (each with the head's next token too) or 1,2")
    ap.add_argument("--gated-name", default="bench-gated.json", help="bench: the file --confidences writes")
    ap.add_argument("--confidences", default="",
                    help="bench: comma-separated draft probabilities below which a round stops early (0 = never); "
                         "every (K, threshold) runs interleaved in one run with the target alone -> bench-gated.json")
    args = ap.parse_args()
    keep_freed_memory()
    stages = args.stages.split(",")
    target = load(args.target)
    aux = aux_layers_for(target.model.config.num_hidden_layers)
    train_p, held_p = split_prompts(load_prompts(args.prompts), args.held_per_domain)
    if args.extra_prompts:
        train_p += load_prompts(args.extra_prompts)
    held_dir = args.held_dir or args.out / "held"
    timings = {}
    if "data" in stages:
        t0 = time.perf_counter()
        stats = build_head_data(target, train_p, args.out / "data", HeadDataConfig(
            samples=args.samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            batch_size=args.batch_size, aux_layers=aux, dtype=args.gen_dtype))
        held = build_head_data(target, held_p, held_dir, HeadDataConfig(
            samples=1, max_new_tokens=args.max_new_tokens, temperature=0.0, batch_size=args.batch_size,
            aux_layers=aux))
        timings["data_seconds"] = time.perf_counter() - t0
        print(json.dumps({"train_data": stats, "held_data": held}, indent=1))
    if "train" in stages:
        folders = [args.out / "data", *[Path(d) for d in args.data_dirs.split(",") if d]]
        rows = [r for folder in folders if folder.is_dir() for r in load_head_data(folder)]
        rows = thin_rows(rows, args.prompt_stride, args.rows_per_prompt)
        held_rows = load_head_data(held_dir)
        cfg = HeadTrainConfig(draft_vocab_size=args.draft_vocab, lr=args.lr, epochs=args.epochs,
                              rows_per_step=args.rows_per_step, max_minutes=args.train_minutes,
                              eval_every=args.eval_every,
                              ttt_steps=args.ttt_steps, dtype=args.train_dtype,
                              label_temperature=args.label_temperature, intermediate_size=args.intermediate_size)
        summary = train_head(target, rows, held_rows, args.out / "head", cfg, aux_layers=aux)
        print(json.dumps({k: v for k, v in summary.items() if k != "evals"}, indent=1))
    if "bench" in stages:
        torch.set_grad_enabled(False)
        head = load_head(args.out / "head" / "best", target.model.get_input_embeddings())
        ids = [prompt_ids(target.tokenizer, p.prompt) for p in held_p]
        S = max(len(i) for i in ids) + args.bench_new_tokens + 20
        ks = [int(k) for k in args.ks.split(",")]
        t_run = make_runner(target.model, S)
        result = {"target": args.target, "head": str(args.out / "head" / "best"), "prompts": [p.id for p in held_p],
                  "by_k": {}, "machine": machine_info(), "versions": versions()}
        quants = {"none": [None], "int8": ["int8"], "both": [None, "int8"]}[args.head_quant]
        if args.confidences:  # every (K, threshold) in one interleaved run
            confs = [float(c) for c in args.confidences.split(",")]
            sibs = [int(m) for m in args.siblings.split(",") if int(m)]
            configs = [(k, c) for k in ks for c in confs if k > 1 or c == 0]
            q = quants[-1]
            depths = [int(d) for d in args.sibling_depths.split(",")]
            configs = [(k, c, 0, 1) for k, c in configs] + [(k, c, m, d) for m in sibs for d in depths for k in ks
                                                            for c in confs if c and (d == 1 or k > 1)]
            names = {cfg: f"K={cfg[0]}" + (f" stop<{cfg[1]}" if cfg[1] else "")
                     + (f" siblings={cfg[2]}" if cfg[2] else "") + (" children" if cfg[3] == 2 else "")
                     for cfg in configs}
            drafts = {names[cfg]: HeadDraft(head, S, quantize=q) for cfg in configs}
            val = validate_drafts(t_run, drafts, ids, k=ks[0], max_new_tokens=args.bench_new_tokens,
                                  eos_ids=eos_ids(target), names=[p.id for p in held_p], desc="bench",
                                  ks={names[cfg]: cfg[0] for cfg in configs},
                                  confidence={names[cfg]: cfg[1] for cfg in configs if cfg[1]},
                                  siblings={names[cfg]: cfg[2] for cfg in configs if cfg[2]},
                                  sibling_depth={names[cfg]: cfg[3] for cfg in configs})
            result.pop("by_k")
            result.update(val.to_dict(), head_quant=q, confidence={names[c]: c[1] for c in configs},
                          siblings={names[c]: c[2] for c in configs}, sibling_depth={names[c]: c[3] for c in configs},
                          drafted_per_round={n: val.stats[n].drafted / val.stats[n].target_forwards for n in drafts})
            _say(val, drafts)
            atomic_write_json(args.out / args.gated_name, result)
            return
        for k in ks:
            drafts = {("head" if q is None else f"head-{q}"): HeadDraft(head, S, quantize=q) for q in quants}
            val = validate_drafts(t_run, drafts, ids, k=k, max_new_tokens=args.bench_new_tokens,
                                  eos_ids=eos_ids(target), names=[p.id for p in held_p], desc=f"bench K={k}")
            result["by_k"][str(k)] = {**val.to_dict(), "speedup": {n: val.speedup(n) for n in drafts},
                                      "mean_tau": {n: val.stats[n].mean_tau for n in drafts},
                                      "acceptance_rate": {n: val.stats[n].acceptance_rate for n in drafts}}
            _say(val, drafts, f"K={k} ")
        atomic_write_json(args.out / ("bench.json" if args.head_quant == "none" else f"bench-{args.head_quant}.json"),
                          result)


def _say(val, names, prefix: str = "") -> None:
    """One line per draft of a validation: its speed beside the target alone's, tau, acceptance, equality."""
    for n in names:
        st = val.stats[n]
        print(f"{prefix}{n}: target alone {val.tok_per_s['target_only']:.2f} tok/s, with it {val.tok_per_s[n]:.2f} "
              f"({val.speedup(n):.2f}x), tau {st.mean_tau:.2f}, accepted/drafted {st.acceptance_rate:.3f}, "
              f"greedy-equal {val.greedy_equal[n]}")


if __name__ == "__main__":
    main()
