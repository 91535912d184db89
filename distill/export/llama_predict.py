"""llama-server's speedup with a draft, predicted from llama.cpp's own costs before it is served, beside what it
measures, and the acceptance each engine sees for the same draft at the same K.

    cost = calibrate(target_gguf, draft_gguf, calibration_prompts, ks)         # llama-bench + a short server run
    rows = curve(cost, taus, measured, parity)                                 # K -> predicted, measured, ...

A round of llama-server with a draft (one thread, greedy, `--spec-type draft-simple` or `draft-eagle3`) costs

    round_s(K) = K * draft_step_s + verify_s(K) + rest_s

`verify_s(K)` is llama-bench's forward of the target over K + 1 tokens at `depth` tokens of context;
`draft_step_s` is llama-bench's generated token of a standalone draft (an EAGLE-3 head cannot be benched alone:
it is fitted, with `rest_s`, from calibration runs at two K); `rest_s` is what the server does besides those
forwards in a round (sampling, the draft re-reading the accepted tokens, checkpoints, the HTTP slot loop), fitted
from short llama-server runs with the draft on calibration prompts that are never the ones measured. With the
target alone the server spends `target_token_s` a token (its own run on the calibration prompts). A round emits
tau tokens: the accepted drafts and the target's own token (llama.cpp stops a round at the first rejection, as
our decoder does), tau(K) from our acceptance by depth (`pairing.acceptance.Acceptance.tokens_per_round`). So

    predicted speedup(K) = tau(K) * target_token_s / round_s(K).

Rounds of a server run: each prompt's first token comes from its prompt pass, every round adds its accepted
drafts + 1, so rounds = generated - accepted - prompts; `predicted_ms` (the server's generation time) covers them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# |llama.cpp's accepted/drafted - ours| above this (absolute) is flagged: the export may have changed the draft
PARITY_GAP = 0.10
CALIBRATION_KS = (1, 3)


@dataclass
class EngineCost:
    """Seconds of each part of llama-server's work, from llama.cpp's own measurements (see the module docstring)."""

    target_token_s: float  # llama-server, the target alone: one generated token
    verify_s: dict[int, float]  # llama-bench: the target's forward over K + 1 tokens
    draft_step_s: float  # llama-bench's draft token (standalone) or fitted (head)
    rest_s: float  # the rest of a round in llama-server, fitted
    sources: dict[str, str] = field(default_factory=dict)
    calibration: list[dict[str, Any]] = field(default_factory=list)  # the server runs the fit read

    def round_s(self, K: int) -> float:
        if K not in self.verify_s:
            raise ValueError(f"no verify time for K={K} (have {sorted(self.verify_s)})")
        return K * self.draft_step_s + self.verify_s[K] + self.rest_s

    def speedup(self, tau: float, K: int) -> float:
        """tau tokens a round at K, over one token per `target_token_s`."""
        if not 1.0 <= tau <= K + 1 + 1e-9:
            raise ValueError(f"tokens per round must lie in [1, K+1] = [1, {K + 1}], got {tau}")
        return tau * self.target_token_s / self.round_s(K)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verify_s"] = {str(k): v for k, v in sorted(self.verify_s.items())}
        d["round_s"] = {str(k): self.round_s(k) for k in sorted(self.verify_s)}
        return d


def rounds_of(generated: int, accepted: int, prompts: int) -> int:
    """Rounds of a server run: each prompt's first token comes from its prompt pass, each round adds its accepted
    drafts and one token of the target's."""
    if min(generated, accepted, prompts) < 0:
        raise ValueError("counts must be >= 0")
    return max(generated - accepted - prompts, 1)


def seconds_per_round(run: dict[str, Any]) -> float:
    """A server run's generation time over its rounds (`check_with_llama_cpp`'s result)."""
    return run["predicted_ms"] / 1000.0 / rounds_of(run["predicted_n"], run["accepted"], run["prompts"])


def seconds_per_token(run: dict[str, Any]) -> float:
    """The target alone: generation time over the tokens after each prompt's first."""
    return run["predicted_ms"] / 1000.0 / max(run["predicted_n"] - run["prompts"], 1)


def fit_rest(points: list[tuple[int, float]], verify_s: dict[int, float],
             draft_step_s: float | None) -> tuple[float, float]:
    """(draft_step_s, rest_s) from calibration points (K, seconds a round): y = round - verify(K) = b K + a.
    With `draft_step_s` known (llama-bench's, a standalone draft) a is the mean of y - b K; else a least-squares
    line over at least two distinct K, each of a and b kept >= 0 (a clamped one refits the other)."""
    if not points:
        raise ValueError("no calibration points")
    ys = [(k, s - verify_s[k]) for k, s in points]
    if draft_step_s is not None:
        return draft_step_s, max(sum(y - draft_step_s * k for k, y in ys) / len(ys), 0.0)
    if len({k for k, _ in ys}) < 2:
        raise ValueError("fitting the draft step needs calibration runs at two K or more")
    n, sk, sy = len(ys), sum(k for k, _ in ys), sum(y for _, y in ys)
    skk, sky = sum(k * k for k, _ in ys), sum(k * y for k, y in ys)
    b = (n * sky - sk * sy) / (n * skk - sk * sk)
    a = (sy - b * sk) / n
    if b < 0:
        return 0.0, max(sy / n, 0.0)
    if a < 0:
        return max(sky / skk, 0.0), 0.0
    return b, a


def parity_row(K: int, llama: tuple[int, int], ours: tuple[int, int] | None,
               expected: float | None) -> dict[str, Any]:
    """Accepted / drafted at K in llama-server and in our decoder, beside the `expected` one from acceptance by
    depth (`pairing.depth.expected_round_counts`); `flagged` when llama.cpp's is more than PARITY_GAP from ours
    (or from the expected one)."""
    acc = lambda pair: pair[0] / pair[1] if pair and pair[1] else None  # noqa: E731
    row = {"k": K, "llama_cpp": acc(llama), "llama_cpp_counts": list(llama), "decoder": acc(ours),
           "decoder_counts": list(ours) if ours else None,
           "expected": expected}
    ref = row["decoder"] if row["decoder"] is not None else row["expected"]
    row["gap"] = row["llama_cpp"] - ref if row["llama_cpp"] is not None and ref is not None else None
    row["flagged"] = row["gap"] is not None and abs(row["gap"]) > PARITY_GAP
    return row


def curve(cost: EngineCost, taus: dict[int, float], measured: dict[int, float | None]) -> list[dict[str, Any]]:
    """K -> predicted and measured speedup over the target alone, and the relative error of the prediction."""
    rows = []
    for K in sorted(taus):
        pred, meas = cost.speedup(taus[K], K), measured.get(K)
        rows.append({"k": K, "tau": taus[K], "round_s": cost.round_s(K), "predicted": pred, "measured": meas,
                     "error": (pred - meas) / meas if meas else None})
    return rows


def best(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    ok = [r for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    return max(ok, key=lambda r: r[key]) if ok else None


def verdict(rows: list[dict[str, Any]]) -> str:
    """One line: the K llama.cpp should use on this machine, or not to use a draft there, decided by the
    prediction; the measurement beside it, when there is one."""
    p, m = best(rows, "predicted"), best(rows, "measured")
    if p is None:
        return "no prediction"
    text = f"predicted best {p['predicted']:.2f}x at K = {p['k']}"
    if m is not None:
        text += f"; measured best {m['measured']:.2f}x at K = {m['k']} (predicted there {m['predicted']:.2f}x)"
    return text + (": don't use a draft in llama.cpp on this machine" if p["predicted"] < 1.0
                   else f": serve it in llama.cpp at K = {p['k']}")


# -- measuring (llama.cpp built: distill.export.llama_cpp) ------------------------------------------------------


def calibrate(target_gguf: Any, draft_gguf: Any, prompts: list[list[int]], ks: list[int], *,
              spec_type: str = "draft-simple", threads: int = 1, n_predict: int = 32, depth: int = 64,
              server: Any = None, say: Any = None) -> EngineCost:
    """llama.cpp's costs on this machine: llama-bench for the target's K+1-token forwards (and a standalone
    draft's token), then llama-server on `prompts` (calibration prompts, never the measured ones) with the target
    alone and with the draft at each K of CALIBRATION_KS, to fit the rest of a round."""
    from draftsmith.distill.export.llama_cpp import check_with_llama_cpp, find_llama_server, llama_bench

    say = say or (lambda message: None)
    server = server or find_llama_server()
    sizes = sorted({k + 1 for k in [*ks, *CALIBRATION_KS]})
    say(f"llama-bench: the target's forward over {sizes} tokens at {depth} tokens of context")
    bench = llama_bench(target_gguf, prompt_sizes=sizes, depth=depth, threads=threads, server=server)
    verify = {n - 1: bench[n] for n in sizes}
    step, sources = None, {"verify_s": f"llama-bench, pp over K+1 tokens at depth {depth}, -t {threads}",
                           "target_token_s": "llama-server, the target alone on the calibration prompts",
                           "rest_s": f"llama-server with the draft at K = {list(CALIBRATION_KS)}, fitted"}
    if spec_type == "draft-simple":
        say("llama-bench: the draft's generated token")
        step = llama_bench(draft_gguf, depth=depth, threads=threads, server=server)[1]
        sources["draft_step_s"] = f"llama-bench, tg at depth {depth}, -t {threads}"
    else:
        sources["draft_step_s"] = "fitted with rest_s (a head cannot be benched alone)"
    say("llama-server calibration: the target alone")
    alone = check_with_llama_cpp(target_gguf, None, prompts, n_predict, threads=threads, server=server)
    runs = []
    for k in CALIBRATION_KS:
        say(f"llama-server calibration: the draft at K = {k}")
        runs.append(check_with_llama_cpp(target_gguf, draft_gguf, prompts, n_predict, k, threads=threads,
                                         server=server, spec_type=spec_type))
    step, rest = fit_rest([(k, seconds_per_round(r)) for k, r in zip(CALIBRATION_KS, runs)], verify, step)
    keep = ("draft_max", "prompts", "predicted_n", "predicted_ms", "drafted", "accepted")
    calibration = [{"target_alone": True, **{k: alone[k] for k in keep if k != "draft_max"}}]
    calibration += [{k: r[k] for k in keep} | {"seconds_per_round": seconds_per_round(r)} for r in runs]
    return EngineCost(target_token_s=seconds_per_token(alone), verify_s=verify, draft_step_s=step, rest_s=rest,
                      sources=sources, calibration=calibration)


def check(target_gguf: Any, draft_gguf: Any, prompts: list[list[int]], calibration_prompts: list[list[int]],
          taus: dict[int, float], decoder: dict[int, tuple[int, int]] | None = None,
          expected: dict[int, float] | None = None, *,
          spec_type: str = "draft-simple", n_predict: int = 64, say: Any = None) -> dict[str, Any]:
    """Predict llama-server's speedup at every K of `taus` (K -> tokens a round, from our acceptance by depth on
    `prompts`) from llama.cpp's costs, then serve the draft at each K between two runs of the target alone and
    put predicted beside measured, and accepted / drafted beside our decoder's (`decoder`: K -> (accepted,
    drafted)) and the `expected` one (K -> fraction). One thread throughout, as `check_with_llama_cpp` serves.
    Returns export.json's `llama_cpp_prediction`."""
    from draftsmith.distill.export.llama_cpp import beside_target_alone, find_llama_server, server_version

    server = find_llama_server()
    ks = sorted(taus)
    cost = calibrate(target_gguf, draft_gguf, calibration_prompts, ks, spec_type=spec_type, threads=1,
                     server=server, say=say)
    drafts = {str(k): {"draft_gguf": draft_gguf, "draft_max": k, "spec_type": spec_type} for k in ks}
    runs, baseline = beside_target_alone(target_gguf, drafts, prompts, n_predict, server=server, say=say)
    rows = curve(cost, taus, {k: runs[str(k)]["speedup_vs_target_only"] for k in ks})
    parity = [parity_row(k, (runs[str(k)]["accepted"], runs[str(k)]["drafted"]), (decoder or {}).get(k),
                         (expected or {}).get(k)) for k in ks]
    for k in ks:
        runs[str(k)].pop("contents", None)
    return {"target_gguf": str(target_gguf), "draft_gguf": str(draft_gguf), "spec_type": spec_type,
            "threads": 1, "prompts": len(prompts), "calibration_prompts": len(calibration_prompts),
            "n_predict": n_predict, "cost": cost.to_dict(), "curve": rows, "parity": parity,
            "parity_flagged": [r["k"] for r in parity if r["flagged"]], "verdict": verdict(rows),
            "runs": runs, "target_alone": {k: v for k, v in baseline.items() if k != "contents"},
            "server_version": server_version(server)}


def ours(target: Any, draft: Any, prompts: list[Any], ks: list[int], *, n_predict: int = 64,
         progress: bool = True) -> dict[str, Any]:
    """Our side for the same prompts: tau(K) from acceptance by depth, teacher-forced on the target's greedy
    continuations (`draft`: a Loaded standalone draft or an Eagle3Head), the accepted / drafted those rows imply
    when walked as the decoder walks them, and accepted / drafted in our decoder at each K (greedy; its text
    checked against the continuation). Returns {"taus", "expected", "decoder", "greedy_equal", "prompt_ids"}."""
    import torch

    from draftsmith.decode.head import Eagle3Head, HeadDraft
    from draftsmith.decode.runtime.loading import eos_ids
    from draftsmith.decode.runtime.runner import make_runner
    from draftsmith.decode.speculative import KPolicy, generate
    from draftsmith.pairing.acceptance import measure_acceptance, measure_head_acceptance
    from draftsmith.pairing.depth import expected_round_counts
    from draftsmith.pairing.reference import reference_continuations

    refs = reference_continuations(target, prompts, max_new_tokens=n_predict, progress=progress)
    head = isinstance(draft, Eagle3Head)
    acc = (measure_head_acceptance(target, draft, refs, "head", progress=progress) if head
           else measure_acceptance(target, [draft], refs, progress=progress)[0])
    taus = {k: acc.tokens_per_round(k) for k in ks}
    mats = acc.accept_rows()
    expected = {}
    for k in ks:
        counts = [expected_round_counts(m, k, budget=acc.budget) for m in mats]
        expected[k] = sum(c[2] for c in counts) / max(sum(c[1] for c in counts), 1e-12)
    rows = [(list(r["prompt_ids"]), list(r["continuation_ids"])) for r in refs]
    max_len = max(len(p) for p, _ in rows) + n_predict + max(ks) + 8  # the decoder checks its whole budget
    eos = eos_ids(target)
    counts, equal = {}, 0
    with torch.inference_mode():
        t_run = make_runner(target.model, max_len)
        d_run = HeadDraft(draft, max_len) if head else make_runner(draft.model, max_len)
        for k in ks:
            a = d = 0
            for ids, cont in rows:
                r = generate(t_run, ids, draft=d_run, max_new_tokens=n_predict, policy=KPolicy(k=k), eos_ids=eos)
                a, d, equal = a + r.stats.accepted, d + r.stats.drafted, equal + (r.tokens == cont)
            counts[k] = (a, d)
    return {"taus": taus, "expected": expected, "decoder": counts,
            "greedy_equal": {"decodes": len(rows) * len(ks), "equal": equal}, "prompt_ids": [p for p, _ in rows]}


__all__ = ["CALIBRATION_KS", "EngineCost", "PARITY_GAP", "best", "calibrate", "check", "curve", "fit_rest", "ours",
           "parity_row", "rounds_of",
           "seconds_per_round", "seconds_per_token", "verdict"]
