"""Plain-rounded vs GPTQ-rounded int4 Qwen2.5-Coder-0.5B (and its int8 copy): greedy agreement with the 1.5B's own
answers, teacher-forced through each runner as it decodes (`pairing.acceptance.measure_acceptance`).

    .venv/bin/python scripts/gptq_agreement.py > docs/results/pruned/gptq-agreement.json

Calibration: the qwen-draft recipe's counted prompts (code and chat dev prompts 5-10, `distill.fastest.
counting_prompts`) with the 1.5B's 96-token greedy answers. Measured on the dev prompts after each domain's 16th
(22 code, 20 chat), 64-token answers: neither calibrated on nor used by the recipe's ranking or race."""
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from decode.loading import load
from decode.prompts import load_prompts
from decode.quant import read_calib, write_calib
from decode.runner import make_runner
from distill.fastest import counting_prompts
from pairing.acceptance import measure_acceptance
from pairing.reference import reference_continuations

target, draft = load("qwen2.5-coder-1.5b-instruct"), load("qwen2.5-coder-0.5b-instruct")
counted = counting_prompts("code,chat", 4, 6)
cal_refs = reference_continuations(target, counted, max_new_tokens=96, draft=draft, progress=False)
calib_file = Path(tempfile.mkdtemp()) / "calib.json"
write_calib(calib_file, [list(p) + list(c) for p, c in zip(cal_refs["prompt_ids"], cal_refs["continuation_ids"])])
calib = read_calib(calib_file)
first = {p.id for p in load_prompts("code,chat", limit_per_domain=16)}
prompts = [p for p in load_prompts("code,chat") if p.id not in first]
refs = reference_continuations(target, prompts, max_new_tokens=64, draft=draft, progress=False)
rows = {}
for name, kw in (("int4", {"quantize": "int4"}), ("int4 GPTQ", {"quantize": "int4", "calib": calib}),
                 ("int8", {"quantize": "int8"})):
    runner = make_runner(draft.model, 1024, **kw)
    [a] = measure_acceptance(target, [draft], refs, runners=[runner], progress=False)
    rows[name] = {"alpha": a.alpha, "alpha_by_domain": a.alpha_by_domain,
                  "tokens_per_round": {k: a.tokens_per_round(k) for k in (3, 5, 7)}}
    del runner
json.dump({"target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct",
           "calibrated_on": [p.id for p in counted], "calibration_tokens": sum(len(s) for s in calib.sequences),
           "measured_on": [p.id for p in prompts], "answer_tokens": sum(len(c) for c in refs["continuation_ids"]),
           "drafts": rows, "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                        "transformers": transformers.__version__},
           "command": " ".join([".venv/bin/python"] + sys.argv)}, sys.stdout, indent=2)
print()
