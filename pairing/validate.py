"""Validation: the target alone and each draft on the same prompts, interleaved in one run: the measured speedup.

    from draftsmith.pairing.validate import DraftUnderTest, ValidateConfig, validate
    result = validate("smollm2-135m-instruct",
                      [DraftUnderTest("draft_before", "derive:smollm2-135m-instruct:keep=4", alpha=0.04),
                       DraftUnderTest("draft_after", "runs/x/distill/best", alpha=0.17, chooses=True)],
                      prompts, ValidateConfig(), out=Path("runs/x/validate/bench.json"))

Any draft kind goes through here: a model spec (zoo name, HF folder, .gguf, derive:..., prune:MODEL:vocab=FILE) or
`head:FOLDER`. One draft `chooses`: its evidence picks the round policy (`pairing.policy.choose_policy`) over the
round cost timed here (or it brings one already chosen on the dev prompts: `DraftUnderTest.policy`, the race stage's
raced policy), and every draft without a K of its own runs that policy. The cost is timed the way the draft
runs: a draft that reads the target (a head) only inside the decoder (a short calibration decode), any other draft
step by step in isolation. The result (`ValidationResult`, written as bench.json) records each draft's policy, the
choice and its evidence, the timings, the machine and the versions. A run whose speculative output differs from the
target's greedy output is refused after its numbers are written (the decoder's contract).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from draftsmith.decode.bench import Validation, validate_drafts
from draftsmith.decode.runtime.records import Part, Record
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import Loaded, eos_ids, load
from draftsmith.decode.lookup import copy_table
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.prompts import Prompt, first_per_domain
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.spec import DraftSpec
from draftsmith.decode.speculative import KPolicy, check_siblings
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.textgen import prompt_ids
from draftsmith.pairing.cost import COST_CONTEXT, calibrate_decoder, measure_cost
from draftsmith.pairing.head_rounds import depth_records, standalone_records
from draftsmith.pairing.ladder import Rung, ladder
from draftsmith.pairing.acceptance import Acceptance, measure_acceptance
from draftsmith.pairing.drafts import Draft, Opened, open_draft, standalone_runner
from draftsmith.pairing.reference import reference_continuations
from draftsmith.pairing.policy import PolicyChoice, choose_policy, taus_from_alpha, taus_from_rates


@dataclass
class ValidateConfig:
    """The validate stage's settings: the target alone and each draft, same prompts, same run."""

    prompts_per_domain: int = 2  # test prompts timed per domain
    skip_per_domain: int = 0  # test prompts of each domain passed over before the timed ones (those an earlier
    # run timed, when this run's settings were chosen after looking at its numbers)
    max_new_tokens: int = 64  # tokens decoded per prompt
    repeats: int = 3  # interleaved repeats (the decoder going first rotates); speedups are their median and range
    k: int = 0  # draft tokens per round; 0 = the best predicted from the measured cost and the draft's acceptance
    max_k: int = 8  # largest K considered when k = 0
    draft_quant: str | None = "int8"  # int8 | null: draft weights on CPU (exactness is unaffected)
    gate: bool = True  # heads (and standalone drafts that walk their rounds), k = 0: also pick a draft probability
    # below which a round stops early
    siblings: int = 2  # with gate: also predict rounds that propose this many first tokens side by side where the
    # draft is unsure (a tree verify; 0 = never), and run them if they predict best
    sibling_depth: int = 1  # 2: also predict those rounds with the head's next token after each sibling (2m + 1 rows)
    lookup: list[int] = field(default_factory=lambda: [0, 4, 8])  # a standalone draft whose rounds are walked: also
    # predict chains followed by up to this many lookup tokens (copied from earlier in the text; 0 = none)

    def __post_init__(self) -> None:
        for name in ("prompts_per_domain", "max_new_tokens", "max_k", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0 (0 = best measured), got {self.k}")
        if self.skip_per_domain < 0:
            raise ValueError(f"skip_per_domain must be >= 0, got {self.skip_per_domain}")
        check_siblings(self.siblings)
        if self.sibling_depth not in (1, 2):
            raise ValueError(f"sibling_depth must be 1 or 2, got {self.sibling_depth}")
        if not self.lookup or any(not isinstance(L, int) or L < 0 for L in self.lookup):
            raise ValueError(f"lookup must list token counts >= 0, got {self.lookup}")
        if self.draft_quant not in (None, "int8"):
            raise ValueError(f"draft_quant must be int8 or null, got {self.draft_quant!r}")


@dataclass
class DraftUnderTest:
    """One draft to time. Evidence for choosing its policy, any of: `alpha` (teacher-forced, i.i.d. rounds),
    `rates` (acceptance by depth), `held` (held-out reference rows of a head, walked as the decoder walks them).
    `k` pins its K (e.g. a standalone draft at the pair stage's best K beside a head)."""

    name: str  # its key in bench.json: draft_before | draft_after
    spec: str  # model spec, or head:FOLDER
    label: str | None = None  # how the report names it
    alpha: float | None = None
    rates: list[float | None] | None = None
    held: list[dict] | None = None
    k: int | None = None
    chooses: bool = False
    walk: bool = False  # a standalone chooser: walk its rounds on the target's greedy answers to the dev prompts
    # (`standalone_records`) for K, a stop threshold and sibling rounds (with `ValidateConfig.gate`)
    refs: list[tuple[list[int], list[int]]] | None = None  # those answers (prompt ids, continuation), set by validate
    policy: KPolicy | None = None  # a policy already chosen on the dev prompts (the race stage's, walked as
    # validate walks it): a chooser serves it as is, nothing timed to choose it; any other draft runs it
    step: str | None = None  # a rung of the ladder (`pairing.ladder`): what it changes over the draft listed before it
    predicted: float | None = None  # its predicted speedup over the target alone (dev-prompt evidence), for the ladder
    versus: str | None = None  # another decoder's name it is compared with in every repeat (a trained draft with its
    # untrained self): bench.json's `versus`


@dataclass
class ValidationResult:
    """What a validation measured: the side-by-side timing, each draft's policy, and how the policy was chosen."""

    target: str
    drafts: list[DraftUnderTest]
    validation: Validation
    policies: dict[str, KPolicy]
    choice: PolicyChoice
    quant: dict[str, str | None]
    cost: dict = field(default_factory=dict)  # cost_ratio, verify_cost, decoder_cost (the chooser's)
    kind: str = "standalone"
    roles: dict = field(default_factory=dict)  # which prompts chose the policy, which were timed
    agreement: dict = field(default_factory=dict)  # `agreement_on`: teacher-forced alpha on the timed prompts

    @property
    def k(self) -> int:
        return self.choice.k

    @property
    def greedy_equal(self) -> bool:
        return all(self.validation.greedy_equal.values())

    def to_dict(self) -> dict:
        by = {d.name: d for d in self.drafts}
        before, after = by.get("draft_before"), by.get("draft_after")
        chooser = next(d for d in self.drafts if d.chooses)
        p = self.choice.policy
        out = {
            "target": self.target, "kind": self.kind, "draft": before.spec if before else None,
            "distilled": _folder_or_spec(after.spec) if after else None,
            "labels": {d.name: d.label for d in self.drafts if d.label},
            **self.validation.to_dict(), **self.choice.to_dict(),
            **{key: v for key, v in p.to_dict().items() if key != "k"},
            "policies": {n: pol.to_dict() for n, pol in self.policies.items()},
            "draft_quant": next((q for n, q in self.quant.items() if not DraftSpec.parse(by[n].spec).is_head), None),
            "head_quant": next((q for n, q in self.quant.items() if DraftSpec.parse(by[n].spec).is_head), None),
            "quant_by_draft": dict(self.quant),  # each decoder's own (an int4 draft beside an int8 one)
            "alpha": chooser.alpha if chooser.alpha is not None else (chooser.rates or [None])[0],
            "cost_ratio": self.cost.get("cost_ratio"), "verify_cost": self.cost.get("verify_cost", {}),
            "decoder_cost": self.cost.get("decoder_cost"),
            "prompt_roles": self.roles, "in_sample": self.roles.get("timed_split", "").startswith("dev"),
            "machine": machine_info(), "versions": versions(), "version": BenchResult.VERSION,
        }
        rungs = [Rung(d.name, d.step, d.predicted) for d in self.drafts if d.step is not None]
        if rungs:
            out["ladder"] = ladder(self.validation, rungs)
        versus = {d.name: {"versus": d.versus, "spread": self.validation.ratio_by_group(d.name, d.versus)}
                  for d in self.drafts if d.versus}
        if versus:
            out["versus"] = versus
        if self.agreement:
            out["agreement_on_test"] = self.agreement
        tps = self.validation.tok_per_s
        if "draft_before" in tps and "draft_after" in tps:
            out["speedup_after_vs_before"] = tps["draft_after"] / tps["draft_before"]
            out["after_vs_before"] = after_vs_before(self.validation)
        return out


def _folder_or_spec(spec: str) -> str:
    """A head's folder, any other draft's spec: how bench.json names the distilled draft."""
    d = DraftSpec.parse(spec)
    return str(d.folder) if d.is_head else spec


def prompts_hash(prompts: list[Prompt]) -> str:
    """sha256 of the prompts' ids and texts, in order: which prompts a number was timed on, checkable later."""
    return hashlib.sha256(json.dumps([[p.id, p.prompt] for p in prompts]).encode()).hexdigest()


def after_vs_before(val: Validation) -> dict:
    """tokens/s of draft_after over draft_before in each repeat (both timed in it), over all the prompts and over
    each domain's: {"all" | domain: {"median", "range", "repeats"}}."""
    return val.ratio_by_group("draft_after", "draft_before")


def _walks(d: DraftUnderTest, cfg: ValidateConfig) -> bool:
    """Whether a standalone chooser's policy comes from walking its rounds on references (else: alpha and the
    isolated cost)."""
    return (d.walk or d.refs is not None) and cfg.gate and not cfg.k


def _shape(cfg: ValidateConfig, standalone: bool, d: DraftUnderTest, t_run) -> tuple[int, int, int, list[int]]:
    """(siblings, sibling depth, rows of a two-level sibling tree, lookup counts) the chooser's walk considers."""
    siblings = cfg.siblings if cfg.gate and hasattr(t_run, "forward_tree") and cfg.siblings <= cfg.max_k else 0
    sibling_depth = 1 if standalone else cfg.sibling_depth  # children need a head's forward_siblings
    tree_k = 2 * siblings if siblings and sibling_depth == 2 else 0
    lookups = sorted(set(cfg.lookup)) if standalone and d.refs else [0]  # walked on the references' copy tables
    return siblings, sibling_depth, tree_k, lookups


def _target_shape(t_run, cfg: ValidateConfig, tree_k: int, lookups: list[int], device: str):
    """The target's v(K) shape outside the decoder, over every row count the walk may verify."""
    # 9 interleaved repeats (median): with 3, one stall on a busy machine set v(2..4) ~1.29 where they are ~1.01,
    # which ruled out sibling rounds that measured 1.41-1.43x
    return measure_cost(t_run, None, ks=range(1, max(cfg.max_k + max(lookups), tree_k) + 1), context=COST_CONTEXT,
                        repeats=9, warmup=2, device=device)


def _choose(d: DraftUnderTest, opened: Opened, t_run, ids: list[list[int]], cfg: ValidateConfig, eos: list[int],
            device: str, iso=None) -> tuple[PolicyChoice, dict]:
    """The chooser's policy and the cost it was chosen on, timed as this draft runs (`iso`: the target's v(K)
    shape from `_target_shape`, when a caller times it once for several drafts)."""
    k_max = cfg.max_k
    standalone = not getattr(opened.runner, "reads_target", False)
    if standalone and not _walks(d, cfg):  # a standalone step times alone
        cost = measure_cost(t_run, opened.runner, ks=range(1, k_max + 1), context=COST_CONTEXT, repeats=3,
                            warmup=1, device=device)
        taus = taus_from_alpha(d.alpha, k_max) if d.alpha is not None else None
        choice = choose_policy(cost, taus=taus, tokens=cfg.max_new_tokens, max_k=k_max, fixed_k=cfg.k,
                               evidence=f"alpha {d.alpha:.3f}" if d.alpha is not None else "")
        return choice, {"cost_ratio": cost.c, "verify_cost": {str(K): x for K, x in cost.v.items()}}
    if cfg.k:  # a head's step is only timed inside the decoder: with K set, nothing to time
        return choose_policy(None, fixed_k=cfg.k, max_k=k_max), {}
    siblings, sibling_depth, tree_k, lookups = _shape(cfg, standalone, d, t_run)
    iso = iso or _target_shape(t_run, cfg, tree_k, lookups, device)
    dc = calibrate_decoder(t_run, opened.runner, ids[:2], k=1, isolated=iso, max_new_tokens=32, eos_ids=eos,
                           device=device)
    timed = {"cost_ratio": dc.draft_step_s / dc.target_token_s,
             "verify_cost": {str(K): v / dc.target_token_s for K, v in dc.verify_s.items()},
             "decoder_cost": dc.to_dict()}
    if d.held or d.refs:
        records = (depth_records(opened.head, d.held, k_max, ranks=True) if d.held else
                   standalone_records(opened.runner, d.refs, k_max, vocab=t_run.vocab_size, ranks=True))
        copies = [copy_table(p, c, max(lookups)) for p, c in d.refs] if max(lookups) else None
        return choose_policy(dc, records=records, tokens=cfg.max_new_tokens, max_k=k_max, gate=cfg.gate,
                             siblings=siblings, sibling_depth=sibling_depth, lookups=lookups, copies=copies), timed
    taus = taus_from_rates(d.rates, k_max) if d.rates else None
    return choose_policy(dc, taus=taus, tokens=cfg.max_new_tokens, max_k=k_max,
                         evidence="the draft's held-out acceptance by depth and its round cost timed in the decoder"
                         ), timed


def _max_len(ids: list[list[int]], drafts: list[DraftUnderTest], cfg: ValidateConfig) -> int:
    tree_k = 2 * cfg.siblings if cfg.siblings and cfg.sibling_depth == 2 else 0
    most_k = max([cfg.k, cfg.max_k + max(cfg.lookup), tree_k] + [d.k or 0 for d in drafts])
    return max(max(len(i) for i in ids) + cfg.max_new_tokens, COST_CONTEXT) + most_k + 2


@torch.no_grad()  # scoped: grad mode is the caller's again afterwards
def validate(target_spec: str, drafts: list[DraftUnderTest], dev: list[Prompt], test: list[Prompt],
             cfg: ValidateConfig, *, out: Path, kind: str = "standalone", test_source: str = "test",
             device: str = "cpu") -> ValidationResult:
    """Time the target alone and every draft on the first `cfg.prompts_per_domain` `test` prompts of each domain
    (after its first `cfg.skip_per_domain`),
    `cfg.repeats` times interleaved; choose the round policy on `dev` prompts only (a head's calibration decode);
    write `out` (bench.json, with which prompts did what); refuse (after writing) a run that is not greedy-equal.
    Without test prompts the dev prompts are timed, and the result says the speedup is in-sample."""
    if sum(d.chooses for d in drafts) != 1:
        raise ValueError("exactly one draft chooses the round policy")
    if not dev:
        raise DraftsmithError("validate: no held-out (dev) prompts to choose the round policy on")
    target = load(target_spec, device=device)
    dev = first_per_domain(dev, cfg.prompts_per_domain)
    timed = first_per_domain(test, cfg.prompts_per_domain, cfg.skip_per_domain) if test else dev
    if not timed:
        raise DraftsmithError(f"validate: no test prompts left after skipping {cfg.skip_per_domain} a domain")
    ids = [prompt_ids(target.tokenizer, p.prompt) for p in timed]
    dev_ids = [prompt_ids(target.tokenizer, p.prompt) for p in dev]
    max_len = _max_len(ids + dev_ids, drafts, cfg)
    t_run = make_runner(target.model, max_len)
    opened = {d.name: open_draft(d.spec, target, max_len, cfg.draft_quant, device) for d in drafts}
    chooser = next(d for d in drafts if d.chooses)
    eos = eos_ids(target)
    if chooser.policy is not None:
        choice, cost = PolicyChoice(chooser.policy, None, "raced on the dev prompts (race/race.json)"), {}
    else:
        if _walks(chooser, cfg) and chooser.refs is None:
            refs = reference_continuations(target, dev, max_new_tokens=cfg.max_new_tokens)
            chooser.refs = [(list(r["prompt_ids"]), list(r["continuation_ids"])) for r in refs]
        choice, cost = _choose(chooser, opened[chooser.name], t_run, dev_ids, cfg, eos, device)
    policies = {d.name: (KPolicy.fixed(d.k) if d.k else d.policy if d.policy and not d.chooses
                         else choice.policy) for d in drafts}
    quants = {n: o.quant for n, o in opened.items()}
    val = validate_drafts(t_run, {n: o.runner for n, o in opened.items()}, ids, k=choice.k, policies=policies,
                          max_new_tokens=cfg.max_new_tokens, eos_ids=eos, names=[p.id for p in timed],
                          device=device, repeats=cfg.repeats, groups=[p.domain for p in timed])
    roles = {"chosen_on": [p.id for p in dev], "timed_on": [p.id for p in timed],
             "timed_split": test_source if test else "dev (no test prompts for this source: in-sample)",
             "timed_sha256": prompts_hash(timed)}
    del opened
    compared = {n for d in drafts if d.versus for n in (d.name, d.versus)}
    agreement = agreement_on(target, {d.name: d.spec for d in drafts if d.name in compared}, timed,
                             max_new_tokens=cfg.max_new_tokens, quant=cfg.draft_quant, device=device)
    result = ValidationResult(target_spec, drafts, val, policies, choice, quants, cost, kind, roles, agreement)
    atomic_write_json(out, result.to_dict())
    if not result.greedy_equal:
        raise DraftsmithError("validate: speculative output differs from the target's greedy output "
                              f"({val.greedy_equal}); see {out}")
    return result


@torch.no_grad()
def agreement_on(target: Loaded, specs: dict[str, str], prompts: list[Prompt], *, max_new_tokens: int,
                 quant: str | None = "int8", device: str = "cpu") -> dict[str, dict]:
    """Each named standalone draft's teacher-forced greedy agreement with the target (alpha) on the target's greedy
    answers to `prompts` (`max_new_tokens` each), overall and by domain, each draft run as the decoder runs it
    (its quantisation, adapter, kept ids). -> {name: {spec, alpha, alpha_by_domain, positions}} ({} for none)."""
    if not specs:
        return {}
    refs = reference_continuations(target, prompts, max_new_tokens=max_new_tokens, progress=False)
    max_len = max(len(p) + len(c) for p, c in zip(refs["prompt_ids"], refs["continuation_ids"])) + 2
    out = {}
    for name, spec in specs.items():
        d, _, runner = standalone_runner(spec, target, max_len, quant, device, what="agreement_on")
        a = greedy_agreement(target, d, runner, refs)
        out[name] = {"spec": spec, "alpha": a.alpha, "alpha_by_domain": a.alpha_by_domain, "positions": a.positions}
        del d, runner
    return out


def greedy_agreement(target: Loaded, d: Draft, runner, refs, *, batch_size: int = 4) -> Acceptance:
    """A standalone draft's teacher-forced greedy agreement with the target on reference rows `refs`, through
    `runner` (unpruned: a pruned draft's kept ids restrict what it proposes, as it decodes)."""
    return measure_acceptance(target, [d.loaded], refs, params=SamplingParams(0.0), batch_size=batch_size,
                              progress=False, kept=[None if d.kept is None else d.kept.proposes], runners=[runner])[0]


@torch.no_grad()
def race(target_spec: str, specs: list[str], dev: list[Prompt], cfg: ValidateConfig, *, out: Path,
         timed_per_domain: int = 2, reference: str | None = None, device: str = "cpu") -> dict:
    """Standalone drafts each at its own round policy, decoded side by side: how the race stage chooses.

    Each draft's policy is walked on its own rounds over the target's greedy answers to the first
    `cfg.prompts_per_domain` `dev` prompts of each domain, as the validate stage walks the one it serves (K, a
    stop threshold, sibling rounds, lookup tokens; the round cost timed in the decoder, the target's v(K) shape
    timed once for all); then the target alone and every draft at its policy decode the first `timed_per_domain`
    of them, `cfg.repeats` interleaved passes. Dev prompts only: this chooses. `reference` (one of `specs`, e.g.
    the stock draft): every draft's tokens/s over it, both at their walked policies (the same search: a fair
    baseline), is recorded per domain (median of the passes) with the worst domain's: `over_reference`,
    `worst_over_reference`. Writes `out` (race.json) and returns {"drafts": {spec: {policy, predicted_speedup,
    measured_speedup (median of the passes), measured_speedup_repeats, greedy_equal[, over_reference,
    worst_over_reference]}}, ...}; refuses a run that is not greedy-equal, after writing it."""
    if not specs:
        raise DraftsmithError("race: no drafts to race")
    if reference is not None and reference not in specs:
        raise DraftsmithError(f"race: the reference {reference!r} is not among the raced drafts")
    target = load(target_spec, device=device)
    dev = first_per_domain(dev, cfg.prompts_per_domain)
    timed = first_per_domain(dev, timed_per_domain)
    dev_ids = [prompt_ids(target.tokenizer, p.prompt) for p in dev]
    ids = [prompt_ids(target.tokenizer, p.prompt) for p in timed]
    max_len = _max_len(dev_ids, [], cfg)
    t_run = make_runner(target.model, max_len)
    eos = eos_ids(target)
    refs = [(list(r["prompt_ids"]), list(r["continuation_ids"]))
            for r in reference_continuations(target, dev, max_new_tokens=cfg.max_new_tokens)]
    names = {spec: f"draft{i}" for i, spec in enumerate(specs)}
    opened, choices, iso = {}, {}, None
    for spec, name in names.items():
        opened[name] = open_draft(spec, target, max_len, cfg.draft_quant, device)
        d = DraftUnderTest(name, spec, chooses=True, walk=True, refs=refs)
        if iso is None:
            iso = _target_shape(t_run, cfg, *_shape(cfg, True, d, t_run)[2:], device)
        choices[spec], _ = _choose(d, opened[name], t_run, dev_ids, cfg, eos, device, iso=iso)
    policies = {names[s]: c.policy for s, c in choices.items()}
    val = validate_drafts(t_run, {n: o.runner for n, o in opened.items()}, ids, k=max(p.k for p in policies.values()),
                          policies=policies, max_new_tokens=cfg.max_new_tokens, eos_ids=eos,
                          names=[p.id for p in timed], desc=f"race {len(specs)} drafts", device=device,
                          repeats=cfg.repeats, groups=[p.domain for p in timed])
    result = {
        "target": target_spec, "chosen_on": [p.id for p in dev], "timed_on": [p.id for p in timed],
        "drafts": {spec: {"policy": policies[n].to_dict(), "predicted_speedup": choices[spec].predicted,
                          "k_reason": choices[spec].reason,
                          "predicted_speedup_by_k": {str(K): x for K, x in choices[spec].curve.items()},
                          "predicted_speedup_gated": choices[spec].options,
                          "measured_speedup": val.speedup(n), "measured_speedup_repeats": val.repeat_speedups(n),
                          "quant": opened[n].quant, "greedy_equal": val.greedy_equal[n] is not False,
                          **(_over(val, n, names[reference]) if reference is not None else {})}
                   for spec, n in names.items()},
        **({"reference": {"draft": reference, "policy": "walked", "name": names[reference]}}
           if reference is not None else {}),
        "validation": val.to_dict(), "machine": machine_info(), "versions": versions(),
    }
    atomic_write_json(out, result)
    if not all(val.greedy_equal[n] is not False for n in opened):
        raise DraftsmithError(f"race: speculative output differs from the target's greedy output; see {out}")
    return result


def _over(val: Validation, name: str, reference: str) -> dict:
    """Draft `name`'s tokens/s over the race's `reference` decoder: over all prompts and per domain (`spread`:
    median of the passes, range, each pass), and the worst domain's median."""
    over = val.ratio_by_group(name, reference)
    domains = [s["median"] for g, s in over.items() if g != "all"]
    worst = min(domains) if domains else over["all"]["median"] if "all" in over else None
    return {"over_reference": over, "worst_over_reference": worst}


# --- the stage's result read back (validate/bench.json), and the run's verdict -----------------------------

RACED = ("race", "fastest")  # bench kinds whose drafts all had the same policy search (fastest: older records)
DECODERS = {"target_only": "target alone", "draft_before": "un-distilled draft", "draft_after": "distilled draft"}


@dataclass
class BenchResult(Record):
    """validate/bench.json read back (`ValidationResult.to_dict` writes it): the summary its readers use (each
    draft's speedup over the target alone, median and range of the repeats; K; the prompts), the context the
    report shows (labels, kind, policies, quantisation, measured cost, the ladder, prompt roles, the machine), and
    the full timing as `validation` where the record holds it (a summary in docs/results does not). Every key is
    optional: a summary written by hand reads too."""

    target: str | None = None
    kind: str | None = None  # standalone | head | race (fastest in older records)
    labels: dict[str, str] = field(default_factory=dict)  # how the report names each decoder (beside DECODERS)
    k: int | None = None
    ks: dict[str, int] = field(default_factory=dict)  # drafts timed at another K than `k`
    k_reason: str | None = None
    prompts: list[str] = field(default_factory=list)
    repeats: list[dict] = field(default_factory=list)
    speedup_vs_target_only: dict[str, float] = field(default_factory=dict)
    speedup_range: dict[str, list[float]] = field(default_factory=dict)
    tok_per_s: dict[str, float] = field(default_factory=dict)
    predicted_speedup: float | None = None
    policies: dict[str, dict] = field(default_factory=dict)  # each draft's KPolicy.to_dict()
    siblings: int | None = None  # the chooser's policy, flat (PolicyChoice)
    sibling_depth: int | None = None
    confidence: float | None = None
    lookup: int | None = None
    draft_quant: str | None = None
    head_quant: str | None = None
    quant_by_draft: dict[str, str | None] = field(default_factory=dict)
    cost_ratio: float | None = None
    after_vs_before: dict[str, dict] = field(default_factory=dict)  # `after_vs_before`: {"all" | domain: spread}
    ladder: dict | None = None  # pairing.ladder.ladder
    agreement_on_test: dict[str, dict] = field(default_factory=dict)  # `agreement_on`: {name: {alpha, by domain}}
    versus: dict[str, dict] = field(default_factory=dict)  # a draft over another, each repeat: {name: {"versus": other
    # decoder, "spread": {"all" | domain: spread}}} (a trained draft over its untrained self)
    prompt_roles: dict | None = None  # which prompts chose the policy, which were timed (absent in old records)
    in_sample: bool = False
    machine: dict = field(default_factory=dict)
    validation: Validation | None = field(default=None, compare=False, metadata={"key": False})

    @classmethod
    def from_dict(cls, d: Any, what: str = "") -> "BenchResult":
        obj = super().from_dict(d, what or "bench result")
        if "stats" in d:
            try:
                obj.validation = Validation.from_dict(d)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise DraftsmithError(f"{what or 'bench result'}: its timing does not read "
                                      f"({type(e).__name__}: {e})") from None
        return obj

    def to_dict(self) -> dict:
        """The record as read (its timing kept as written), or a new one's timing from `validation`."""
        timing = self.validation.to_dict() if self.validation is not None and "stats" not in self.extra else {}
        return {**super().to_dict(), **timing}

    @property
    def decoder_labels(self) -> dict[str, str]:
        return {**DECODERS, **self.labels}

    def label(self, name: str, default: str | None = None) -> str:
        """How the report names decoder `name`: its label, else `default`, else DECODERS' name, else `name`."""
        return self.labels.get(name, DECODERS.get(name, name) if default is None else default)

    def rungs(self) -> list["LadderRung"]:
        """The ladder's rungs (none without a ladder)."""
        return [LadderRung.from_dict(r, "bench result ladder") for r in (self.ladder or {}).get("rungs", [])]

    def speedup(self, name: str) -> float | None:
        """Draft `name`'s measured speedup over the target alone (None: not timed)."""
        return self.speedup_vs_target_only.get(name)

    def k_of(self, name: str) -> int | None:
        return self.ks.get(name, self.k)

    def policy_words(self, name: str) -> str:
        """How draft `name` ran: its K, and where its rounds stop early or branch (its policy)."""
        p = self.policies.get(name) or {"k": self.k_of(name)}
        words = f"K = {p['k']}"
        if p.get("siblings"):
            words += (f", its {p['siblings']} most probable first tokens side by side below probability "
                      f"{p['confidence']}" + (" (each with its next token)" if p.get("sibling_depth") == 2 else ""))
        elif p.get("confidence"):
            words += f", rounds stopping below probability {p['confidence']}"
        if p.get("lookup"):
            words += f", up to {p['lookup']} lookup tokens after each chain"
        return words

    def evidence(self, name: str) -> str:
        """Where draft `name`'s speedup was measured, in words: repeats, range, which prompts."""
        speed = self.speedup_vs_target_only[name]
        lo, hi = self.speedup_range.get(name, [speed, speed])
        return (f"median of {len(self.repeats) or 1} repeats, range {lo:.2f}x-{hi:.2f}x, on {len(self.prompts)} "
                + ("held-out dev prompts it was chosen on (in-sample)" if self.in_sample
                   else "test prompts never used to train or choose") + ", greedy-equal")

    def steps_between(self, a: str, b: str) -> list[str]:
        """The ladder's steps from rung `a` (exclusive) to rung `b` (inclusive); [] without both."""
        rungs = (self.ladder or {}).get("rungs", [])
        names = [r["name"] for r in rungs]
        if not {a, b} <= set(names):
            return []
        return [r["step"] for r in rungs[names.index(a) + 1:names.index(b) + 1]]


@dataclass
class LadderRung(Part):
    """One rung of bench.json's `ladder` (`pairing.ladder.ladder`): the decoder, what it changes over the rung
    above it in the table, its predicted speedup, and its spreads over the target alone and over that rung, by
    group ({"all" | domain: {median, range, repeats}})."""

    name: str
    step: str
    predicted: float | None = None
    over_target: dict[str, dict] = field(default_factory=dict)
    over_below: dict[str, dict] | None = None  # None for the first rung

    def spread(self, group: str, below: bool = False) -> dict | None:
        """Its spread in `group` over the target alone (over the rung before with `below`); None: not timed."""
        return ((self.over_below if below else self.over_target) or {}).get(group)


class EngineCheck(Protocol):
    """What the verdict reads of the export stage's result (distill.export.results.HeadExport / DraftExport)."""

    llama_cpp_prediction: dict | None
    serving: dict

    def measured_runs(self) -> list: ...  # llama-server runs with a speedup (speedup_vs_target_only, draft_max)


def verdict(bench: BenchResult | None, export: EngineCheck | None = None) -> tuple[str, bool] | None:
    """The run's answer, from the validate stage's result and the export stage's: which draft to serve, where,
    at which K, and its measured speedup with its range; or, in plain words, that none pays; and whether one
    pays. None before validate has measured a speedup."""
    if bench is None or not bench.speedup_vs_target_only:
        return None
    speed = bench.speedup_vs_target_only
    best = max(speed, key=lambda n: speed[n])
    where = bench.evidence(best)
    if speed[best] < 1.0:
        return (f"no draft beats the target alone here: best {speed[best]:.2f}x ({bench.label(best)}; {where})"
                " — don't serve one.", False)
    text = (f"serve the {bench.label(best)} with draftsmith's decoder at {bench.policy_words(best)}: "
            f"{speed[best]:.2f}x the target alone ({where}).")
    fair = bench.after_vs_before if bench.kind in RACED else {}
    if fair.get("all"):
        what = bench.steps_between("draft_before", "draft_after")
        text += (f" The race's pick ({bench.label('draft_after')}) over the {bench.label('draft_before')} (the same "
                 "policy search on the same dev prompts" + (f"; what differs: {', '.join(what)}" if what else "")
                 + "): " + "; ".join(f"{g} {v['median']:.2f}x ({v['range'][0]:.2f}-{v['range'][1]:.2f})"
                                     for g, v in fair.items()) + ".")
    for name, v in bench.versus.items():
        spread = v.get("spread") or {}
        if spread:
            text += (f" The {bench.label(name)} over the {bench.label(v['versus'])} (the same policy search, the same "
                     "quantisation; what differs: training): " + "; ".join(
                         f"{g} {s['median']:.2f}x ({s['range'][0]:.2f}-{s['range'][1]:.2f})" for g, s in spread.items())
                     + ".")
        a, b = bench.agreement_on_test.get(name), bench.agreement_on_test.get(v["versus"])
        if a and b:
            text += (" Teacher-forced alpha on the test answers, untrained -> trained: " + "; ".join(
                f"{g} {b['alpha_by_domain'][g]:.3f} -> {a['alpha_by_domain'][g]:.3f}" for g in a["alpha_by_domain"]
                if g in b["alpha_by_domain"]) + f"; all {b['alpha']:.3f} -> {a['alpha']:.3f}.")
    if export is None:
        return text, True
    runs = export.measured_runs()
    if export.llama_cpp_prediction:
        text += f" In llama.cpp (llama-server) {export.llama_cpp_prediction['verdict']}."
    elif runs:
        top = max(runs, key=lambda lc: lc.speedup_vs_target_only)
        x = top.speedup_vs_target_only
        text += (f" In llama.cpp (llama-server) it measured {x:.2f}x at K = {top.draft_max}"
                 + (": don't use it there on this machine." if x < 1 else "."))
    if export.serving:
        text += " vLLM / SGLang lines are in the export section (not measured here)."
    return text, True
