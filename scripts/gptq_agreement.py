"""Plain-rounded vs GPTQ-rounded int4 drafts (and the int8 copy): greedy agreement with the target's own answers,
teacher-forced through each runner as it decodes (`pairing.acceptance.measure_acceptance`).

    .venv/bin/python scripts/gptq_agreement.py --out docs/results/pruned/gptq    # -> .../gptq-agreement.json

Calibration (`int4:MODEL:calib=FILE`, `decode.runtime.quant.write_calib`): the qwen-draft recipe's counted prompts (each
domain's dev prompts after the first `--calib-skip`, `--calib-per-domain` of them: `pairing.race.
counting_prompts`) with the target's `--calib-tokens`-token greedy answers. Measured on each domain's prompts after
its first `--skip` (64-token answers by default): neither calibrated on nor read by the recipe's ranking or race.
Smoke run on a tiny model folder:

    .venv/bin/python scripts/gptq_agreement.py --target TINY --draft TINY --prompts FILE --calib-skip 1 \
        --calib-per-domain 1 --calib-tokens 4 --skip 2 --max-new-tokens 4 --out /tmp/g
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.prompts import first_per_domain, load_prompts
from draftsmith.decode.runtime.quant import read_calib, write_calib
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.pairing.race import counting_prompts
from draftsmith.pairing.acceptance import measure_acceptance
from draftsmith.pairing.reference import reference_continuations


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", default="code,chat", help="suite names or a JSONL/CSV/Parquet file")
    ap.add_argument("--calib-skip", type=int, default=4)
    ap.add_argument("--calib-per-domain", type=int, default=6)
    ap.add_argument("--calib-tokens", type=int, default=96)
    ap.add_argument("--skip", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target, draft = load(args.target), load(args.draft)
    counted = counting_prompts(args.prompts, args.calib_skip, args.calib_per_domain)
    cal_refs = reference_continuations(target, counted, max_new_tokens=args.calib_tokens, draft=draft,
                                       progress=False)
    with tempfile.TemporaryDirectory() as tmp:  # through the file format the int4:MODEL:calib=FILE spec reads
        calib = read_calib(write_calib(Path(tmp) / "calib.json", [
            list(p) + list(c) for p, c in zip(cal_refs["prompt_ids"], cal_refs["continuation_ids"])]))
    suite = load_prompts(args.prompts)
    first = {p.id for p in first_per_domain(suite, args.skip)}
    prompts = [p for p in suite if p.id not in first]
    refs = reference_continuations(target, prompts, max_new_tokens=args.max_new_tokens, draft=draft, progress=False)
    max_len = max(len(p) + len(c) for p, c in zip(refs["prompt_ids"], refs["continuation_ids"])) + 16
    rows = {}
    for name, kw in (("int4", {"quantize": "int4"}), ("int4 GPTQ", {"quantize": "int4", "calib": calib}),
                     ("int8", {"quantize": "int8"})):
        runner = make_runner(draft.model, max_len, **kw)
        [a] = measure_acceptance(target, [draft], refs, runners=[runner], progress=False)
        rows[name] = {"alpha": a.alpha, "alpha_by_domain": a.alpha_by_domain,
                      "tokens_per_round": {k: a.tokens_per_round(k) for k in (3, 5, 7)}}
        print(f"{name}: " + ", ".join(f"{d} {v:.4f}" for d, v in a.alpha_by_domain.items()), flush=True)
        del runner
    atomic_write_json(args.out / "gptq-agreement.json", {
        "target": args.target, "draft": args.draft, "calibrated_on": [p.id for p in counted],
        "calibration_tokens": sum(len(s) for s in calib.sequences), "measured_on": [p.id for p in prompts],
        "answer_tokens": sum(len(c) for c in refs["continuation_ids"]), "drafts": rows,
        "machine": machine_info(), "versions": versions()})


if __name__ == "__main__":
    main()
