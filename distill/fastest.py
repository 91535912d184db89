"""The fastest standalone draft for a target: a whole model beside its int4 copy and vocabulary-pruned variants of
that (FR-Spec), ranked side by side on dev prompts (the recipe kind `fastest`: recipes/qwen-draft.yaml). The int4
copy (`int4:BASE`, `decode.runtime.quant`) reads 0.625 bytes a weight where the int8 draft reads 1; with `int4: false`, or
where this CPU has no int4 kernel, the pruned variants prune the whole model as it is.

    board = make_fastest(ctx_target, "qwen2.5-coder-0.5b-instruct", FastestConfig(sizes=[8192, 32768]), pair_cfg,
                         out=RUN / "distill", prompts="code,chat")
    board["winner"]   # e.g. "prune:qwen2.5-coder-0.5b-instruct:vocab=RUN/distill/vocab-8192.json"

1. The kept ids: the target's greedy continuations of dev prompts that the ranking does not use (each domain's
   prompts after the pair's own `prompts_per_domain`), generated with the base draft to go faster (exact: the
   target's own greedy text), counted (`distill.vocab.count_tokens`), one kept-ids file per size
   (`pairing.prune.build_vocab`; ties to the lower id, which in a BPE vocabulary is the earlier merge). With
   `calib` the same prompts with their answers are the int4 copy's calibration (out/calib.json):
   `int4:BASE:calib=FILE`, its weights rounded by GPTQ on the text the draft reads (`decode.runtime.quant.gptq_groups`).
2. The ranking: `pairing.leaderboard.run_pair` over the base and its pruned variants, with the recipe's pair
   settings (alpha teacher-forced, cost timed with one target clock for all, predicted speedups).
3. The race (`race` > 0): the top `race` of the ranking (the base always among them), each at the round policy
   the validate stage would walk for it on the dev prompts (K, a stop threshold, sibling rounds, lookup tokens: the
   same search for every draft), decoded side by side with the target alone on `race_prompts` dev prompts a domain
   in the validate stage's interleaved repeats (`pairing.validate.race`). What the recipe serves is the winner at
   its walked policy (validate serves that policy as raced), so that is what ranks.
4. The winner: among those raced, the best worst domain over the base at its own walked policy (`race_reference`:
   the fair baseline, both drafts searched the same way; the goal is per domain: a draft far ahead on chat can
   trail on code), or without the reference the highest measured speedup (else decoded by the pair, else the
   highest predicted); among those within `TIE` (2%) of the best, the highest alpha (a few dev prompts do not part
   two drafts that close, and the higher-alpha one loses less where rounds run long); its candidate spec goes to
   `RUN/draft.txt`, one line that `draftsmith pair --candidates` takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.decode.runtime.allocator import release_freed_memory
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, atomic_write_text, read_json
from draftsmith.decode.runtime.loading import Loaded, load
from draftsmith.decode.prompts import Prompt, first_per_domain, load_prompts
from draftsmith.decode.runtime.quant import int4_ok, write_calib
from draftsmith.decode.spec import DraftSpec
from draftsmith.distill.vocab import count_tokens
from draftsmith.pairing.leaderboard import PairConfig, run_pair
from draftsmith.pairing.prune import build_vocab, target_rows
from draftsmith.pairing.reference import reference_continuations
from draftsmith.pairing.validate import ValidateConfig, race


FASTEST = "fastest"  # distill.draft's value that ranks a model and its pruned variants instead of training


@dataclass
class FastestConfig:
    """A recipe's `fastest:` section."""

    base: str = "best"  # the whole model to prune: a model spec, or `best` (the pair stage's top whole model)
    sizes: list[int] = field(default_factory=lambda: [8192, 16384, 32768])  # kept ids per pruned variant
    prompts_per_domain: int = 8  # dev prompts a domain whose target continuations are counted (after the pair's)
    max_new_tokens: int = 96  # tokens of each counted continuation
    context_ids: bool = True  # the pruned drafts also propose the ids they have read (`decode.pruned`)
    int4: bool = True  # rank `int4:BASE` too, and prune that (where this CPU has draftsmith's int4 kernel)
    calib: bool = False  # the int4 weights rounded by GPTQ on the counted text (`int4:BASE:calib=RUN/distill/
    # calib.json`: each prompt with the target's answer, as the draft reads them), not to the nearest level (on the
    # Qwen 0.5B: +0.012 agreement on chat, none on code; docs/results/pruned.md)
    race: int = 4  # the top N of the ranking decoded side by side, each at its own walked policy (0: the pair's own
    # measured speedups choose, else its predictions)
    race_prompts: int = 2  # dev prompts a domain the race times (its policies are walked on the validate stage's)
    race_reference: bool = True  # the base races too (at its own walked policy, as every raced draft), and the
    # winner is the draft whose worst domain runs fastest over it (what validate measures), not the fastest overall

    def __post_init__(self) -> None:
        if not self.sizes or any(n < 1 for n in self.sizes):
            raise ValueError(f"sizes must list positive vocabulary sizes, got {self.sizes}")
        if self.prompts_per_domain < 1 or self.max_new_tokens < 1 or self.race_prompts < 1:
            raise ValueError("prompts_per_domain, max_new_tokens and race_prompts must be >= 1")
        if self.race < 0:
            raise ValueError(f"race must be >= 0 (0 = no race), got {self.race}")


def counting_prompts(prompts: str, skip: int, n: int, limit_per_domain: int | None = None) -> list[Prompt]:
    """Each domain's prompts [skip, skip + n) of `prompts` (capped at `limit_per_domain` a domain): dev prompts the
    ranking, which reads each domain's first `skip`, never sees."""
    every = load_prompts(prompts, limit_per_domain=limit_per_domain)
    ranked = {p.id for p in first_per_domain(every, skip)}
    chosen = [p for p in first_per_domain(every, skip + n) if p.id not in ranked]
    if not chosen:
        raise DraftsmithError(f"fastest: no prompts left to count after the first {skip} of each domain of "
                              f"{prompts!r}; lower pair.prompts_per_domain or give more prompts")
    return chosen


def build_vocabs(target: str, d: Loaded, prompts: list[Prompt], cfg: FastestConfig, out: Path, *,
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
        raise DraftsmithError("fastest: no candidate shares the target's tokenizer")
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


def make_fastest(target: str, base: str, cfg: FastestConfig, pair: PairConfig, *, out: Path, run: Path,
                 prompts: str, limit_per_domain: int | None = None, device: str = "cpu",
                 validate: ValidateConfig | None = None, dev: list[Prompt] | None = None) -> dict:
    """Count, prune, rank, race (see the module docstring); writes out/vocab-*.json, out/ranking/ (the
    leaderboard), out/race.json, out/fastest.json and run/draft.txt; returns fastest.json's content. The race
    (`cfg.race` > 0) walks each policy with `validate`'s settings on `dev` (the validate stage's dev prompts)."""
    done = read_json(out / "fastest.json", missing_ok=True, what="fastest result")
    if done:
        return done
    if pair.prompts_per_domain < 1:
        raise DraftsmithError("fastest: pair.prompts_per_domain must be >= 1 (the counted prompts are the ones after "
                              "the ranking's own; 0 would rank on all of them)")
    count_on = counting_prompts(prompts, pair.prompts_per_domain, cfg.prompts_per_domain, limit_per_domain)
    base_model = load(base, device=device)
    int4 = cfg.int4 and int4_ok(base_model.model)
    files, calib = build_vocabs(target, base_model, count_on, cfg, out, device=device, calib=int4 and cfg.calib)
    pruned = DraftSpec.int4(base, calib).text if int4 else base
    del base_model
    candidates = ([base] + ([pruned] if pruned != base else [])
                  + [DraftSpec.pruned(pruned, p).text for p in files.values()])
    board = run_pair(target, out / "ranking", dataclasses.replace(pair, candidates=candidates), prompts=prompts,
                     limit_per_domain=limit_per_domain, device=device)
    base_k = next(c["best_k"] for c in board["candidates"] if c["draft"] == base)
    if cfg.race and dev:
        release_freed_memory()  # the ranking's copies, before the race opens its own
        top = [c["draft"] for c in board["candidates"] if c["compatible"]][: cfg.race]
        reference = base if cfg.race_reference else None
        if reference and reference not in top:  # the stock draft always races: the baseline, at its walked policy
            top = [reference] + top[: cfg.race - 1]
        result = read_json(out / "race.json", missing_ok=True, what="race result")
        if result is None or not race_reusable(result, top, reference):
            result = race(target, top, dev, validate or ValidateConfig(), out=out / "race.json",
                          timed_per_domain=cfg.race_prompts, reference=reference, device=device)
        board = raced(board, result)
    best = winner(board)
    atomic_write_text(run / "draft.txt", best["draft"] + "\n")
    result = {"draft": best["draft"], "base": base, "base_k": base_k,
              "alpha": best["alpha"], "best_k": best["best_k"], "measured_speedup": best.get("measured_speedup"),
              "predicted_speedup": best["predicted_speedup"], "vocab_files": {str(n): str(p) for n, p in files.items()},
              "counted_prompts": [p.id for p in count_on],
              "ranking": [{k: c.get(k) for k in ("draft", "alpha", "best_k", "predicted_speedup", "measured_speedup",
                                                 "policy", "policy_predicted", "worst_over_reference",
                                                 "over_reference")}
                          for c in board["candidates"]],
              "chosen_by": ("race, worst domain over the base at its walked policy"
                            if best.get("worst_over_reference") is not None else
                            "race" if any(c.get("policy") for c in board["candidates"]) else "ranking")}
    atomic_write_json(out / "fastest.json", result)
    return result
