"""How often a quantised draft's greedy next token is the target's, teacher-forced on the target's own greedy answers
to dev prompts, by how the draft's weights are quantised and how its prompt is prefilled.

    .venv/bin/python scripts/draft_agreement.py --out docs/results/pruned/agreement    # -> .../agreement.json

Each variant is `--draft` as the decoder opens it (`decode.runtime.runner.make_runner`); it reads each prompt in one forward
(a prefill) and then the answer one token a forward, as draft steps do, and its argmax at every answer position is
compared with the target's token there. Variants:

- float: the draft as loaded (float32);
- int8: per-row int8 weights, its prefill on draftsmith's kernel (`LeanLM.native_many`, the default);
  int8 fbgemm prefill: the same with the prefill on fbgemm's dynamic int8 Linear (one input scale for the prompt);
- int4: groups of 32 with least-squares pairs (`decode.runtime.quant.quantize_groups`, the default), prefill on the
  kernel; int4 min/max pairs: refine=0; int4 fbgemm prefill: the prefill on the int8 copy of the int4 weights
  (`Int4Linear.many`, the route prefills took before).

Dev prompts only (the first `--per-domain` of each domain of `--prompts`); the answers come from the reference cache
(`pairing.reference`, generated once). Smoke run on tiny model folders:

    .venv/bin/python scripts/draft_agreement.py --target TINY --draft TINY --prompts FILE --per-domain 1 \
        --max-new-tokens 4 --out /tmp/a
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch

from draftsmith.decode.runtime import quant
from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.prompts import first_per_domain, load_prompts
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.pairing.reference import reference_continuations

VARIANTS = ("float", "int8", "int8 fbgemm prefill", "int4", "int4 min/max pairs", "int4 fbgemm prefill")


@torch.inference_mode()
def agreement(runner, answers: list[tuple[str, list[int], list[int]]]) -> dict[str, dict]:
    """Per domain: answer positions where the runner's argmax is the target's token, of all positions."""
    out: dict[str, list[int]] = {}
    for domain, prompt, answer in answers:
        logits = [runner.forward(torch.tensor(prompt), 0, keep=1)]
        for i, tok in enumerate(answer[:-1]):
            logits.append(runner.forward(torch.tensor([tok]), len(prompt) + i))
        guess = torch.cat(logits).argmax(-1)
        n = out.setdefault(domain, [0, 0])
        n[0] += int((guess == torch.tensor(answer)).sum())
        n[1] += len(answer)
    return {d: {"agree": a, "positions": n, "rate": a / n} for d, (a, n) in out.items()}


def open_variant(model, name: str, max_len: int):
    """The runner of one variant (the module docstring)."""
    if name == "float":
        return make_runner(model, max_len)
    if name.startswith("int8"):
        runner = make_runner(model, max_len, quantize="int8")
        runner.native_many = "fbgemm" not in name
        return runner
    refine = 0 if "min/max" in name else 4
    pack = quant.pack_int4
    quant.pack_int4 = functools.partial(pack, refine=refine)
    try:
        runner = make_runner(model, max_len, quantize="int4")
    finally:
        quant.pack_int4 = pack
    if "fbgemm" in name:
        for layer in runner.modules():
            if isinstance(layer, quant.Int4Linear):
                kernel = layer.forward
                layer.forward = lambda x, kernel=kernel, layer=layer: (
                    layer.many(x) if x.dim() == 2 and x.shape[0] > 12 else kernel(x))
    return runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", default="code,chat", help="suite names or a JSONL/CSV/Parquet file")
    ap.add_argument("--per-domain", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",")]
    if unknown := [v for v in names if v not in VARIANTS]:
        raise SystemExit(f"draft_agreement: unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    target = load(args.target)
    prompts = first_per_domain(load_prompts(args.prompts), args.per_domain)
    refs = reference_continuations(target, prompts, max_new_tokens=args.max_new_tokens)
    answers = [(p.domain, list(r["prompt_ids"]), list(r["continuation_ids"])) for p, r in zip(prompts, refs)]
    answers = [a for a in answers if a[2]]
    del target
    draft = load(args.draft)
    max_len = max(len(p) + len(a) for _, p, a in answers) + 16
    result = {"target": args.target, "draft": args.draft, "prompts": [p.id for p in prompts],
              "max_new_tokens": args.max_new_tokens, "variants": {}}
    for name in names:
        t0 = time.perf_counter()
        runner = open_variant(draft.model, name, max_len)
        rates = agreement(runner, answers)
        del runner
        result["variants"][name] = {"by_domain": rates, "seconds": time.perf_counter() - t0}
        print(f"{name}: " + ", ".join(f"{d} {r['rate']:.4f} ({r['agree']}/{r['positions']})" for d, r in rates.items()),
              flush=True)
    result.update(machine=machine_info(), versions=versions())
    if args.out:
        atomic_write_json(args.out / "agreement.json", result)


if __name__ == "__main__":
    main()
