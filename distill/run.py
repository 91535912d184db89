"""One distillation run: held-out split -> data from the target -> training -> alpha and tokens/s before and after.

    .venv/bin/draftsmith distill --target smollm2-135m-instruct --draft derive:smollm2-135m-instruct:keep=4 \
        --data target --loss fkl --steps 300 --eval-every 50 --out runs/distill-smollm2

Prompts: the built-in suites (or a file). The first `eval_per_domain` prompts of every domain are held out
for evaluation (reference continuations of the target, teacher-forced alpha); training data comes only from
the rest. Everything lands in `--out`: `data/` (resumable), `checkpoints/`, `best/` (an HF folder),
`log.jsonl`, `summary.json`, and `distill.json` (this run's result, including the speculative speedup of
the draft before and after, measured side by side).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from decode.bench import atomic_write_json, side_by_side
from decode.errors import DraftsmithError
from decode.loading import load
from decode.model import make_runner
from decode.prompts import Prompt, load_prompts
from decode.textgen import eos_ids
from distill.data import generate_data
from distill.train import TrainConfig, train
from pairing.derive import resolve_candidate
from pairing.reference import reference_continuations


def split_prompts(prompts: list[Prompt], eval_per_domain: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held_out): the first `eval_per_domain` prompts of each domain are held out."""
    seen: dict[str, int] = {}
    train_p, held = [], []
    for p in prompts:
        n = seen.get(p.domain, 0)
        (held if n < eval_per_domain else train_p).append(p)
        seen[p.domain] = n + 1
    if not train_p or not held:
        raise DraftsmithError(f"need prompts both to train on and to hold out (eval_per_domain={eval_per_domain})")
    return train_p, held


def measure_speedup(target, drafts: dict, refs, *, k: int, max_new_tokens: int, n_prompts: int,
                    device: str = "cpu") -> dict:
    """tokens/s of our decoder: target alone and with each draft (int8 on CPU), same prompts, interleaved."""
    rows = list(refs)[:n_prompts]
    max_len = max(len(r["prompt_ids"]) for r in rows) + max_new_tokens + k + 2
    t_run = make_runner(target.model, max_len)
    quant = "int8" if device == "cpu" else None
    runners = {"target_only": None, **{name: make_runner(m, max_len, quantize=quant) for name, m in drafts.items()}}
    runs = side_by_side(t_run, runners, [r["prompt_ids"] for r in rows], k=k, max_new_tokens=max_new_tokens,
                        eos_ids=eos_ids(target), device=device)
    stats = {name: st for name, (st, _) in runs.items()}
    tps = {name: st.tokens_per_s for name, st in stats.items()}
    return {
        "k": k, "prompts": len(rows),
        "tok_per_s": tps, "seconds": {n: st.seconds for n, st in stats.items()},
        "tokens": {n: st.new_tokens for n, st in stats.items()},
        "mean_tau": {n: st.mean_tau for n, st in stats.items()},
        "speedup_vs_target_only": {name: tps[name] / tps["target_only"] for name in drafts},
    }


def run_distill(
    target_spec: str, draft_spec: str, out: Path, cfg: TrainConfig, *, prompts: str = "code,json,summarize,chat",
    eval_per_domain: int = 6, data_source: str = "target", mix: float = 0.5, max_new_tokens: int = 64,
    data_temperature: float = 1.0, k: int = 3, speed_prompts: int = 4, resume: bool = True,
    speculative_data: bool = True, limit_per_domain: int | None = None, device: str = "cpu",
) -> dict:
    out = Path(out)
    target = load(target_spec, device=device)
    draft = load(resolve_candidate(draft_spec), device=device)
    draft.name = draft_spec
    train_p, held = split_prompts(load_prompts(prompts, limit_per_domain=limit_per_domain), eval_per_domain)
    data = generate_data(target, draft, train_p, out / "data", source=data_source, mix=mix,
                         max_new_tokens=max_new_tokens, temperature=data_temperature, seed=cfg.seed,
                         speculative=speculative_data)
    refs = reference_continuations(target, held, max_new_tokens=max_new_tokens)
    summary = train(target, draft, data, refs, out, cfg, resume=resume)
    tuned = load(summary["paths"]["best"], device=device) if "best" in summary.get("paths", {}) else None
    result = {
        "target": target_spec, "draft": draft_spec, "config": asdict(cfg), "data_source": data_source,
        "train_prompts": len(train_p), "held_out_prompts": len(held), "data_rows": len(data),
        "alpha_before": summary["alpha_before"], "alpha_after": summary["alpha_after"],
        "alpha_gain": summary["alpha_after"] - summary["alpha_before"] if summary["alpha_before"] is not None else None,
        "train_summary": summary,
    }
    if tuned is not None and speed_prompts:
        torch.set_grad_enabled(False)
        result["speed"] = measure_speedup(target, {"draft_before": draft.model, "draft_after": tuned.model}, refs,
                                          k=k, max_new_tokens=max_new_tokens, n_prompts=speed_prompts, device=device)
    atomic_write_json(out / "distill.json", result)
    return result
