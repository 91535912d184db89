"""A grid of round policies for one draft, timed side by side with the target alone in one interleaved run.

    .venv/bin/draftsmith grid --target smollm2-135m-instruct --draft head:runs/smollm2-head/distill/head/best \
        --k 1,2,3 --confidence 0,0.5,0.6 --siblings 0,3 --sibling-depth 1,2 --quant int8,none --out grid.json

Every combination of K, stop threshold (0: never stop early), siblings (0: none; m >= 2 proposes the draft's m
most probable first tokens side by side where its first token falls below the threshold) and sibling depth (2:
each sibling with the draft's next token; heads only) that the decoder accepts becomes one `KPolicy`, and each
runs beside the target alone on the same prompts, interleaved prompt by prompt, with the draft's weights as each
`quant` asks (int8 or none, side by side). `--policy LABEL` adds policies one by one (`policy_label`'s form);
`--repeats N` times N interleaved passes (speedups: median and range over them); `--out grid.json` also draws
grid.png (every policy's speedup, over all prompts and per domain, fastest on top). Use it on prompts kept for
choosing (dev prompts), never on the ones a speedup is reported on; the one use on test prompts is as a check
that chooses nothing of one's own: a policy chosen elsewhere beside a stock draft at every K, which favours the
stock (its K picked in hindsight on the prompts themselves).
"""

from __future__ import annotations

import itertools
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.decode.bench import validate_drafts
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.head import HeadDraft
from draftsmith.decode.runtime.io import atomic_write_bytes, atomic_write_json, png_bytes
from draftsmith.decode.runtime.loading import eos_ids, load
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.prompts import first_per_domain, load_prompts
from draftsmith.decode.speculative import KPolicy, parse_policy_label, policy_label
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.textgen import prompt_ids
from draftsmith.pairing.drafts import open_draft

QUANTS = ("int8", "none")


@dataclass
class GridConfig:
    """The settings of `draftsmith grid` (its options are generated from these fields)."""

    prompts: str = "code,json,summarize,chat"  # suite names or a JSONL/CSV/Parquet file
    prompts_per_domain: int = 2  # the first N prompts of every domain
    max_new_tokens: int = 64  # tokens decoded per prompt
    k: list[int] = field(default_factory=lambda: [1, 2, 3])  # K values
    confidence: list[float] = field(default_factory=lambda: [0.0])  # stop thresholds (0 = never stop early)
    siblings: list[int] = field(default_factory=lambda: [0])  # first tokens side by side below the threshold
    sibling_depth: list[int] = field(default_factory=lambda: [1])  # 2: each sibling with the draft's next token
    quant: list[str] = field(default_factory=lambda: ["int8"])  # the draft's weights: int8 and/or none
    policy: list[str] = field(default_factory=list)  # more policies by label, e.g. "K=8 stop<0.6 siblings=2"
    repeats: int = 1  # interleaved passes over the prompts (speedups: median and range over them)

    def __post_init__(self) -> None:
        if self.prompts_per_domain < 1 or self.max_new_tokens < 1:
            raise DraftsmithError("prompts_per_domain and max_new_tokens must be >= 1")
        if not self.k or min(self.k) < 1:
            raise DraftsmithError(f"k must list integers >= 1, got {self.k}")
        if any(not 0.0 <= c < 1.0 for c in self.confidence):
            raise DraftsmithError(f"confidence must list thresholds in [0, 1), got {self.confidence}")
        if any(m == 1 or m < 0 for m in self.siblings):
            raise DraftsmithError(f"siblings must list 0 (none) or counts >= 2, got {self.siblings}")
        if any(d not in (1, 2) for d in self.sibling_depth):
            raise DraftsmithError(f"sibling_depth must list 1 and/or 2, got {self.sibling_depth}")
        bad = [q for q in self.quant if q not in QUANTS]
        if bad or not self.quant:
            raise DraftsmithError(f"quant must list {' and/or '.join(QUANTS)}, got {self.quant}")
        if self.repeats < 1:
            raise DraftsmithError(f"repeats must be >= 1, got {self.repeats}")
        for label in self.policy:
            parse_policy_label(label)  # a bad label fails here, in one line


def policy_grid(cfg: GridConfig) -> list[KPolicy]:
    """Every distinct policy the grid names that the decoder can run: a threshold stops a round of K >= 2 early
    (a round of one has nothing to stop), or with siblings branches below it; children need K >= 2. Then the
    policies `cfg.policy` names one by one."""
    out: dict[str, KPolicy] = {}
    for K, c, m, d in itertools.product(cfg.k, cfg.confidence, cfg.siblings, cfg.sibling_depth):
        if (m and not c) or (d == 2 and (not m or K < 2)) or (c and not m and K == 1):
            continue
        p = KPolicy.fixed(K, confidence=c or None, siblings=m if c else 0, sibling_depth=d)
        out.setdefault(policy_label(p), p)
    for label in cfg.policy:
        p = parse_policy_label(label)
        out.setdefault(policy_label(p), p)
    return list(out.values())


@torch.no_grad()  # not torch.set_grad_enabled(False): that would leak into whatever runs next in the process
def run_grid(target_spec: str, draft_spec: str, cfg: GridConfig, *, out: Path | None = None,
             device: str = "cpu") -> dict:
    """Time the target alone and the draft at every policy of the grid (and every quant) side by side on the same
    prompts in one interleaved run; write `out` (JSON with raw timings, machine and versions); return it."""
    policies = policy_grid(cfg)
    if not policies:
        raise DraftsmithError("the grid names no policy the decoder can run (siblings need a threshold; "
                              "sibling depth 2 needs siblings and K >= 2)")
    target = load(target_spec, device=device)
    prompts = first_per_domain(load_prompts(cfg.prompts), cfg.prompts_per_domain)
    ids = [prompt_ids(target.tokenizer, p.prompt) for p in prompts]
    deepest = max(max(p.k, 2 * p.siblings) for p in policies)
    max_len = max(len(i) for i in ids) + cfg.max_new_tokens + deepest + 2
    t_run = make_runner(target.model, max_len)
    if any(p.siblings for p in policies) and not hasattr(t_run, "forward_tree"):
        raise DraftsmithError(f"sibling rounds need the lean runner; {target_spec} is served by the generic one "
                              "(use --siblings 0)")
    drafts, named = {}, {}
    for q in cfg.quant:
        opened = open_draft(draft_spec, target, max_len, None if q == "none" else q, device)
        for p in policies:
            name = policy_label(p) + ("" if len(cfg.quant) == 1 else f" {q}")
            # a head keeps per-decode state of its own: one HeadDraft per policy (a model runner is position-based)
            drafts[name] = opened.runner if opened.head is None else HeadDraft(opened.head, max_len,
                                                                               quantize=opened.quant)
            named[name] = p
    val = validate_drafts(t_run, drafts, ids, k=policies[0].k, policies=named, max_new_tokens=cfg.max_new_tokens,
                          eos_ids=eos_ids(target), names=[p.id for p in prompts], desc="grid", device=device,
                          repeats=cfg.repeats, groups=[p.domain for p in prompts])
    result = {"target": target_spec, "draft": draft_spec, **val.to_dict(),
              "policies": {n: p.to_dict() for n, p in named.items()},
              "drafted_per_round": {n: val.stats[n].drafted / max(1, val.stats[n].target_forwards) for n in drafts},
              "machine": machine_info(), "versions": versions()}
    if out is not None:
        atomic_write_json(Path(out), result)
        atomic_write_bytes(Path(out).with_suffix(".png"), grid_plot(result))
    if not all(val.greedy_equal.values()):
        raise DraftsmithError(f"grid: speculative output differs from the target's greedy output "
                              f"({val.greedy_equal}){f'; see {out}' if out else ''}")
    return result


def grid_plot(result: dict) -> bytes:
    """A grid's result as one PNG: each policy's speedup over the target alone (median over the repeats, the bar;
    their range, the whisker), over all prompts and per domain, fastest policy on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(result["policies"], key=lambda n: result["speedup_vs_target_only"][n])
    groups = {"all prompts": result}
    if len(result.get("by_group") or {}) > 1:  # one domain would only repeat the first bar
        groups.update(result["by_group"])
    height = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.28 * len(names) * len(groups)))
    for j, (label, g) in enumerate(groups.items()):
        ys = [i + (len(groups) - 1 - j) * height for i in range(len(names))]
        x = [g["speedup_vs_target_only"][n] for n in names]
        lo = [max(0.0, v - g["speedup_range"][n][0]) for v, n in zip(x, names)]
        hi = [max(0.0, g["speedup_range"][n][1] - v) for v, n in zip(x, names)]
        ax.barh(ys, x, height, xerr=[lo, hi], capsize=2, label=label)
    ax.axvline(1.0, color="grey", lw=1, ls="--")
    ax.set_yticks([i + height * (len(groups) - 1) / 2 for i in range(len(names))], names, fontsize=7)
    ax.set_xlabel("speedup over the target alone (median of repeats; whiskers: range)")
    cpu = result.get("machine", {}).get("cpu", "")
    what = textwrap.fill(f"{result['target']} with {result['draft']}", 100)
    ax.set_title(f"{what}\n{len(result['prompts'])} prompts x {result['max_new_tokens']} tokens, "
                 f"{len(result.get('repeats') or [1])} repeat(s), {cpu}", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return png_bytes(fig)
