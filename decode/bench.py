"""Benchmark: four decoders, same prompts, same run, side by side.

    .venv/bin/draftsmith bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --out bench.json

Modes, all greedy, all timed the same way (wall time of the whole call, prefill included, after a warm-up):
- `target_only`: our decoder without a draft (the honest baseline: same loop, same kernels);
- `speculative`: our decoder with the draft (int8 weights on CPU by default), one entry per K asked for and one
  per `policy` named (e.g. "K=8 stop<0.6 siblings=2": one chosen on dev prompts, timed without choosing here);
- `hf_generate`: transformers `generate` on the target alone;
- `hf_assisted`: transformers assisted generation (`assistant_model=` the draft as loaded, float32).
Prompts are interleaved (each prompt runs every mode before the next prompt) so that drift on a noisy
machine hits all modes alike; with `repeats` > 1 the whole pass runs again with the mode that goes first rotating,
and each `speedup_*` is the median over the repeats of that repeat's ratio (`*_range`: the lowest and highest).
`greedy_equal` checks, per prompt and repeat, speculative == target-only == HF greedy. The summary (`speculative`,
`speedup_*`) is the fastest speculative mode on these prompts, picked in hindsight; `per_mode` gives every one's.
With `out` the report is drawn beside it (bench.png: each mode's tokens/s with its range and ratio, `bench_plot`).

Here too, beside `Validation` (the side-by-side timing every stage result embeds): `Part` and `Record`, the base of
every stage's result type (typed fields, the other keys kept, a `version`; `pairing.validate.BenchResult`,
`distill.results`, `distill.export.results`, `pairing.leaderboard.PairLeaderboard`).
"""

from __future__ import annotations

import statistics
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_bytes, atomic_write_json, png_bytes
from draftsmith.decode.runtime.loading import Loaded, eos_ids
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.runtime.pair import Pair, load_pair
from draftsmith.decode.prompts import Prompt, load_prompts
from draftsmith.decode.runtime.quant import draft_quant as effective_quant
from draftsmith.decode.runtime.runner import Runner
from draftsmith.decode.speculative import KPolicy, Stats, generate, parse_policy_label, policy_label
from draftsmith.decode.textgen import prompt_ids

DEFAULT_PROMPTS = "code"
DEFAULT_N_PROMPTS = 4


def _hf_generate(pair: Pair, ids: list[int], max_new_tokens: int, eos: list[int], assisted: bool) -> tuple[list[int], float]:
    return hf_generate(pair.target, ids, max_new_tokens, eos, draft=pair.draft if assisted else None)


def hf_generate(target: Loaded, ids: list[int], max_new_tokens: int, eos: list[int], *, draft: Loaded | None = None,
                k: int | None = None, universal: bool = False) -> tuple[list[int], float]:
    """transformers' greedy `generate` on the target, alone or with `draft` as its assistant (K = `k` tokens a
    round when given, else transformers' own schedule); `universal`: the draft has another tokenizer and runs as
    universal assisted generation (its tokens decoded to text and re-encoded for the target). -> (new ids,
    seconds)."""
    model = target.model
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                  pad_token_id=target.tokenizer.pad_token_id or eos[0])
    if draft is not None:
        kwargs["assistant_model"] = draft.model
        if k is not None:
            kwargs.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
        if universal:
            kwargs.update(tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
    x = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def _summary(tokens: int, seconds: float, per_prompt: list[dict]) -> dict:
    return {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds if seconds else 0.0,
            "per_prompt": per_prompt}


class Run(NamedTuple):
    """One decoder over the prompts of one pass: its stats merged, its tokens and its stats per prompt."""

    stats: Stats
    tokens: list[list[int]]
    per_prompt: list[Stats]


def side_by_side(
    target: Runner, drafts: dict[str, Runner | None], prompts: list[list[int]], *, k: int, max_new_tokens: int,
    eos_ids: list[int], desc: str | None = None, device: str | torch.device = "cpu",
    policies: dict[str, KPolicy] | None = None, rotate: int = 0, warmup: bool = True,
) -> dict[str, Run]:
    """Our decoder on the same prompts with each draft (None = target only), interleaved per prompt so that
    drift on a noisy machine hits every mode alike; a short warm-up first. Which decoder goes first rotates from
    prompt to prompt (prompt i starts at the (i + `rotate`)-th), so none always runs on a cache another has just
    warmed. Each draft runs `policies[name]` where given (K, stop threshold, siblings: one `KPolicy`), else fixed
    rounds of `k`. Returns name -> `Run` (merged stats, tokens, per-prompt stats)."""
    policies = {name: (policies or {}).get(name) or KPolicy.fixed(k) for name in drafts}
    names = list(drafts)
    if warmup:
        for name, d in drafts.items():
            generate(target, prompts[0][:16], draft=d, max_new_tokens=4, policy=policies[name], device=device)
    out = {name: Run(Stats(), [], []) for name in drafts}
    for i, ids in enumerate(tqdm(prompts, desc=desc, unit="prompt", disable=desc is None)):
        start = (i + rotate) % len(names)
        for name in names[start:] + names[:start]:
            res = generate(target, list(ids), draft=drafts[name], max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                           policy=policies[name], device=device)
            run = out[name]
            out[name] = Run(run.stats.merge(res.stats), run.tokens + [res.tokens], run.per_prompt + [res.stats])
    return out


def hf_side_by_side(target: Loaded, draft: Loaded, prompts: list[list[int]], *, k: int, max_new_tokens: int,
                    eos_ids: list[int], desc: str | None = None) -> dict:
    """transformers' greedy `generate`, the target alone and with `draft` as its assistant at K = `k`, interleaved
    per prompt after a warm-up: the measured speedup of a draft our token-level decoder cannot run (another
    tokenizer: universal assisted generation). Greedy equality is checked per prompt."""
    universal = draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()
    for d in (None, draft):
        hf_generate(target, prompts[0][:16], 4, eos_ids, draft=d, k=k, universal=universal)  # warm-up
    runs = {"hf_generate": [], "hf_assisted": []}
    for ids in tqdm(prompts, desc=desc, unit="prompt", disable=desc is None):
        for mode, d in (("hf_generate", None), ("hf_assisted", draft)):
            runs[mode].append(hf_generate(target, list(ids), max_new_tokens, eos_ids, draft=d, k=k,
                                          universal=universal))
    out = {mode: _summary(sum(len(t) for t, _ in r), sum(s for _, s in r),
                          [{"tokens": len(t), "seconds": s} for t, s in r]) for mode, r in runs.items()}
    base = out["hf_generate"]["tok_per_s"]
    return {"k": k, "prompts": len(prompts), **out,
            "measured_speedup": out["hf_assisted"]["tok_per_s"] / base if base else 0.0,
            "greedy_equal": all(a == b for (a, _), (b, _) in zip(runs["hf_generate"], runs["hf_assisted"]))}



@dataclass
class Validation:
    """Our decoder on the same prompts: the target alone and with each draft, interleaved in one run.

    `stats` holds "target_only" first, then one entry per draft; `greedy_equal[name]` says whether that draft's
    tokens equal the target alone's on every prompt (None when sampling, where they need not)."""

    k: int
    prompts: list[str]
    max_new_tokens: int
    device: str
    stats: dict[str, Stats]
    greedy_equal: dict[str, bool | None]
    ks: dict[str, int] = field(default_factory=dict)  # drafts timed at another K than `k`
    repeats: list[dict[str, Stats]] = field(default_factory=list)  # each repeat's stats (stats merges them)
    groups: list[str] = field(default_factory=list)  # each prompt's group (its domain); empty: not grouped
    prompt_stats: list[dict[str, list[Stats]]] = field(default_factory=list)  # per repeat, decoder and prompt

    @property
    def drafts(self) -> list[str]:
        return [n for n in self.stats if n != "target_only"]

    @property
    def tok_per_s(self) -> dict[str, float]:
        return {n: st.tokens_per_s for n, st in self.stats.items()}

    def speedup(self, name: str) -> float:
        """tokens/s with draft `name` / tokens/s of the target alone: the median over the repeats (over all the
        timing when there were none recorded); 0 if the baseline produced nothing."""
        ratios = self.repeat_speedups(name)
        return statistics.median(ratios) if ratios else _ratio(self.stats, name)

    def repeat_speedups(self, name: str) -> list[float]:
        """The speedup of draft `name` in each repeat, in the order they ran."""
        return self.ratio_repeats(name)

    def ratio_repeats(self, a: str, b: str = "target_only", group: str | None = None) -> list[float]:
        """tokens/s of decoder `a` over tokens/s of decoder `b` in each repeat, over the prompts of `group`
        (all prompts when None)."""
        if group is None:
            return [r[a].tokens_per_s / r[b].tokens_per_s if r[b].tokens_per_s else 0.0 for r in self.repeats]
        if group not in self.groups:
            raise DraftsmithError(f"no prompt in group {group!r}; groups: {sorted(set(self.groups))}")
        pick = [i for i, g in enumerate(self.groups) if g == group]
        out = []
        for r in self.prompt_stats:
            ta, tb = (_merge(r[n][i] for i in pick).tokens_per_s for n in (a, b))
            out.append(ta / tb if tb else 0.0)
        return out

    def ratio_spread(self, a: str, b: str = "target_only", group: str | None = None) -> dict | None:
        """`spread` of `ratio_repeats(a, b, group)`; None without repeats."""
        reps = self.ratio_repeats(a, b, group)
        return spread(reps) if reps else None

    def ratio_by_group(self, a: str, b: str = "target_only") -> dict[str, dict]:
        """`ratio_spread(a, b)` over all the prompts ("all") and over each group's (in first-seen order), those
        with repeats."""
        spreads = {"all" if g is None else g: self.ratio_spread(a, b, group=g)
                   for g in [None, *dict.fromkeys(self.groups)]}
        return {g: s for g, s in spreads.items() if s}

    def by_group(self) -> dict[str, dict]:
        """Per group (in first-seen order): its prompts and each draft's speedup over the target alone, the
        median over the repeats with the range and every repeat's value."""
        out = {}
        for g in dict.fromkeys(self.groups):
            s = {n: self.ratio_spread(n, group=g) for n in self.drafts}
            out[g] = {"prompts": [p for p, pg in zip(self.prompts, self.groups) if pg == g],
                      **{key: {n: x[part] for n, x in s.items() if x}
                         for key, part in (("speedup_vs_target_only", "median"), ("speedup_range", "range"),
                                           ("speedup_repeats", "repeats"))}}
        return out

    @property
    def speedup_vs_target_only(self) -> dict[str, float]:
        return {n: self.speedup(n) for n in self.drafts}

    @property
    def speedup_range(self) -> dict[str, list[float]]:
        """[min, max] of each draft's speedup over the repeats."""
        return {n: [min(r), max(r)] for n in self.drafts for r in [self.repeat_speedups(n) or [self.speedup(n)]]}

    def to_dict(self) -> dict:
        """JSON form: the raw stats plus the flat views reports and leaderboards read."""
        return {
            "k": self.k, **({"ks": self.ks} if self.ks else {}), "prompts": self.prompts,
            "max_new_tokens": self.max_new_tokens, "device": self.device,
            "tok_per_s": self.tok_per_s,
            "seconds": {n: st.seconds for n, st in self.stats.items()},
            "tokens": {n: st.new_tokens for n, st in self.stats.items()},
            "mean_tau": {n: st.mean_tau for n, st in self.stats.items()},
            "acceptance_rate": {n: st.acceptance_rate for n, st in self.stats.items()},
            "speedup_vs_target_only": self.speedup_vs_target_only,
            "speedup_range": self.speedup_range,
            "speedup_repeats": {n: self.repeat_speedups(n) for n in self.drafts},
            "speedup_definition": "median over the repeats of (tokens/s with the draft / tokens/s of the target "
                                  "alone), each repeat timing every decoder on every prompt, interleaved, the "
                                  "decoder that goes first rotating from prompt to prompt",
            "greedy_equal": self.greedy_equal,
            "stats": {n: st.to_dict() for n, st in self.stats.items()},
            "repeats": [{n: st.to_dict() for n, st in r.items()} for r in self.repeats],
            "tau_definition": "tokens emitted per target forward, including the bonus/corrected token",
            **({"groups": self.groups, "by_group": self.by_group(),
                "prompt_stats": [{n: [st.to_dict() for st in sts] for n, sts in r.items()} for r in self.prompt_stats]}
               if self.groups and self.prompt_stats else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Validation":
        stats = {n: Stats.from_dict(s) for n, s in d["stats"].items()}
        repeats = [{n: Stats.from_dict(s) for n, s in r.items()} for r in d.get("repeats") or []]
        per_prompt = [{n: [Stats.from_dict(s) for s in sts] for n, sts in r.items()} for r in d.get("prompt_stats") or []]
        return cls(d["k"], list(d["prompts"]), d["max_new_tokens"], d["device"], stats, dict(d["greedy_equal"]),
                   dict(d.get("ks") or {}), repeats, list(d.get("groups") or []), per_prompt)


def validate_drafts(
    target: Runner, drafts: dict[str, Runner], prompts: list[list[int]], *, k: int, max_new_tokens: int,
    eos_ids: list[int], names: list[str] | None = None, greedy: bool = True, desc: str | None = "validate",
    device: str | torch.device = "cpu", policies: dict[str, KPolicy] | None = None, repeats: int = 1,
    groups: list[str] | None = None,
) -> Validation:
    """The measured speedup: target alone and with each draft on the same prompts, side by side in one run.

    Each draft runs `policies[name]` (one `KPolicy`) where given, else fixed rounds of `k`. The timing core of
    every validation: `pairing.validate` (the recipe's validate stage), `pair --validate` and `distill`'s
    before/after call it. `greedy=False` (sampled decoding) records greedy_equal as None: sampled outputs need not match.
    `groups` (each prompt's domain) adds per-group speedups (`Validation.by_group`)."""
    if not drafts:
        raise DraftsmithError("validation needs at least one draft")
    if "target_only" in drafts:
        raise DraftsmithError("'target_only' is the baseline's name; give the drafts other names")
    if not prompts:
        raise DraftsmithError("validation needs at least one prompt")
    if repeats < 1:
        raise DraftsmithError(f"repeats must be >= 1, got {repeats}")
    names = names or [str(i) for i in range(len(prompts))]
    if groups is not None and len(groups) != len(prompts):
        raise DraftsmithError(f"{len(groups)} groups for {len(prompts)} prompts")
    repeats_stats, per_prompt, equal = [], [], {n: (True if greedy else None) for n in drafts}
    for r in range(repeats):
        runs = side_by_side(target, {"target_only": None, **drafts}, prompts, k=k, max_new_tokens=max_new_tokens,
                            eos_ids=eos_ids, desc=desc if repeats == 1 else f"{desc} {r + 1}/{repeats}" if desc else None,
                            device=device, policies=policies, rotate=r, warmup=r == 0)
        reference = runs["target_only"].tokens
        if greedy:
            equal = {n: equal[n] and runs[n].tokens == reference for n in drafts}
        repeats_stats.append({n: run.stats for n, run in runs.items()})
        per_prompt.append({n: run.per_prompt for n, run in runs.items()})
    merged = {n: _merge(r[n] for r in repeats_stats) for n in repeats_stats[0]}
    return Validation(k, names, max_new_tokens, str(device), merged, equal,
                      {n: p.k for n, p in (policies or {}).items() if p.k != k}, repeats_stats,
                      list(groups or []), per_prompt if groups else [])


def _merge(stats) -> Stats:
    out = Stats()
    for st in stats:
        out = out.merge(st)
    return out


def _ratio(stats: dict[str, Stats], name: str) -> float:
    base = stats["target_only"].tokens_per_s
    return stats[name].tokens_per_s / base if base else 0.0


def spread(values: list[float]) -> dict:
    """One ratio's per-repeat values (non-empty) as {"median", "range": [min, max], "repeats": values}."""
    return {"median": statistics.median(values), "range": [min(values), max(values)], "repeats": list(values)}


@dataclass
class BenchConfig:
    """The settings of `draftsmith bench` (its options are generated from these fields)."""

    prompts: str = DEFAULT_PROMPTS  # suite names (code,json,...) or a JSONL/CSV/Parquet file
    n_prompts: int = DEFAULT_N_PROMPTS  # the first N prompts (0 = all)
    max_new_tokens: int = 64  # tokens decoded per prompt
    k: list[int] = field(default_factory=lambda: [3])  # K values to time, e.g. 3,5 (3 measured best on a 2-core CPU)
    draft_quant: str | None = "int8"  # int8 | null: draft weights on CPU (the target always runs as loaded)
    hf_modes: bool = True  # also time transformers generate and assisted generation
    repeats: int = 1  # interleaved passes over the prompts; speedups are the median over them, with the range
    policy: list[str] = field(default_factory=list)  # policies to time too, by label, e.g. "K=8 stop<0.6 siblings=2"

    def __post_init__(self) -> None:
        for label in self.policy:
            parse_policy_label(label)  # a bad label fails here, in one line
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.n_prompts < 0:
            raise ValueError(f"n_prompts must be >= 0 (0 = all), got {self.n_prompts}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.k or any(k < 1 for k in self.k):
            raise ValueError(f"k must be a non-empty list of integers >= 1, got {self.k}")
        if self.draft_quant not in (None, "int8"):
            raise ValueError(f"draft_quant must be int8 or null, got {self.draft_quant!r}")


def spec_policies(ks: list[int], labels: list[str]) -> dict[str, KPolicy]:
    """Our decoder's bench modes -> their round policies: a plain chain at each K ("speculative_k4"), then each
    labelled policy ("speculative K=8 stop<0.6 siblings=2"); a policy already there runs once."""
    modes = {f"speculative_k{k}": KPolicy.fixed(k) for k in ks}
    for label in labels:
        p = parse_policy_label(label)
        if p not in modes.values():
            modes[f"speculative {policy_label(p)}"] = p
    return modes


def _run_mode(pair: Pair, mode: str, ids: list[int], n_new: int, eos: list[int],
              policy: KPolicy | None = None) -> tuple[list[int], float, Stats | None]:
    """One prompt in one bench mode (`policy`: a speculative mode's rounds) -> (new ids, seconds, our decoder's
    stats or None for transformers)."""
    if mode.startswith("hf_"):
        toks, secs = _hf_generate(pair, ids, n_new, eos, assisted=mode == "hf_assisted")
        return toks, secs, None
    speculative = mode.startswith("speculative")
    res = generate(pair.target_runner, ids, draft=pair.draft_runner if speculative else None,
                   max_new_tokens=n_new, policy=policy if speculative else KPolicy(k=1), eos_ids=eos)
    return res.tokens, res.stats.seconds, res.stats


def _time_modes(pair: Pair, items: list[Prompt], encoded: list[list[int]], modes: list[str], max_new_tokens: int,
                eos: list[int], progress: bool, repeats: int = 1,
                policies: dict[str, KPolicy] | None = None) -> list[dict[str, list[dict]]]:
    """Every mode on every prompt, interleaved per prompt after a warm-up, `repeats` times with the mode that goes
    first rotating -> per repeat, mode -> its per-prompt runs (our decoder's runs keep their stats)."""
    for mode in modes:  # warm-up: first calls pay one-off costs (allocator, kernel selection)
        _run_mode(pair, mode, encoded[0][:16], 4, eos, (policies or {}).get(mode))

    passes: list[dict[str, list[dict]]] = []
    bar = tqdm(total=repeats * len(items) * len(modes), desc="bench", unit="run", disable=not progress)
    for r in range(repeats):
        results: dict[str, list[dict]] = {m: [] for m in modes}
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for p, ids in zip(items, encoded):
            for mode in order:
                bar.set_postfix_str(f"{p.id} {mode}" + (f" {r + 1}/{repeats}" if repeats > 1 else ""))
                toks, secs, st = _run_mode(pair, mode, ids, max_new_tokens, eos, (policies or {}).get(mode))
                results[mode].append({"id": p.id, "tokens": len(toks), "seconds": secs, "ids": toks, "stats": st})
                bar.update(1)
        passes.append(results)
    bar.close()
    return passes


def _merged(passes: list[dict[str, list[dict]]]) -> tuple[dict[str, list[dict]], dict[str, Stats]]:
    """All repeats as one run: mode -> every per-prompt run (with its repeat), mode -> merged decoder stats."""
    results: dict[str, list[dict]] = {m: [] for m in passes[0]}
    stats: dict[str, Stats] = {}
    for r, res in enumerate(passes):
        for mode, rows in res.items():
            for row in rows:
                st = row["stats"]
                results[mode].append({**{k: v for k, v in row.items() if k != "stats"},
                                      **({"repeat": r} if len(passes) > 1 else {})})
                if st is not None:
                    stats[mode] = stats[mode].merge(st) if mode in stats else st
    return results, stats


def _tok_per_s(rows: list[dict]) -> float:
    secs = sum(r["seconds"] for r in rows)
    return sum(r["tokens"] for r in rows) / secs if secs else 0.0


def _repeat_ratios(passes: list[dict[str, list[dict]]], a: str, b: str) -> list[float]:
    """tokens/s of mode `a` over mode `b`, repeat by repeat."""
    return [_tok_per_s(p[a]) / _tok_per_s(p[b]) for p in passes if _tok_per_s(p[b])]


def _mode_reports(modes: list[str], results: dict[str, list[dict]], stats: dict[str, Stats],
                  policies: dict[str, KPolicy]) -> dict[str, dict]:
    """Each mode's totals and per-prompt runs; the speculative modes also their policy, tau and acceptance."""
    report_modes: dict[str, dict] = {}
    for mode in modes:
        rows = results[mode]
        entry = _summary(sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows),
                         [{k: v for k, v in r.items() if k != "ids"} for r in rows])
        if mode.startswith("speculative"):
            st = stats[mode]
            entry.update(k=policies[mode].k, policy=policy_label(policies[mode]), mean_tau=st.mean_tau,
                         alpha=st.acceptance_rate,
                         tau_hist={str(t): c for t, c in st.tau_hist.items()}, drafted=st.drafted, accepted=st.accepted)
        report_modes[mode] = entry
    return report_modes


def _greedy_checks(items: list[Prompt], encoded: list[list[int]], passes: list[dict[str, list[dict]]],
                   spec_modes: list[str], hf_modes: bool) -> list[dict]:
    """Per prompt, in every repeat: speculative == target-only == HF greedy (target-only against itself without
    the HF modes)."""
    def same(a: str, b: str, i: int) -> bool:
        return all(p[a][i]["ids"] == p[b][i]["ids"] for p in passes)

    ref = "hf_generate" if hf_modes else "target_only"
    per_prompt = []
    for i, p in enumerate(items):
        row = {"id": p.id, "prompt_tokens": len(encoded[i]), "target_only_eq_hf": same("target_only", ref, i)}
        for m in spec_modes:
            row[f"{m}_eq_target_only"] = same(m, "target_only", i)
        if hf_modes:
            row["hf_assisted_eq_hf"] = same("hf_assisted", ref, i)
        row["greedy_equal"] = row["target_only_eq_hf"] and all(row[f"{m}_eq_target_only"] for m in spec_modes)
        per_prompt.append(row)
    return per_prompt


def run_bench(target: str, draft: str, cfg: BenchConfig | None = None, *, out: Path | None = None,
              progress: bool = True, pair: Pair | None = None) -> dict:
    """Time every mode on the same prompts; returns (and writes to `out`) the JSON report. `pair`: the target
    and draft already loaded (a vocabulary-pruned draft: its runner proposes the kept ids, while transformers'
    assisted generation runs its whole model, `pair.draft.model`)."""
    cfg = cfg or BenchConfig()
    prompts, n_prompts, max_new_tokens, ks = cfg.prompts, cfg.n_prompts, cfg.max_new_tokens, tuple(cfg.k)
    draft_quant, hf_modes = cfg.draft_quant, cfg.hf_modes
    items: list[Prompt] = load_prompts(prompts)
    if n_prompts:
        items = items[:n_prompts]
    pair = pair or load_pair(target, draft, draft_quant=draft_quant)
    tok = pair.target.tokenizer
    eos = eos_ids(pair.target)
    encoded = [prompt_ids(tok, p.prompt) for p in items]

    policies = spec_policies(list(ks), cfg.policy)
    modes = ["target_only", *policies] + (["hf_generate", "hf_assisted"] if hf_modes else [])
    passes = _time_modes(pair, items, encoded, modes, max_new_tokens, eos, progress, cfg.repeats, policies)
    report_modes = _mode_reports(modes, *_merged(passes), policies)
    spec_modes = [m for m in modes if m.startswith("speculative")]
    best = max(spec_modes, key=lambda m: report_modes[m]["tok_per_s"])
    per_prompt = _greedy_checks(items, encoded, passes, spec_modes, hf_modes)

    pairs = {"speedup_vs_target_only": (best, "target_only"), "speedup_vs_hf_generate": (best, "hf_generate"),
             "speedup_vs_hf_assisted": (best, "hf_assisted"),
             "target_only_vs_hf_generate": ("target_only", "hf_generate"),
             "hf_assisted_vs_hf_generate": ("hf_assisted", "hf_generate")}
    # per pair of modes, repeat by repeat; the report gives the median (None without that mode) and the range
    ratios = {name: _repeat_ratios(passes, a, b) if b in modes else [] for name, (a, b) in pairs.items()}
    # every speculative mode against each baseline: the summary above is the fastest one, picked on these prompts
    baselines = [b for b in ("target_only", "hf_generate", "hf_assisted") if b in modes]
    per_mode = {m: {f"vs_{b}": spread(r) for b in baselines if (r := _repeat_ratios(passes, m, b))}
                for m in spec_modes}
    report = {
        "target": pair.target.name,
        "draft": pair.draft.name,
        "draft_quantization": effective_quant(pair.draft.model, draft_quant) or "none",  # as the draft ran
        "dtype": str(next(pair.target.model.parameters()).dtype).removeprefix("torch."),
        "device": "cpu",
        "max_new_tokens": max_new_tokens,
        "prompts": [{"id": p.id, "domain": p.domain} for p in items],
        "k": report_modes[best]["k"],
        "policy": report_modes[best]["policy"],
        "best_definition": "the speculative mode with the most tokens/s on these prompts (picked in hindsight); "
                           "per_mode gives every mode's ratios",
        "ks": list(ks),
        "mean_tau": report_modes[best]["mean_tau"],
        "alpha": report_modes[best]["alpha"],
        "tau_definition": "tokens emitted per target forward, including the bonus/corrected token",
        "alpha_definition": "accepted draft tokens / drafted tokens, in the decoder",
        "greedy_equal": all(r["greedy_equal"] for r in per_prompt),
        "greedy_equal_per_prompt": per_prompt,
        "modes": {**{m: report_modes[m] for m in modes}, "speculative": report_modes[best]},
        **{name: statistics.median(r) if r else None for name, r in ratios.items()},
        "repeats": cfg.repeats,
        "per_mode": per_mode,
        **({f"{name}_range": [min(r), max(r)] for name, r in ratios.items() if r} if cfg.repeats > 1 else {}),
        "speedup_definition": "median over the repeats of (tokens/s of one mode / tokens/s of the other) in that "
                              "repeat, every prompt included; the modes of a repeat interleaved per prompt",
        "machine": machine_info(),
        "versions": versions(),
    }
    if out is not None:
        atomic_write_json(Path(out), report)
        atomic_write_bytes(Path(out).with_suffix(".png"), bench_plot(report))
    return report


def mode_rates(mode: dict) -> list[float]:
    """A bench mode's tokens/s in each repeat (`_tok_per_s` of its prompts in that repeat), in repeat order; a
    one-repeat report's rows carry no repeat number."""
    by_repeat: dict[int, list[dict]] = {}
    for p in mode["per_prompt"]:
        by_repeat.setdefault(p.get("repeat", 0), []).append(p)
    return [_tok_per_s(rows) for _, rows in sorted(by_repeat.items())]


def bench_plot(report: dict) -> bytes:
    """A bench report as one PNG: each mode's tokens/s (median over the repeats, the bar; their range, the whisker)
    with its ratio to the target alone; `speculative` (a copy of the best mode) is not drawn twice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = {m: mode_rates(v) for m, v in report["modes"].items() if m != "speculative" and v.get("per_prompt")}
    modes = {m: r for m, r in modes.items() if r}
    names = list(modes)
    med = [statistics.median(modes[m]) for m in names]
    lo = [x - min(modes[m]) for x, m in zip(med, names)]
    hi = [max(modes[m]) - x for x, m in zip(med, names)]
    fig, ax = plt.subplots(figsize=(8, 1.4 + 0.4 * len(names)))
    ax.barh(range(len(names)), med, 0.6, xerr=[lo, hi], capsize=3, color="tab:blue")
    base = modes.get("target_only")
    for i, (x, m) in enumerate(zip(med, names)):  # the ratio as the report defines it: the median of each repeat's
        ratio = statistics.median(a / b for a, b in zip(modes[m], base)) if base and all(base) else None
        ax.text(x, i, f"  {x:.2f} tok/s" + (f", {ratio:.2f}x the target alone" if ratio else ""), va="center",
                fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(med) * 1.6)
    ax.set_xlabel("tokens/s (median of repeats; whiskers: range)")
    what = textwrap.fill(f"{report['target']} with {report['draft']}", 100)
    ax.set_title(f"{what}\n{len(report['prompts'])} prompts x {report['max_new_tokens']} tokens, "
                 f"{report['repeats']} repeat(s), {report.get('machine', {}).get('cpu', '')}", fontsize=8)
    return png_bytes(fig)
