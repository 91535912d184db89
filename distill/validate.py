"""The validate stage: target alone vs the un-distilled draft vs the distilled one, same held-out prompts, one run.

    from distill.validate import ValidateConfig, validate_distilled
    result = validate_distilled("smollm2-135m-instruct", "derive:smollm2-135m-instruct:keep=4", Path("runs/x/distill/best"),
                                prompts, ValidateConfig(), out=Path("runs/x/validate/bench.json"))

K is the recipe's, or the best predicted from the cost measured here (c, v(K)) and the draft's teacher-forced alpha.
The timing itself is `decode.bench.validate_drafts`; `bench.json` holds its fields plus K, its reason, c and v(K).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from decode.bench import validate_drafts
from decode.errors import DraftsmithError
from decode.io import atomic_write_json
from decode.loading import eos_ids, load
from decode.machine import machine_info, versions
from decode.prompts import Prompt, first_per_domain
from decode.quant import draft_quant
from decode.runner import make_runner
from decode.speculative import check_siblings
from decode.textgen import prompt_ids
from pairing.cost import COST_CONTEXT, best_k, measure_cost, speedup_curve
from pairing.derive import resolve_candidate


@dataclass
class ValidateConfig:
    """The validate stage's settings: target alone vs un-distilled vs distilled draft, same prompts, same run."""

    prompts_per_domain: int = 2  # held-out prompts per domain
    max_new_tokens: int = 64  # tokens decoded per prompt
    k: int = 0  # draft tokens per round; 0 = the best predicted from the measured cost and the draft's alpha
    max_k: int = 8  # largest K considered when k = 0
    draft_quant: str | None = "int8"  # int8 | null: draft weights on CPU (exactness is unaffected)
    gate: bool = True  # heads, k = 0: also pick a draft probability below which a round stops early
    siblings: int = 2  # heads, with gate: also predict rounds that propose this many first tokens side by side
    # where the head is unsure (a tree verify; 0 = never), and run them if they predict best
    sibling_depth: int = 1  # 2: also predict those rounds with the head's next token after each sibling (2m + 1 rows)

    def __post_init__(self) -> None:
        for name in ("prompts_per_domain", "max_new_tokens", "max_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0 (0 = best measured), got {self.k}")
        check_siblings(self.siblings)
        if self.sibling_depth not in (1, 2):
            raise ValueError(f"sibling_depth must be 1 or 2, got {self.sibling_depth}")
        if self.draft_quant not in (None, "int8"):
            raise ValueError(f"draft_quant must be int8 or null, got {self.draft_quant!r}")


def validate_distilled(target_spec: str, draft_spec: str, tuned: Path | None, prompts: list[Prompt],
                       cfg: ValidateConfig, *, alpha: float | None, out: Path, device: str = "cpu") -> dict:
    """Time the target alone, the draft and (if `tuned` is a folder) the distilled draft; write `out` (bench.json).

    `alpha` (the tuned draft's, else the draft's) picks K when cfg.k = 0. Refuses a run whose speculative
    output differs from the target's greedy output (the decoder's contract), after writing the numbers."""
    torch.set_grad_enabled(False)
    target = load(target_spec, device=device)
    before = load(resolve_candidate(draft_spec), device=device)
    after = load(str(tuned), device=device) if tuned is not None and Path(tuned).is_dir() else None
    prompts = first_per_domain(prompts, cfg.prompts_per_domain)
    ids = [prompt_ids(target.tokenizer, p.prompt) for p in prompts]
    max_len = max(max(len(i) for i in ids) + cfg.max_new_tokens, COST_CONTEXT) + max(cfg.k, cfg.max_k) + 2
    t_run = make_runner(target.model, max_len)
    quant = draft_quant(before.model, cfg.draft_quant)
    drafts = {"draft_before": make_runner(before.model, max_len, quantize=quant)}
    if after is not None:
        drafts["draft_after"] = make_runner(after.model, max_len, quantize=draft_quant(after.model, cfg.draft_quant))

    tuned_name = "draft_after" if after is not None else "draft_before"
    cost = measure_cost(t_run, drafts[tuned_name], ks=range(1, cfg.max_k + 1), context=COST_CONTEXT, repeats=3,
                        warmup=1, device=device)
    predicted = None  # the i.i.d. formula E[tau] / (K c + v(K)) for this alpha at the K run (docs/design.md)
    if cfg.k:
        k, why = cfg.k, "set by the recipe"
        predicted = speedup_curve(alpha, cost.c, cost.v).get(k) if alpha is not None else None
    elif alpha is not None:
        k, predicted = best_k(alpha, cost.c, cost.v)
        why = f"best predicted for alpha {alpha:.3f} and the measured cost"
    else:
        k, why = 3, "default (no alpha measured: neither the pair nor the distill stage has run)"

    val = validate_drafts(t_run, drafts, ids, k=k, max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids(target),
                          names=[p.id for p in prompts], device=device)
    result = {
        "target": target_spec, "draft": draft_spec, "distilled": str(tuned) if after is not None else None,
        **val.to_dict(), "k_reason": why, "predicted_speedup": predicted, "draft_quant": quant, "alpha": alpha,
        "cost_ratio": cost.c,
        "verify_cost": {str(K): x for K, x in cost.v.items()},
        "machine": machine_info(), "versions": versions(),
    }
    if after is not None:
        result["speedup_after_vs_before"] = val.tok_per_s["draft_after"] / val.tok_per_s["draft_before"]
    atomic_write_json(out, result)
    if not all(val.greedy_equal.values()):
        raise DraftsmithError("validate: speculative output differs from the target's greedy output "
                              f"({val.greedy_equal}); see {out}")
    return result
