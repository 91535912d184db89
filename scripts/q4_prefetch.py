"""The int4 Qwen2.5-Coder-0.5B draft's step at each prefetch distance of the int4 kernel, and the one
`decode.native.tune_q4_ahead` chose on this machine.

    .venv/bin/python scripts/q4_prefetch.py > docs/results/pruned/q4-prefetch-xeon.json

One row a step at context 205-244 (a 200-token prefill, 5 warm-up steps, then 40 timed steps), the mean step of the
40; 5 passes, each over every distance in turn (interleaved); the median pass per distance. The outputs are the same
bits at every distance (tests/decode/test_native.py): only the time moves."""
import json
import sys
import time

import torch

from decode import native
from decode.loading import load
from decode.machine import machine_info, versions
from decode.runner import make_runner

chosen = native.tune_q4_ahead()
draft = load("qwen2.5-coder-0.5b-instruct")
runner = make_runner(draft.model, 512, quantize="int4")
kernels = native.kernels()
tokens = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(0))


def step_ms(n: int = 40) -> float:
    runner.forward(tokens[:200], 0, keep=1)
    for i in range(5):
        runner.forward(tokens[200 + i:201 + i], 200 + i, keep=1)
    start = time.perf_counter()
    for i in range(n):
        runner.forward(tokens[205 + i:206 + i], 205 + i, keep=1)
    return 1000 * (time.perf_counter() - start) / n


passes = {b: [] for b in native.Q4_AHEAD_CHOICES}
for _ in range(5):
    for b in native.Q4_AHEAD_CHOICES:
        kernels.q4_ahead(b)
        passes[b].append(step_ms())
kernels.q4_ahead(chosen)
median = {b: sorted(v)[len(v) // 2] for b, v in passes.items()}
json.dump({"draft": "int4:qwen2.5-coder-0.5b-instruct", "chosen": chosen, "step_ms_passes": passes,
           "step_ms_median": median, "chosen_over_builtin": median[chosen] / median[native.Q4_AHEAD_CHOICES[0]],
           "machine": machine_info(), "versions": versions(), "command": " ".join([".venv/bin/python"] + sys.argv)},
          sys.stdout, indent=2)
print()
