"""Rank candidate drafts for a target: acceptance per domain, measured cost, predicted (and measured) speedup.

    .venv/bin/draftsmith pair --target qwen2.5-coder-1.5b-instruct \
        --candidates qwen2.5-coder-0.5b-instruct,smollm2-135m-instruct,derive:qwen2.5-coder-1.5b-instruct:keep=8 \
        --prompts code,chat --validate 1 --out runs/pair-qwen

A candidate is a model spec (zoo name, HF folder, .gguf, derive:MODEL:keep=N), a vocabulary-pruned one
(prune:MODEL:vocab=FILE, `pairing.prune`: ranked beside MODEL whole, its acceptance measured with q = 0 outside
the kept ids, its cost with the cut head) or a draft head (head:FOLDER).

Steps: compatibility check per candidate -> the target's reference continuations (generated once, cached)
-> teacher-forced acceptance of every candidate in one pass over the target (a draft with the weights it decodes
with: int8 or int4; a head: by depth, fed by itself)
-> measured cost c and v(K) and a short calibration decode that times rounds in the decoder -> predicted speedup
(the rows walked round by round as the decoder walks them, over the round cost; docs/design.md) and best K
(overall and per domain) -> optionally, the built-in decoder on the top N candidates at their best K (and at
`validate_ks`), side by side in one run over one target-alone baseline so that their speedups compare, for the
measured speedup, the prediction error and its breakdown; the top N cross-tokenizer
candidates, which the decoder cannot run, in transformers' universal assisted generation against transformers'
`generate` alone (`decode.bench.hf_side_by_side`). Writes leaderboard.json, .md, .csv and .html (with PNG plots)
into --out.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


from draftsmith.decode.runtime.allocator import release_freed_memory
from draftsmith.decode.bench import hf_side_by_side, validate_drafts
from draftsmith.decode.runtime.records import Record
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_bytes, atomic_write_json, atomic_write_text, png_bytes
from draftsmith.decode.runtime.loading import Loaded, eos_ids, load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.prompts import Prompt, load_prompts
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.spec import DraftSpec
from draftsmith.decode.speculative import KPolicy
from draftsmith.pairing.acceptance import measure_acceptance, measure_head_acceptance
from draftsmith.pairing.compat import Compat, check_pair
from draftsmith.pairing.cost import (CostModel, DecoderCost, calibrate_decoder, measure_cost, shared_target_clock,
                          speedup_curve)
from draftsmith.pairing.policy import PolicyChoice, choose_policy
from draftsmith.pairing.drafts import Draft, load_draft, run_draft, runner_calib, runner_quant, spec_runner
from draftsmith.pairing.prune import KeptVocab
from draftsmith.pairing.reference import reference_continuations

MAX_K = 16


@dataclass
class PairConfig:
    """The pair stage's settings (a recipe's `pair:` section and the options of `draftsmith pair`)."""

    candidates: list[str] = field(default_factory=list)  # zoo names, HF folders, .gguf, derive:..., prune:..., head:...
    prompts_per_domain: int = 8  # prompts per domain for the acceptance measurement (0 = all)
    max_new_tokens: int = 64  # length of the target's reference continuations
    temperature: float = 0.0  # 0 = greedy acceptance (argmax agreement); > 0 = sum_x min(p, q) at that temperature
    validate: int = 0  # also decode the top N candidates for a measured speedup (cross-tokenizer: in transformers)
    validate_prompts: int = 4  # prompts per domain for the measured speedup
    draft_quant: str | None = "int8"  # int8 | null: draft weights on CPU (exactness is unaffected)
    batch_size: int = 4  # reference continuations scored together
    seed: int = 0  # sampling seed of the reference continuations (temperature > 0)
    calibrate_prompts: int = 2  # prompts of the short calibration decode that times rounds in the decoder (0 = off)
    calibrate_tokens: int = 32  # new tokens per calibration prompt
    validate_ks: list[int] = field(default_factory=list)  # also validate at these K (the measured best K among them)
    validate_repeats: int = 1  # interleaved passes of the validation (measured speedup: the median over them)

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("candidates: name at least one draft (zoo name, HF folder, derive:MODEL:keep=N)")
        for name in ("max_new_tokens", "validate_prompts", "batch_size", "validate_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompts_per_domain < 0:
            raise ValueError(f"prompts_per_domain must be >= 0 (0 = all), got {self.prompts_per_domain}")
        if self.validate < 0:
            raise ValueError(f"validate must be >= 0, got {self.validate}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.calibrate_prompts < 0 or self.calibrate_tokens < 2:
            raise ValueError("calibrate_prompts must be >= 0 and calibrate_tokens >= 2, "
                             f"got {self.calibrate_prompts}, {self.calibrate_tokens}")
        if any(not 1 <= K <= MAX_K for K in self.validate_ks):
            raise ValueError(f"validate_ks must lie in 1..{MAX_K}, got {self.validate_ks}")
        if self.draft_quant not in (None, "int8"):
            raise ValueError(f"draft_quant must be int8 or null, got {self.draft_quant!r}")


@dataclass
class Candidate:
    spec: str
    loaded: Loaded | None  # None for a head
    compat: object
    row: dict = field(default_factory=dict)
    head: object | None = None  # a decode.head.Eagle3Head for head:PATH
    kept: KeptVocab | None = None  # the kept target ids of prune:MODEL:vocab=FILE
    acc: object | None = None  # its pairing.acceptance.Acceptance, once measured
    cost: CostModel | None = None  # its isolated c and v(K), once timed
    dcost: DecoderCost | None = None  # its rounds timed in the decoder (target side shared: _share_target_clock)




def _draft(cand: Candidate, max_seq_len: int, cfg: PairConfig):
    """The candidate as the decoder runs it: a HeadDraft, or a runner (int8 on CPU when configured; its head cut to
    the kept ids when pruned)."""
    return run_draft(Draft(cand.spec, cand.loaded, cand.kept, cand.head), max_seq_len, cfg.draft_quant).runner


def _params_million(model) -> float:
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 1)


def _validate(target: Loaded, t_run, cands: list[Candidate], prompts: list[Prompt], refs, ks: dict[str, int],
              cfg: PairConfig, device: str) -> dict[str, dict]:
    """Measured speedups of candidates decoded side by side in one run over one target-alone baseline
    (decode.bench.validate_drafts; candidate `spec` at K `ks[spec]`), so their speedups compare: each with the
    per-round view of the breakdown, by spec."""
    by_id = {r["id"]: r for r in refs}
    names = {c.spec: f"draft{i}" for i, c in enumerate(cands)}
    drafts = {names[c.spec]: _draft(c, t_run.max_seq_len, cfg) for c in cands}
    policies = {names[c.spec]: KPolicy.fixed(ks[c.spec]) for c in cands}
    what = cands[0].spec if len(cands) == 1 else f"{len(cands)} drafts"
    val = validate_drafts(t_run, drafts, [by_id[p.id]["prompt_ids"] for p in prompts], k=max(ks.values()),
                          max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids(target), names=[p.id for p in prompts],
                          greedy=cfg.temperature == 0, desc=f"validate {what}", device=device, policies=policies,
                          repeats=cfg.validate_repeats)
    base = val.stats["target_only"]
    out = {}
    for spec, name in names.items():
        st = val.stats[name]
        out[spec] = {
            "k": ks[spec], "prompts": len(prompts), "target_only_tok_per_s": base.tokens_per_s,
            "speculative_tok_per_s": st.tokens_per_s, "target_only_seconds": base.seconds,
            "speculative_seconds": st.seconds, "tokens": st.new_tokens,
            "measured_speedup": val.speedup(name), "measured_speedup_repeats": val.repeat_speedups(name),
            "greedy_equal": val.greedy_equal[name] is not False,
            "mean_tau": st.mean_tau,
            "rounds": st.target_forwards,
            "spec_tokens_per_round": st.new_tokens / st.target_forwards,
            "measured_round_s": st.seconds / st.target_forwards,
            "measured_target_step_s": base.seconds / base.new_tokens,
            "side_by_side_with": [c for c in names if c != spec],
        }
    return out


def _relative_error(measured: float, predicted: float) -> float:
    """|measured - predicted| / measured: the leaderboard's prediction error."""
    return abs(measured - predicted) / measured


def _breakdown(row: dict, val: dict) -> dict:
    """Where predicted and measured speedup part ways: tokens per round (acceptance) or time per round (cost).

    Modeled round and token times are the decoder's own (calibration) when the row has them, else K isolated
    draft steps + one isolated verify."""
    K, t, dc = val["k"], row["timings"], row.get("decoder_cost")
    if dc:
        modeled_round, modeled_step = dc["round_s"][str(K)], dc["target_token_s"]
    else:
        modeled_round, modeled_step = K * t["draft_step_s"] + t["verify_s"][str(K)], t["target_step_s"]
    return {
        "expected_tau": row["tokens_per_round"][str(K)], "expected_tau_iid": row["expected_tau"][str(K)],
        "measured_tau": val["spec_tokens_per_round"],
        "tau_error": val["spec_tokens_per_round"] / row["tokens_per_round"][str(K)] - 1,
        "expected_tau_same_prompts": val.get("expected_tau_same_prompts"),
        "modeled_round_s": modeled_round, "measured_round_s": val["measured_round_s"],
        "round_error": val["measured_round_s"] / modeled_round - 1,
        "modeled_target_step_s": modeled_step, "measured_target_step_s": val["measured_target_step_s"],
        "predicted_speedup_at_k": row["predicted_speedup_by_k"][str(K)],
    }


def _choose(taus: dict[int, float], cost: CostModel, dcost: DecoderCost | None, tokens: float) -> PolicyChoice:
    """The best K for tokens per round walked on the rows (`Acceptance.tokens_per_round`, K -> tau) over the
    decoder's round cost when calibrated, else over the isolated c and v(K) (`pairing.policy.choose_policy`)."""
    return choose_policy(dcost or cost, taus=taus, tokens=tokens, max_k=MAX_K,
                         evidence="the rows walked as the decoder walks them")


def run_pair(target_spec: str, out: Path, cfg: PairConfig, *, prompts: str = "code,chat",
             limit_per_domain: int | None = None, device: str = "cpu", progress: bool = True) -> dict:
    """The whole leaderboard run; returns the leaderboard dict (also written to `out`).

    `prompts`: suite names or a file; `limit_per_domain` caps the prompts per domain before the pair's own
    `prompts_per_domain` does (a recipe's shared limit)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    limits = [n for n in (cfg.prompts_per_domain, limit_per_domain) if n]
    suite = load_prompts(prompts, limit_per_domain=min(limits) if limits else None)

    target = load(target_spec, device=device)
    cands = _load_candidates(cfg, target, device)
    refs = reference_continuations(target, suite, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature, seed=cfg.seed, draft=_reference_helper(cands),
                                   progress=progress)
    _measure_acceptance(target, cands, refs, cfg, progress)
    timing = _timing(target, refs, cfg)
    taus = [_taus(cand.acc) for cand in cands]  # rounds walked once a candidate: (overall, by domain)
    for cand, (overall, _) in zip(cands, taus):
        cand.cost, cand.dcost = _costs(target, cand, overall, timing, cfg, device, progress)
    _share_target_clock(cands)
    for cand, (overall, by_domain) in zip(cands, taus):
        cand.row = _rank(cand, overall, by_domain, timing)
    cands.sort(key=lambda c: c.row["predicted_speedup"], reverse=True)
    if cfg.validate:
        _validate_top(target, cands, timing.runner, refs, load_prompts(prompts, limit_per_domain=cfg.validate_prompts),
                      cfg, device)

    board = PairLeaderboard(
        target_spec, {**asdict(cfg), "prompts": prompts, "limit_per_domain": limit_per_domain, "device": device,
                      "n_prompts": len(suite), "domains": sorted({p.domain for p in suite})},
        [c.row for c in cands], machine=machine_info(), versions=versions(), definitions=DEFINITIONS,
        seconds=time.perf_counter() - t0).to_dict()
    write_leaderboard(board, out)
    return board


DEFINITIONS = {
    "alpha": "mean over positions of beta_t = sum_x min(p_t(x), q_t(x)), teacher-forced on the target's continuations"
             " (q from the draft as it decodes: its int8 or int4 weights)",
    "tau": "tokens emitted per target forward, including the bonus/corrected token",
    "cost_ratio": "one-token draft forward / one-token target forward (cached), measured here",
    "verify_cost": "target forward over K+1 tokens / over 1 token, measured here",
    "predicted_speedup": "tokens alone / tokens with the draft, per prompt: (prefill + n * token time) / "
                         "(prefill + n / tau(K) * round time(K)); tau(K) from the teacher-forced rows walked "
                         "round by round as the decoder does, round time from a calibration decode",
    "predicted_speedup_iid": "E[tau] / (K * cost_ratio + verify_cost(K)), E[tau] from alpha (i.i.d.)",
}


# --- candidates and acceptance -----------------------------------------------------------------


def _load_candidates(cfg: PairConfig, target: Loaded, device: str) -> list[Candidate]:
    """Every candidate spec loaded (a head on the target's embedding) with its compatibility verdict."""
    cands: list[Candidate] = []
    shared: dict = {}  # MODEL and its pruned variants share MODEL's weights
    for spec in cfg.candidates:
        if DraftSpec.parse(spec).is_head and not cfg.calibrate_prompts:
            raise DraftsmithError(f"{spec}: a head's cost is timed in the decoder; set calibrate_prompts >= 1")
        d = load_draft(spec, target, device, shared)
        if d.head is not None:
            cands.append(Candidate(spec, None, Compat("head", True, ["reads the target's hidden states (EAGLE-3)"]),
                                   head=d.head))
        else:
            cands.append(Candidate(spec, d.loaded, _compat(target, d.loaded, d.kept), kept=d.kept))
    return cands


def _compat(target: Loaded, draft: Loaded, kept: KeptVocab | None) -> Compat:
    """`check_pair`'s verdict; a pruned draft says what it keeps, and that llama.cpp cannot run it pruned."""
    compat = check_pair(target, draft)
    if kept is not None:
        compat.notes.append(kept.describe())
        compat.llama_cpp = False
        compat.llama_cpp_notes.append("llama.cpp's draft-simple runs a draft over its whole vocabulary: a pruned "
                                      "vocabulary has no llama.cpp form (serve MODEL whole there)")
    return compat


def _reference_helper(cands: list[Candidate]) -> Loaded | None:
    """A same-tokenizer candidate speeds up the references (exactly); derived drafts start near alpha 0 and would
    slow them down, so they never help; nor do pruned ones (the helper runs whole: MODEL is a candidate of its own)."""
    return next((c.loaded for c in cands if c.loaded is not None and c.compat.compatible and c.kept is None
                 and DraftSpec.parse(c.spec).kind != "derive"), None)


def _measure_acceptance(target: Loaded, cands: list[Candidate], refs, cfg: PairConfig, progress: bool) -> None:
    """Sets every candidate's `acc`: the models teacher-forced together in one pass over the target, each head
    by depth, fed by itself."""
    params = SamplingParams(cfg.temperature)
    models = [c for c in cands if c.head is None]
    runners = _acceptance_runners(target, models, refs, cfg)
    by_model = dict(zip((c.spec for c in models), measure_acceptance(
        target, [c.loaded for c in models], refs, params=params, batch_size=cfg.batch_size, progress=progress,
        kept=[c.kept.proposes if c.kept is not None else None for c in models], runners=runners)))
    del runners
    release_freed_memory()
    for c in cands:
        c.acc = by_model[c.spec] if c.head is None else measure_head_acceptance(
            target, c.head, refs, c.spec, params=params, depth=MAX_K, progress=progress)


def _acceptance_runners(target: Loaded, models: list[Candidate], refs, cfg: PairConfig) -> list:
    """For each standalone candidate, the runner its acceptance is read through: the draft with the weights it
    decodes with (int8 or int4: `runner_quant`, with its LoRA adapter, as in `pairing.drafts.spec_runner`; whole, its pruning applied as `kept`), or None
    where it decodes as loaded (no quantisation) or through text (another tokenizer). Candidates on one model with
    one quantisation share a runner."""
    max_len = max(len(p) + len(c) for p, c in zip(refs["prompt_ids"], refs["continuation_ids"])) + 1
    t_vocab = target.tokenizer.get_vocab()
    shared: dict[tuple, object] = {}
    runners = []
    for c in models:
        q = runner_quant(c.loaded.model, cfg.draft_quant, c.spec)
        if q is None or c.loaded.tokenizer.get_vocab() != t_vocab:
            runners.append(None)
            continue
        calib, lora = runner_calib(q, c.spec), DraftSpec.parse(c.spec, sniff=False).adapter
        key = (id(c.loaded.model), q, None if calib is None else calib.key, None if lora is None else str(lora))
        if key not in shared:  # with its adapter where it has one (`int4:MODEL:lora=FOLDER`), as it decodes
            shared[key] = spec_runner(c.loaded.model, max_len, q, c.spec)
        runners.append(shared[key])
    return runners


# --- cost and the predicted speedup ------------------------------------------------------------


@dataclass
class _Timing:
    """What every candidate is timed against: the target's runner at the decoder's mean context, the calibration
    prompts, the mean continuation length (overall under None, and per domain) and the target's v(K)."""

    runner: object
    context: int
    mean_tokens: dict[str | None, float]
    calib_prompts: list[list[int]]
    v_ratios: dict[int, float] | None = None  # measured with the first candidate, reused for the rest


def _timing(target: Loaded, refs, cfg: PairConfig) -> _Timing:
    max_len = max(len(r) for r in refs["prompt_ids"]) + cfg.max_new_tokens + MAX_K + 2
    # time c and v(K) at the decoder's mean context: mean prompt + half the new tokens
    context = round(sum(len(r) for r in refs["prompt_ids"]) / len(refs) + cfg.max_new_tokens / 2)
    runner = make_runner(target.model, max(max_len, context + MAX_K + 2))
    return _Timing(runner, context, _mean_tokens(refs), _calibration_prompts(refs, cfg.calibrate_prompts))


def _mean_tokens(refs) -> dict[str | None, float]:
    """Mean length of the reference continuations: overall (key None) and per domain."""
    mean = {None: sum(len(r) for r in refs["continuation_ids"]) / len(refs)}
    for d in {r for r in refs["domain"]}:
        lens = [len(c) for c, dd in zip(refs["continuation_ids"], refs["domain"]) if dd == d]
        mean[d] = sum(lens) / len(lens)
    return mean


def _isolated_cost(timing: _Timing, draft, device: str) -> CostModel:
    """c and v(K) timed outside the decoder; `draft` None times the target alone (a head's step is timed in the
    decoder only)."""
    if timing.v_ratios is None:  # v(K) is the target's alone: measure the whole curve once
        cost = measure_cost(timing.runner, draft, ks=range(1, MAX_K + 1), repeats=3, warmup=1, context=timing.context,
                            device=device)
        timing.v_ratios = cost.v
        return cost
    # c side by side with the target step; v(K) reused as ratios to that step
    quick = measure_cost(timing.runner, draft, ks=[1], repeats=5, warmup=1, context=timing.context, device=device)
    return CostModel(quick.target_step_s, quick.draft_step_s,
                     {K: v * quick.target_step_s for K, v in timing.v_ratios.items()}, quick.context, quick.repeats)


def _decoder_cost(target: Loaded, cand: Candidate, d_runner, cost: CostModel, taus: dict[int, float],
                  timing: _Timing, cfg: PairConfig, device: str,
                  progress: bool) -> tuple[CostModel, DecoderCost | None]:
    """Rounds timed in the decoder by a short calibration decode at the K the isolated cost ranks best, when the
    decoder can run the candidate; a head's c then comes from there. Returns (cost, decoder cost or None)."""
    if not (cand.compat.compatible and timing.calib_prompts):
        return cost, None
    if cand.head is not None:  # a head's step is only timed inside the decoder: calibrate at c = 0.1 first
        cost = replace(cost, draft_step_s=0.1 * cost.target_step_s)
    k0 = _choose(taus, cost, None, timing.mean_tokens[None]).k
    dcost = calibrate_decoder(timing.runner, d_runner, timing.calib_prompts, k=k0, isolated=cost,
                              max_new_tokens=min(cfg.calibrate_tokens, cfg.max_new_tokens),
                              eos_ids=eos_ids(target), device=device, progress=progress)
    if cand.head is not None:  # c as the decoder measured it
        cost = replace(cost, draft_step_s=dcost.draft_step_s / dcost.target_token_s * cost.target_step_s)
    return cost, dcost


def _taus(acc) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
    """Tokens per round at every K, walked once: overall, and per domain."""
    return ({K: acc.tokens_per_round(K) for K in range(1, MAX_K + 1)},
            {d: {K: acc.tokens_per_round(K, d) for K in range(1, MAX_K + 1)} for d in acc.alpha_by_domain})


def _costs(target: Loaded, cand: Candidate, taus: dict[int, float], timing: _Timing, cfg: PairConfig, device: str,
           progress: bool) -> tuple[CostModel, DecoderCost | None]:
    """The candidate's measured cost: isolated c and v(K), and its rounds timed in the decoder (at the K its
    tokens per round `taus` and the isolated cost rank best)."""
    d_runner = _draft(cand, timing.runner.max_seq_len, cfg)
    cost = _isolated_cost(timing, None if cand.head is not None else d_runner, device)
    return _decoder_cost(target, cand, d_runner, cost, taus, timing, cfg, device, progress)


def _share_target_clock(cands: list[Candidate]) -> None:
    """The standalone drafts' calibrations share one target clock (`pairing.cost.shared_target_clock`): the same
    target verifies them all, so the VM's drift between their calibration windows must not rank them. A head's
    verify also hands the target's features to the head, so heads keep their own."""
    model_drafts = [c for c in cands if c.head is None and c.dcost is not None]
    for cand, shared in zip(model_drafts, shared_target_clock([c.dcost for c in model_drafts])):
        cand.dcost = shared


def _rank(cand: Candidate, taus: dict[int, float], taus_by_domain: dict[str, dict[int, float]],
          timing: _Timing) -> dict:
    """The candidate's leaderboard row: its tokens per round at every K (overall and per domain), its measured
    cost and the predicted speedup and best K."""
    cost, dcost = cand.cost, cand.dcost
    choice = _choose(taus, cost, dcost, timing.mean_tokens[None])
    by_domain = {d: _choose(t, cost, dcost, timing.mean_tokens[d]) for d, t in taus_by_domain.items()}
    return _row(cand, taus, taus_by_domain, cost, dcost, choice, by_domain)


def _row(cand: Candidate, taus: dict[int, float], taus_by_domain: dict[str, dict[int, float]], cost: CostModel,
         dcost: DecoderCost | None, choice: PolicyChoice, by_domain: dict[str, PolicyChoice]) -> dict:
    """The leaderboard row: `choice` is the best K with the predicted curve, `by_domain` the same per domain."""
    acc, k, curve = cand.acc, choice.k, choice.curve
    return {
        "draft": cand.spec,
        "params": _params_million(cand.head if cand.head is not None else cand.loaded.model),
        "params_unit": "million",
        "compatible": cand.compat.compatible,
        "kind": cand.compat.kind,
        "compat_notes": cand.compat.notes,
        "draft_vocab": None if cand.kept is None else {"n": cand.kept.n, "vocab_size": cand.kept.vocab_size,
                                                       "covered": cand.kept.covered, "source": cand.kept.source,
                                                       "context_ids": cand.kept.context},
        "llama_cpp_compatible": cand.compat.llama_cpp,
        "llama_cpp_notes": cand.compat.llama_cpp_notes,
        "alpha": acc.alpha,
        "alpha_by_domain": acc.alpha_by_domain,
        "positions": acc.positions,
        "positions_by_domain": acc.positions_by_domain,
        "acceptance_method": acc.method,
        "alpha_by_position": acc.by_position,
        "depth_rates": acc.depth_rates(MAX_K),
        "expected_tau": {str(K): t for K, t in acc.expected_tau.items()},
        "tokens_per_round": {str(K): t for K, t in taus.items()},
        "tokens_per_round_by_domain": {d: {str(K): t for K, t in ts.items()} for d, ts in taus_by_domain.items()},
        "cost_ratio": cost.c,
        "verify_cost": {str(K): v for K, v in cost.v.items()},
        "timings": cost.to_dict(),
        "decoder_cost": dcost.to_dict() if dcost else None,
        "prediction_method": "rows walked as the decoder walks them; round cost "
                             + ("timed in the decoder (calibration)" if dcost else "from isolated c and v(K)"),
        "best_k": k,
        "predicted_speedup": curve[k],
        "predicted_speedup_by_k": {str(K): x for K, x in curve.items()},
        "predicted_speedup_iid": speedup_curve(acc.alpha, cost.c, cost.v)[k],
        "best_k_by_domain": {d: c.k for d, c in by_domain.items()},
        "predicted_speedup_by_domain": {d: c.predicted for d, c in by_domain.items()},
        "measured_speedup": None,
        "validation": None,
    }


# --- validation --------------------------------------------------------------------------------


def _validate_top(target: Loaded, cands: list[Candidate], t_runner, refs, val_prompts: list[Prompt],
                  cfg: PairConfig, device: str) -> None:
    """The top `cfg.validate` candidates the decoder can run, measured in it side by side; at temperature 0 the
    top cross-tokenizer ones in transformers; a note on every cross-tokenizer row left unmeasured. `cands` sorted."""
    val_prompts = [p for p in val_prompts if p.id in set(refs["id"])]
    in_decoder = [c for c in cands if c.compat.compatible][: cfg.validate]
    if in_decoder:
        _validate_in_decoder(target, t_runner, in_decoder, val_prompts, refs, cfg, device)
    cross = [c for c in cands if not c.compat.compatible and c.loaded is not None] if cfg.temperature == 0 else []
    by_id = {r["id"]: r for r in refs}
    for cand in cross[: cfg.validate]:
        _validate_cross_tokenizer(target, cand, [by_id[p.id]["prompt_ids"] for p in val_prompts], cfg)
    for cand in cands:
        if not cand.compat.compatible and cand.row["measured_speedup"] is None:
            cand.row.setdefault("validation_note",
                                "cross-tokenizer: the token-level decoder cannot run it; not validated")


def _validate_in_decoder(target: Loaded, t_runner, cands: list[Candidate], val_prompts: list[Prompt], refs,
                         cfg: PairConfig, device: str) -> None:
    """Measured speedups, all candidates side by side over one target-alone baseline: at each one's predicted
    best K (and all at each of `validate_ks`, for the measured best K); the prediction error and its breakdown,
    into each candidate's row."""
    at_best = _validate(target, t_runner, cands, val_prompts, refs, {c.spec: c.row["best_k"] for c in cands}, cfg,
                        device)
    at_k = {K: _validate(target, t_runner, cands, val_prompts, refs, {c.spec: K for c in cands}, cfg, device)
            for K in sorted(set(cfg.validate_ks))}
    for cand in cands:
        row, best = cand.row, cand.row["best_k"]
        vals = {**{K: v[cand.spec] for K, v in at_k.items()}, best: at_best[cand.spec]}
        val = vals[best]
        val["expected_tau_same_prompts"] = cand.acc.tokens_per_round(best, ids={p.id for p in val_prompts})
        row["validation"] = val
        row["measured_speedup"] = val["measured_speedup"]
        row["prediction_error"] = _relative_error(val["measured_speedup"], row["predicted_speedup"])
        row["prediction_breakdown"] = _breakdown(row, val)
        if len(vals) > 1:
            measured = {K: v["measured_speedup"] for K, v in vals.items()}
            mk = max(measured, key=lambda K: (measured[K], -K))  # the measured best, ties to the smaller K
            row["validation_by_k"] = {str(K): v for K, v in sorted(vals.items())}
            row["measured_speedup_by_k"] = {str(K): x for K, x in sorted(measured.items())}
            row["prediction_error_by_k"] = {
                str(K): _relative_error(x, row["predicted_speedup_by_k"][str(K)]) for K, x in measured.items()}
            row["measured_best_k"] = mk
            row["best_k_shortfall"] = 1 - measured[best] / measured[mk]  # 0 when the predicted K is best


def _validate_cross_tokenizer(target: Loaded, cand: Candidate, prompt_ids: list[list[int]], cfg: PairConfig) -> None:
    """Another tokenizer: our token-level decoder cannot run it; transformers' universal assisted generation can
    (text-level), measured against transformers' generate on the target alone. A pair transformers refuses gets
    a note; the rest go on."""
    row = cand.row
    try:
        val = hf_side_by_side(target, cand.loaded, prompt_ids, k=row["best_k"], max_new_tokens=cfg.max_new_tokens,
                              eos_ids=eos_ids(target), desc=f"validate {cand.spec} (transformers)")
    except (ValueError, TypeError, RuntimeError) as e:
        row["validation_note"] = (f"cross-tokenizer: transformers' universal assisted generation could "
                                  f"not run it ({str(e).splitlines()[0][:200]}); not validated")
        return
    val["engine"] = "transformers universal assisted generation vs transformers generate"
    row["validation"] = val
    row["measured_speedup"] = val["measured_speedup"]
    if val["measured_speedup"]:
        row["prediction_error"] = _relative_error(val["measured_speedup"], row["predicted_speedup"])


# --- outputs ----------------------------------------------------------------------------------


def _calibration_prompts(refs, n: int) -> list[list[int]]:
    """The first prompt of each domain in turn (then the second ...), n in all: contexts like the run's."""
    by_domain: dict[str, list[list[int]]] = {}
    for r in refs:
        by_domain.setdefault(r["domain"], []).append(list(r["prompt_ids"]))
    out: list[list[int]] = []
    for i in range(max((len(v) for v in by_domain.values()), default=0)):
        out += [v[i] for _, v in sorted(by_domain.items()) if i < len(v)]
    return out[:n]


def _fmt(v, nd: int = 2) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


CAVEAT_ERROR = 0.15  # a prediction further than this from the measurement (relative to it) carries a caveat


def prediction_caveat(predicted: float | None, measured: float | None) -> str | None:
    """Why a prediction should not be trusted as it stands, or None: it said the draft pays and the measurement
    says it does not, or it is more than 15% off the measurement."""
    if not predicted or not measured:
        return None
    if predicted > 1.0 > measured:
        return f"predicted {predicted:.2f}x but measured {measured:.2f}x: slower than the target alone"
    error = abs(measured - predicted) / measured
    if error > CAVEAT_ERROR:
        return f"predicted {predicted:.2f}x, measured {measured:.2f}x: the prediction is {100 * error:.0f}% off"
    return None


def table_rows(board: dict) -> tuple[list[str], list[list[str]]]:
    domains = board["settings"]["domains"]
    head = ["draft", "kind", "params (M)", "alpha", *[f"alpha {d}" for d in domains], "c", "v(best K)",
            "best K", "predicted", "measured", "error", "llama.cpp"]
    rows = []
    for c in board["candidates"]:
        rows.append([
            c["draft"], c["kind"], _fmt(c["params"], 1), _fmt(c["alpha"], 3),
            *[_fmt(c["alpha_by_domain"].get(d), 3) for d in domains],
            _fmt(c["cost_ratio"], 3), _fmt(c["verify_cost"][str(c["best_k"])]), str(c["best_k"]),
            _fmt(c["predicted_speedup"]) + "x",
            ((_fmt(c["measured_speedup"]) + "x") if c["measured_speedup"] else "-")
            + (" (!)" if prediction_caveat(c["predicted_speedup"], c["measured_speedup"]) else ""),
            f"{100 * c['prediction_error']:.0f}%" if c.get("prediction_error") is not None else "-",
            {True: "pass", False: "fail", None: "-"}[c["llama_cpp_compatible"]],
        ])
    return head, rows


def markdown(board: dict) -> str:
    head, rows = table_rows(board)
    lines = [f"# Draft leaderboard for `{board['target']}`", "",
             f"{board['settings']['n_prompts']} prompts ({board['settings']['prompts']}), "
             f"{board['settings']['max_new_tokens']} reference tokens each, temperature {board['settings']['temperature']}; "
             f"machine: {board['machine']['cpu']} ({board['machine']['cpu_count']} cores).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    caveats = [(c["draft"], prediction_caveat(c["predicted_speedup"], c["measured_speedup"]))
               for c in board["candidates"]]
    lines += [""] + [f"(!) `{d}`: {why}." for d, why in caveats if why]
    lines += ["", "alpha: teacher-forced mean of sum min(p, q); c: draft step / target step; v(K): target over K+1 "
              "tokens / over 1; predicted speedup: tau(K) walked on the teacher-forced rows as the decoder walks them, over the round cost timed in the decoder (docs/design.md); tau counts the bonus token."]
    for c in board["candidates"]:
        v = c.get("validation")
        if v and v.get("engine"):  # a cross-tokenizer draft, measured in transformers
            lines.append(f"\nValidated `{c['draft']}` at K={v['k']} on {v['prompts']} prompts in {v['engine']}: "
                         f"{v['hf_generate']['tok_per_s']:.2f} tok/s alone, {v['hf_assisted']['tok_per_s']:.2f} with "
                         f"the draft, measured {v['measured_speedup']:.2f}x vs predicted {c['predicted_speedup']:.2f}x "
                         f"for our decoder, greedy equal: {v['greedy_equal']}.")
        elif v:
            lines.append(f"\nValidated `{c['draft']}` at K={v['k']} on {v['prompts']} prompts: target-only "
                         f"{v['target_only_tok_per_s']:.2f} tok/s, speculative {v['speculative_tok_per_s']:.2f} tok/s, "
                         f"measured {v['measured_speedup']:.2f}x vs predicted {c['predicted_speedup']:.2f}x "
                         f"(error {100 * c['prediction_error']:.0f}%; the i.i.d. formula said "
                         f"{c['predicted_speedup_iid']:.2f}x), greedy equal: {v['greedy_equal']}.")
            b = c.get("prediction_breakdown")
            if b:
                lines.append(
                    f"Breakdown: tokens per round {b['measured_tau']:.2f} measured vs {b['expected_tau']:.2f} predicted "
                    f"({100 * b['tau_error']:+.0f}%; {b['expected_tau_iid']:.2f} from alpha i.i.d.; "
                    f"{b['expected_tau_same_prompts'] or float('nan'):.2f} walked on the validated prompts' rows "
                    "alone); seconds per round "
                    f"{b['measured_round_s']:.4f} measured vs {b['modeled_round_s']:.4f} modeled "
                    f"({100 * b['round_error']:+.0f}%); target step {b['measured_target_step_s']:.4f} s in validation vs "
                    f"{b['modeled_target_step_s']:.4f} s modeled.")
            by_k = c.get("measured_speedup_by_k")
            if by_k:
                pairs = ", ".join(f"K={K}: {x:.2f}x measured / {c['predicted_speedup_by_k'][K]:.2f}x predicted"
                                  for K, x in by_k.items())
                lines.append(f"By K: {pairs}; predicted best K {c['best_k']}, measured best K {c['measured_best_k']} "
                             f"(the predicted K is {100 * c['best_k_shortfall']:.1f}% slower than the measured best).")
        if c.get("validation_note"):
            lines.append(f"\n`{c['draft']}`: {c['validation_note']}.")
        for note in c["compat_notes"]:
            lines.append(f"- `{c['draft']}`: {note}")
    return "\n".join(lines) + "\n"


def _plots(board: dict) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs = {}
    cands, domains = board["candidates"], board["settings"]["domains"]

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(1, len(cands))
    for i, c in enumerate(cands):
        xs = [j + i * width for j in range(len(domains))]
        ax.bar(xs, [c["alpha_by_domain"].get(d, 0) for d in domains], width, label=c["draft"])
    ax.set_xticks([j + width * (len(cands) - 1) / 2 for j in range(len(domains))], domains)
    ax.set_ylabel("alpha"), ax.set_ylim(0, 1), ax.set_title("acceptance by domain"), ax.legend(fontsize=7)
    pngs["alpha_by_domain.png"] = png_bytes(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for c in cands:
        ks = sorted(int(k) for k in c["predicted_speedup_by_k"])
        ax.plot(ks, [c["predicted_speedup_by_k"][str(k)] for k in ks], marker="o", ms=3, label=c["draft"])
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("K (draft tokens per step)"), ax.set_ylabel("predicted speedup"), ax.legend(fontsize=7)
    ax.set_title("predicted speedup vs K (measured c and v(K))")
    pngs["speedup_vs_k.png"] = png_bytes(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for c in cands:
        ax.plot(range(len(c["alpha_by_position"])), c["alpha_by_position"], label=c["draft"])
    ax.set_xlabel("position in continuation"), ax.set_ylabel("mean beta"), ax.set_ylim(0, 1.02)
    ax.set_title("acceptance by position"), ax.legend(fontsize=7)
    pngs["alpha_by_position.png"] = png_bytes(fig)
    return pngs


def html_page(board: dict, pngs: dict[str, bytes]) -> str:
    head, rows = table_rows(board)
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>" for r in rows)
    imgs = "".join(f'<figure><img alt="{html.escape(n)}" src="data:image/png;base64,{base64.b64encode(b).decode()}">'
                   f"</figure>" for n, b in pngs.items())
    return (f"<!doctype html><meta charset=utf-8><title>draftsmith leaderboard: {html.escape(board['target'])}</title>"
            "<style>body{font-family:sans-serif;margin:2em;max-width:90em}pre{white-space:pre-wrap}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:4px 8px;text-align:right}td:first-child{text-align:left}.table{overflow-x:auto}"
            "img{max-width:100%}.caveat{color:#a30;font-weight:bold}</style>"
            f"<h1>Draft leaderboard for {html.escape(board['target'])}</h1>"
            f'<div class="table"><table><tr>{cells}</tr>{body}</table></div>'
            + "".join(f'<p class="caveat">(!) {html.escape(c["draft"])}: {html.escape(why)}.</p>'
                      for c in board["candidates"]
                      for why in [prediction_caveat(c["predicted_speedup"], c["measured_speedup"])] if why)
            + f"<pre>{html.escape(markdown(board).split(chr(10) + chr(10), 3)[-1])}</pre>{imgs}")


def write_leaderboard(board: dict, out: Path) -> None:
    """leaderboard.json, .md, .csv, .html and the plots (PNG) into `out`, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "leaderboard.json", board)
    pngs = _plots(board)
    texts = {"leaderboard.md": markdown(board), "leaderboard.html": html_page(board, pngs)}
    head, rows = table_rows(board)
    buf = io.StringIO()
    csv.writer(buf).writerows([head, *rows])
    texts["leaderboard.csv"] = buf.getvalue()
    for name, text in texts.items():
        atomic_write_text(out / name, text)
    for name, data in pngs.items():
        atomic_write_bytes(out / name, data)


@dataclass
class PairLeaderboard(Record):
    """pairing/leaderboard.json (`run_pair` writes it through this type): the target, the settings it ran with
    (PairConfig's fields plus prompts, n_prompts, domains, device), one row per candidate sorted by predicted
    speedup (`_row`: draft, kind, alpha, alpha_by_domain, cost_ratio, verify_cost, best_k, predicted_speedup,
    measured_speedup, ...), and the machine, versions, definitions and seconds of the run (absent in a
    hand-written board)."""

    target: str
    settings: dict
    candidates: list[dict]
    machine: dict | None = None
    versions: dict | None = None
    definitions: dict | None = None
    seconds: float | None = None
