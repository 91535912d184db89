"""The race stage: which standalone draft to serve, and the rungs of its ladder. A whole model (the stock draft)
beside its int4 copy, vocabulary-pruned variants of that (FR-Spec) and the drafts the distill stage trained, ranked
and then raced side by side on dev prompts, each at the round policy walked for it (recipes/qwen-draft.yaml,
recipes/qwen-distill.yaml). The int4 copy (`int4:BASE`, `decode.runtime.quant`) reads 0.625 bytes a weight where
the int8 draft reads 1; with `int4: false`, or where this CPU has no int4 kernel, the pruned variants prune the
whole model as it is.

    made = run_race(target, "qwen2.5-coder-0.5b-instruct", RaceConfig(sizes=[32768]), pair_cfg,
                    out=RUN / "race", run=RUN, prompts="code,chat", validate=validate_cfg, dev=dev_prompts)
    made["draft"]   # e.g. "prune:int4:qwen2.5-coder-0.5b-instruct:vocab=RUN/race/vocab-32768.json"
    ladder_drafts(made, validate_cfg)   # the validate stage's rungs: stock plain K -> walked -> int4 -> ... -> trained

1. The kept ids (with `sizes`): the target's greedy continuations of dev prompts that the ranking does not use
   (each domain's prompts after the pair's own `prompts_per_domain`), generated with the base draft to go faster
   (exact: the target's own greedy text), counted (`pairing.prune.count_tokens`), one kept-ids file per size
   (`pairing.prune.build_vocab`; ties to the lower id, which in a BPE vocabulary is the earlier merge). With
   `calib` the same prompts with their answers are the int4 copy's calibration (out/calib.json):
   `int4:BASE:calib=FILE`, its weights rounded by GPTQ on the text the draft reads (`decode.runtime.quant.gptq_groups`).
2. The ranking: `pairing.leaderboard.run_pair` over the base, its int4 copy, its pruned variants and the trained
   drafts, with the recipe's pair settings (alpha teacher-forced, cost timed with one target clock for all,
   predicted speedups).
3. The race (`top` > 0): the top `top` of the ranking (the base and the trained drafts always among them), each at
   the round policy the validate stage would walk for it on the dev prompts (K, a stop threshold, sibling rounds,
   lookup tokens: the same search for every draft), decoded side by side with the target alone on `timed_prompts`
   dev prompts a domain in the validate stage's interleaved repeats (`pairing.validate.race`). What the recipe
   serves is the winner at its walked policy (validate serves that policy as raced), so that is what ranks.
4. The winner: among those raced, the best worst domain over the base at its own walked policy (`reference`: the
   fair baseline, both drafts searched the same way; the goal is per domain: a draft far ahead on chat can trail
   on code), or without the reference the highest measured speedup (else decoded by the pair, else the highest
   predicted); among those within `TIE` (2%) of the best, the highest alpha (a few dev prompts do not part two
   drafts that close, and the higher-alpha one loses less where rounds run long). `RUN/draft.txt` gets the
   winner's spec, one line `draftsmith pair --candidates` takes; where the distill stage trained a draft, the
   trained draft's spec and its untrained equivalent's instead, one a line, to put side by side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.decode.runtime.allocator import release_freed_memory
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.records import Part, Record
from draftsmith.decode.runtime.io import atomic_write_json, atomic_write_text, read_json
from draftsmith.decode.runtime.loading import Loaded, load
from draftsmith.decode.prompts import Prompt, first_per_domain, load_prompts
from draftsmith.decode.runtime.quant import int4_ok, write_calib
from draftsmith.decode.spec import DraftSpec
from draftsmith.decode.speculative import KPolicy
from draftsmith.pairing.leaderboard import PairConfig, run_pair
from draftsmith.pairing.prune import build_vocab, count_tokens, target_rows
from draftsmith.pairing.reference import reference_continuations
from draftsmith.pairing.validate import DraftUnderTest, ValidateConfig, race


@dataclass
class RaceConfig:
    """A recipe's `race:` section (the race stage)."""

    base: str = "best"  # the stock whole model: a model spec, or `best` (the pair stage's top whole model)
    sizes: list[int] = field(default_factory=list)  # kept ids per pruned variant ([]: no pruned variants)
    prompts_per_domain: int = 8  # dev prompts a domain whose target continuations are counted (after the pair's)
    max_new_tokens: int = 96  # tokens of each counted continuation
    context_ids: bool = True  # the pruned drafts also propose the ids they have read (`decode.pruned`)
    int4: bool = True  # rank `int4:BASE` too, and prune that (where this CPU has draftsmith's int4 kernel)
    calib: bool = False  # the int4 weights rounded by GPTQ on the counted text (`int4:BASE:calib=RUN/race/
    # calib.json`: each prompt with the target's answer, as the draft reads them), not to the nearest level (on the
    # Qwen 0.5B: +0.012 agreement on chat, none on code; docs/results/pruned.md)
    top: int = 4  # the top N of the ranking decoded side by side, each at its own walked policy (0: the pair's own
    # measured speedups choose, else its predictions); the base and the drafts the distill stage trained always race
    timed_prompts: int = 2  # dev prompts a domain the race times (its policies are walked on the validate stage's)
    reference: bool = True  # the base races too (at its own walked policy, as every raced draft), and the
    # winner is the draft whose worst domain runs fastest over it (what validate measures), not the fastest overall

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.sizes):
            raise ValueError(f"sizes must list positive vocabulary sizes, got {self.sizes}")
        if self.prompts_per_domain < 1 or self.max_new_tokens < 1 or self.timed_prompts < 1:
            raise ValueError("prompts_per_domain, max_new_tokens and timed_prompts must be >= 1")
        if self.top < 0:
            raise ValueError(f"top must be >= 0 (0 = no race), got {self.top}")


def counting_prompts(prompts: str, skip: int, n: int, limit_per_domain: int | None = None) -> list[Prompt]:
    """Each domain's prompts [skip, skip + n) of `prompts` (capped at `limit_per_domain` a domain): dev prompts the
    ranking, which reads each domain's first `skip`, never sees."""
    every = load_prompts(prompts, limit_per_domain=limit_per_domain)
    ranked = {p.id for p in first_per_domain(every, skip)}
    chosen = [p for p in first_per_domain(every, skip + n) if p.id not in ranked]
    if not chosen:
        raise DraftsmithError(f"race: no prompts left to count after the first {skip} of each domain of "
                              f"{prompts!r}; lower pair.prompts_per_domain or give more prompts")
    return chosen


def build_vocabs(target: str, d: Loaded, prompts: list[Prompt], cfg: RaceConfig, out: Path, *,
                 device: str = "cpu", calib: bool = False) -> tuple[dict[int, Path], Path | None]:
    """One kept-ids file per size in `out` (vocab-N.json), counted on the target's greedy continuations of
    `prompts` (generated with `d`, the loaded base, as the draft: the same text, faster); with `calib`, those
    prompts with their continuations as a calibration file too (out/calib.json, `decode.runtime.quant.write_calib`).
    -> (the files by size, the calibration file or None)."""
    t = load(target, device=device)
    refs = reference_continuations(t, prompts, max_new_tokens=cfg.max_new_tokens, draft=d)
    counts = count_tokens([list(c) for c in refs["continuation_ids"]], target_rows(t))
    calib_path = None
    if calib:
        calib_path = write_calib(out / "calib.json", [list(p) + list(c) for p, c in
                                                      zip(refs["prompt_ids"], refs["continuation_ids"])],
                                 note=f"{target}'s greedy answers to {len(prompts)} dev prompts, with the prompts")
    source = {"target": target, "prompts": [p.id for p in prompts], "max_new_tokens": cfg.max_new_tokens,
              "temperature": 0.0, "tokens": int(counts.sum())}
    files = {}
    for n in sorted(set(cfg.sizes)):
        files[n] = out / f"vocab-{n}.json"
        build_vocab(counts, files[n], coverage=None, size=min(n, len(counts)), source=source,
                    context_ids=cfg.context_ids)
    return files, calib_path


TIE = 0.02  # measured speedups this close to the best are a tie on a few dev prompts: alpha decides


def winner(board: dict, *, tie: float = TIE) -> dict:
    """The leaderboard row to serve: among the candidates decoded, the highest alpha of those whose score is within
    `tie` of the highest (then the higher score); with none decoded, the highest predicted speedup. The score is a
    raced row's `worst_over_reference` where the race had a reference, else the measured speedup."""
    rows = [c for c in board["candidates"] if c["compatible"]]
    if not rows:
        raise DraftsmithError("race: no candidate shares the target's tokenizer")
    measured = [c for c in rows if c.get("measured_speedup") is not None]
    if measured:
        by_worst = all(c.get("worst_over_reference") is not None for c in measured)
        score = {c["draft"]: c["worst_over_reference"] if by_worst else c["measured_speedup"] for c in measured}
        best = max(score.values())
        close = [c for c in measured if score[c["draft"]] >= (1 - tie) * best]
        return max(close, key=lambda c: (c["alpha"], score[c["draft"]]))
    return max(rows, key=lambda c: c["predicted_speedup"])


def raced(board: dict, result: dict) -> dict:
    """The leaderboard with each raced candidate's measured speedup, policy and (where the race had a reference)
    worst domain's speedup over it from `race`'s result, every other candidate's cleared: `winner` then chooses
    among the raced."""
    by = result["drafts"]
    keys = ("measured_speedup", "policy", "worst_over_reference", "over_reference")
    rows = [{**c, **{k: by[c["draft"]].get(k) if c["draft"] in by else None for k in keys},
             "policy_predicted": by[c["draft"]].get("predicted_speedup") if c["draft"] in by else None}
            for c in board["candidates"]]
    return {**board, "candidates": rows}


def race_reusable(result: dict, drafts: list[str], reference: str | None) -> bool:
    """Whether a race.json already written raced these drafts against this reference at its walked policy (a
    race.json from before the fair reference, the base at a fixed K with no "policy", is raced again)."""
    had = result.get("reference") or {}
    return (sorted(result["drafts"]) == sorted(drafts)
            and (had.get("draft"), had.get("policy")) == ((reference, "walked") if reference else (None, None)))


PICK = "pick.json"  # in the race stage's folder: the ranking, the race's numbers and the pick


def run_race(target: str, base: str, cfg: RaceConfig, pair: PairConfig, *, out: Path, run: Path,
             prompts: str, limit_per_domain: int | None = None, device: str = "cpu",
             validate: ValidateConfig | None = None, dev: list[Prompt] | None = None,
             trained: dict[str, str] | None = None) -> dict:
    """Count, prune, rank, race (see the module docstring); writes out/vocab-*.json, out/ranking/ (the
    leaderboard), out/race.json, out/pick.json and run/draft.txt; returns pick.json's content. The race
    (`cfg.top` > 0) walks each policy with `validate`'s settings on `dev` (the validate stage's dev prompts).
    `trained`: {trained draft spec: its untrained equivalent's spec}, from the distill stage: ranked and raced
    beside the rest (the untrained equivalent is ranked too)."""
    done = read_json(out / PICK, missing_ok=True, what="race result")
    if done:
        return done
    trained = dict(trained or {})
    pairs = list(dict.fromkeys(s for pair_ in trained.items() for s in pair_))  # each trained draft, its untrained
    if pair.prompts_per_domain < 1:
        raise DraftsmithError("race: pair.prompts_per_domain must be >= 1 (the counted prompts are the ones after "
                              "the ranking's own; 0 would rank on all of them)")
    base_model = load(base, device=device)
    int4 = cfg.int4 and int4_ok(base_model.model)
    files, calib, count_on = {}, None, []
    if cfg.sizes or (int4 and cfg.calib):
        count_on = counting_prompts(prompts, pair.prompts_per_domain, cfg.prompts_per_domain, limit_per_domain)
        files, calib = build_vocabs(target, base_model, count_on, cfg, out, device=device, calib=int4 and cfg.calib)
    pruned = DraftSpec.int4(base, calib).text if int4 else base
    del base_model
    candidates = ([base] + ([pruned] if pruned != base else [])
                  + [DraftSpec.pruned(pruned, p).text for p in files.values()])
    candidates += [s for s in pairs if s not in candidates]
    board = run_pair(target, out / "ranking", dataclasses.replace(pair, candidates=candidates), prompts=prompts,
                     limit_per_domain=limit_per_domain, device=device)
    base_k = next(c["best_k"] for c in board["candidates"] if c["draft"] == base)
    if cfg.top and dev:
        release_freed_memory()  # the ranking's copies, before the race opens its own
        top = [c["draft"] for c in board["candidates"] if c["compatible"]][: cfg.top]
        reference = base if cfg.reference else None
        always = list(dict.fromkeys(([reference] if reference else []) + pairs))
        top = always + [s for s in top if s not in always][: max(cfg.top - len(always), 0)]
        result = read_json(out / "race.json", missing_ok=True, what="race result")
        if result is None or not race_reusable(result, top, reference):
            result = race(target, top, dev, validate or ValidateConfig(), out=out / "race.json",
                          timed_per_domain=cfg.timed_prompts, reference=reference, device=device)
        board = raced(board, result)
    best = winner(board)
    lines = pairs[:2] if trained else [best["draft"]]
    atomic_write_text(run / "draft.txt", "\n".join(lines) + "\n")
    result = {"draft": best["draft"], "base": base, "base_k": base_k, "int4": pruned if pruned != base else None,
              "trained": trained, "alpha": best["alpha"], "best_k": best["best_k"],
              "measured_speedup": best.get("measured_speedup"), "predicted_speedup": best["predicted_speedup"],
              "vocab_files": {str(n): str(p) for n, p in files.items()},
              "counted_prompts": [p.id for p in count_on],
              "ranking": [{k: c.get(k) for k in RankedDraft.keys()} for c in board["candidates"]],
              "chosen_by": ("race, worst domain over the base at its walked policy"
                            if best.get("worst_over_reference") is not None else
                            "race" if any(c.get("policy") for c in board["candidates"]) else "ranking")}
    atomic_write_json(out / PICK, result)
    return result


def ladder_drafts(made: dict, validate: ValidateConfig | None = None) -> list[DraftUnderTest]:
    """The validate stage's rungs from a race result (pick.json; an older distill/fastest.json reads too): the stock
    draft as loaded at its ranking's plain K, then at its walked policy, then its int4 copy, then the best raced
    pruned variant, then the trained draft, each at the policy the race walked for it on the dev prompts (the same
    search for all). The pick is `draft_after`, the stock at its walked policy `draft_before`: the fair baseline
    (the same policy search; what differs is int4 weights, pruning, training). A trained draft is compared with its
    untrained equivalent too (`DraftUnderTest.versus`)."""
    ranked = {row["draft"]: row for row in made["ranking"]}
    base, pick, k = made["base"], made["draft"], made["base_k"]
    if not ranked[base].get("policy"):
        raise DraftsmithError("validate: the stock draft has no raced policy in the race result (an older run?); "
                              "rerun with --restart race")
    names: dict[str, str] = {}

    def rung(spec: str, name: str, step: str, label: str) -> DraftUnderTest:
        row = ranked[spec]
        names[spec] = "draft_after" if spec == pick and spec != base else name
        return DraftUnderTest(names[spec], spec, label=label, alpha=row["alpha"], chooses=spec == pick, walk=True,
                              policy=KPolicy.from_dict(row["policy"]), step=step,
                              predicted=row.get("policy_predicted"))

    stock = base.rsplit("/", 1)[-1]
    q = validate.draft_quant if validate else "int8"
    rungs = [DraftUnderTest("stock_plain", base, label=f"stock {stock} ({q or 'float32'}), plain K = {k}", k=k,
                            alpha=ranked[base]["alpha"], step=f"stock {stock} as loaded, plain K = {k}",
                            predicted=ranked[base].get("predicted_speedup")),
             rung(base, "draft_before", "its walked policy", f"stock {stock} at its walked policy")]
    trained = made.get("trained") or {}
    specs = {s: DraftSpec.parse(s) for s in ranked}
    size = {s: n for s in ranked for n, path in made["vocab_files"].items() if specs[s].vocab == Path(path)}
    int4 = [s for s in ranked if specs[s].kind == "int4" and ranked[s].get("policy") and s not in trained]
    for s in int4[:1]:
        rungs.append(rung(s, "int4", "int4 weights", f"int4 {stock}"))
    pruned = sorted((s for s in size if ranked[s].get("policy") and s not in trained), key=lambda s: (s != pick, -(
        ranked[s].get("worst_over_reference") or ranked[s].get("measured_speedup") or 0)))
    for s in pruned[:1]:
        four = "int4 " if specs[s].quant == "int4" else ""
        rungs.append(rung(s, "pruned", f"vocabulary pruned to {size[s]} ids", f"{four}{stock} pruned to {size[s]} ids"))
    for i, (s, untrained) in enumerate(trained.items()):
        if not ranked.get(s, {}).get("policy"):
            continue
        was = next((d.label for d in rungs if d.spec == untrained), untrained)
        d = rung(s, "trained" if i == 0 else f"trained{i}", "trained (distilled toward the target)",
                 f"{was}, trained")
        d.versus = names.get(untrained)
        rungs.append(d)
    if pick != base and not any(d.name == "draft_after" for d in rungs):
        raise DraftsmithError(f"validate: the pick {pick} is neither the int4 copy, a pruned variant nor a trained "
                              "draft")
    return rungs


@dataclass
class RankedDraft(Part):
    """One row of pick.json's `ranking`: a candidate with its alpha, best K, predicted and measured speedup,
    and (raced) its policy and its worst domain over the base at the base's walked policy."""

    draft: str
    alpha: float | None = None
    best_k: int | None = None
    predicted_speedup: float | None = None
    measured_speedup: float | None = None
    policy: dict | None = None
    policy_predicted: float | None = None
    worst_over_reference: float | None = None
    over_reference: dict | None = None


@dataclass
class RaceResult(Record):
    """race/pick.json (an older run's distill/fastest.json reads too): the draft to serve among a whole model, its
    int4 copy, its vocabulary-pruned variants and the trained drafts, with the ranking it won and how it was
    chosen."""

    NESTED = {"ranking": ("list", RankedDraft)}

    draft: str
    ranking: list[RankedDraft]
    base: str | None = None
    base_k: int | None = None
    alpha: float | None = None
    best_k: int | None = None
    measured_speedup: float | None = None
    predicted_speedup: float | None = None
    vocab_files: dict[str, str] = field(default_factory=dict)
    counted_prompts: list[str] = field(default_factory=list)
    chosen_by: str = "ranking"
    int4: str | None = None  # the int4 copy's spec (None: not ranked)
    trained: dict[str, str] = field(default_factory=dict)  # trained draft spec -> its untrained equivalent's
