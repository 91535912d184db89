"""Choose a draft's round policy: K, the probability below which a round stops early, and sibling rounds.

    from draftsmith.pairing.policy import choose_policy, taus_from_alpha
    choice = choose_policy(cost, taus=taus_from_alpha(0.7, 8), tokens=64)     # cost: CostModel or DecoderCost
    choice.policy            # a decode.speculative.KPolicy, carried as is to the decoder
    choice.predicted         # its predicted speedup over the target alone

This is the one place K is chosen: pair (the leaderboard's best K), validate (the K it times) and export (the K
in the serving lines) all read a `PolicyChoice` made here. Two kinds of evidence predict a round's yield:
- `taus`: K -> expected tokens per round of fixed-K rounds (from a teacher-forced alpha, acceptance by depth, or
  rows walked as the decoder walks them), over the round cost (isolated c and v(K), or the decoder's calibration);
- `records`: a head's teacher-forced rounds on held-out references (`pairing.head_rounds.depth_records`), walked
  as the decoder walks them (`pairing.depth.round_walk`) for every K, stop threshold and sibling setting, over the
  round cost timed in the decoder. At temperature 0 the walk is the decoder's own count on those rows.
The best predicted setting wins; ties go to the smaller K, then no threshold, then fewer siblings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from draftsmith.decode.speculative import DEFAULT_K, KPolicy
from draftsmith.pairing.cost import CostModel, DecoderCost, expected_tau, speedup_from_tau
from draftsmith.pairing.depth import expected_tau_from_depth_rates, round_walk

GATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # stop thresholds predicted for (0: never stop)


def known_k(*sources: tuple[int | None, str]) -> tuple[int, str]:
    """The first K a source knows (None or 0: it does not), with where it came from; else `DEFAULT_K`, labelled.
    Where nothing is timed to choose (an export's serving lines) K comes from here; where rounds are timed or
    walked, from `choose_policy`."""
    for k, where in sources:
        if k:
            return int(k), where
    return DEFAULT_K, f"not measured (default {DEFAULT_K})"


@dataclass(frozen=True)
class PolicyChoice:
    """A chosen policy with its evidence: `curve` (K -> predicted speedup of fixed-K rounds) and `options`
    (every stop / sibling setting predicted, by its label)."""

    policy: KPolicy
    predicted: float | None
    reason: str
    curve: dict[int, float] = field(default_factory=dict)
    options: dict[str, float] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return self.policy.k

    def to_dict(self) -> dict:
        return {**self.policy.to_dict(), "predicted_speedup": self.predicted, "k_reason": self.reason,
                "predicted_speedup_by_k": {str(K): x for K, x in self.curve.items()},
                "predicted_speedup_gated": self.options}


def taus_from_alpha(alpha: float, max_k: int) -> dict[int, float]:
    """K -> E[tau] of i.i.d. acceptance at `alpha` (docs/design.md), K = 1..max_k."""
    return {K: expected_tau(alpha, K) for K in range(1, max_k + 1)}


def carried_rates(rates: Sequence[float | None], depth: int) -> list[float]:
    """Acceptance at depths 1..depth from the measured ones (None: no positions there): the last measured rate
    carries to deeper depths."""
    known = [r for r in rates if r is not None] or [0.0]
    return [known[min(j, len(known) - 1)] for j in range(depth)]


def taus_from_rates(rates: Sequence[float | None], max_k: int) -> dict[int, float]:
    """K -> E[tau] = 1 + a_1 + a_1 a_2 + ... from acceptance by depth (the last measured rate carried deeper)."""
    a = carried_rates(rates, max_k)
    return {K: expected_tau_from_depth_rates(a, K) for K in range(1, max_k + 1)}


def predict(cost: CostModel | DecoderCost, tau: float, K: int, tokens: float) -> float:
    """Predicted speedup of fixed-K rounds yielding `tau` tokens each: over the decoder's round cost when
    calibrated (prompts of `tokens` new tokens), else E[tau] / (K c + v(K)) from the isolated timings."""
    if isinstance(cost, DecoderCost):
        return cost.speedup(tau, K, tokens)
    if K not in cost.v:
        raise ValueError(f"no verify cost for K={K} (have {sorted(cost.v)})")
    return speedup_from_tau(tau, K, cost.c, cost.v[K])


def _best(curve: Mapping[int, float]) -> int:
    return max(curve, key=lambda K: (curve[K], -K))


def _label(K: int, thr: float, m: int, d: int, L: int = 0) -> str:
    return (f"K={K} below {thr}" + (f", {m} siblings" if m else "") + (" with children" if d == 2 else "")
            + (f", lookup {L}" if L else ""))


Option = tuple[int, float, int, int, int]  # K, stop threshold, siblings, sibling depth, lookup tokens


def walk_options(records: Sequence[tuple[Tensor, ...]], cost: DecoderCost, *, max_k: int, tokens: int,
                 gate: bool, siblings: int = 0, sibling_depth: int = 1, lookups: Sequence[int] = (0,),
                 copies: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> dict[Option, float]:
    """Predicted speedup by (K, threshold, m, depth, L): fixed rounds (threshold 0, m 0), rounds that stop early
    (m 0; only K >= 2 can), and with m = `siblings` >= 2 rounds that propose m first tokens side by side below the
    threshold (depth 2, up to `sibling_depth`: with each one's next token, K >= 2), each with every number L of
    `lookups` lookup tokens after its chains (L > 0 reads `copies`: `decode.lookup.copy_table` a record), each
    walked on `records`. Only settings whose verify (drafts and lookup tokens + 1 rows) the cost covers."""
    out = {}
    for K in range(1, max_k + 1):
        for thr in (GATES if gate else (0.0,)):
            for m in ((0, siblings) if siblings and thr else (0,)):
                if K == 1 and thr and not m:
                    continue  # a round of one draft has nothing to stop early
                for d in range(1, (sibling_depth if m and K >= 2 else 1) + 1):
                    for L in lookups:
                        if L and (copies is None or K + L not in cost.verify_s):
                            continue
                        n, rounds = round_walk(records, K, thr, budget=tokens, siblings=m, sibling_depth=d,
                                               lookup=L, copies=copies if L else None)
                        out[(K, thr, m, d, L)] = cost.walk_speedup(n, rounds, len(records))
    return out


def _from_walk(records, cost: DecoderCost, *, max_k: int, tokens: int, gate: bool, siblings: int,
               sibling_depth: int, lookups: Sequence[int] = (0,),
               copies: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> PolicyChoice:
    opts = walk_options(records, cost, max_k=max_k, tokens=tokens, gate=gate, siblings=siblings,
                        sibling_depth=sibling_depth, lookups=lookups, copies=copies)
    curve = {K: opts[(K, 0.0, 0, 1, 0)] for K in range(1, max_k + 1)}
    best = max(opts, key=lambda o: (opts[o], -o[0], -o[1], -o[2], -o[3], -o[4]))
    K, thr, m, d, L = best
    policy = KPolicy.fixed(K, confidence=thr or None, siblings=m, sibling_depth=d, lookup=L)
    how = (f"proposing the draft's {m} most probable first tokens side by side"
           + (" with the draft's next token after each" if d == 2 else "") if m else "stopping")
    reason = (f"best predicted from the decoder's rounds walked on the held-out references and the round cost timed "
              f"in the decoder ({', '.join(f'K={k}: {x:.2f}x' for k, x in curve.items())}"
              + (f"; {how} where the draft's first token has probability below {thr}" if thr else "")
              + (f"; with up to {L} lookup tokens after each chain" if L else "")
              + (f": {opts[best]:.2f}x" if thr or L else "") + ")")
    return PolicyChoice(policy, opts[best], reason, curve, {_label(*o): x for o, x in opts.items() if o[1] or o[4]})


def choose_policy(cost: CostModel | DecoderCost | None, *, taus: Mapping[int, float] | None = None,
                  records: Sequence[tuple[Tensor, ...]] | None = None, tokens: int = 64, max_k: int = 16,
                  fixed_k: int = 0, gate: bool = False, siblings: int = 0, sibling_depth: int = 1,
                  lookups: Sequence[int] = (0,), copies: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                  evidence: str = "the draft's acceptance") -> PolicyChoice:
    """The best predicted round policy for one draft (see the module docstring). `fixed_k` > 0 keeps that K
    (its prediction still reported); `records` (with a `DecoderCost`) also weighs stop thresholds (`gate`) and
    sibling rounds of `siblings` candidates, and lookup tokens (`lookups`, walked on `copies`); with neither
    `records` nor `taus` the choice is K = 3, unpredicted.
    Only K in 1..max_k that the cost covers are considered."""
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    if fixed_k:
        curve = {}
        if taus and cost is not None:
            curve = {K: predict(cost, t, K, tokens) for K, t in taus.items() if K == fixed_k and _covers(cost, K)}
        return PolicyChoice(KPolicy.fixed(fixed_k), curve.get(fixed_k), "set by the recipe",
                            curve)
    if records is not None:
        if not isinstance(cost, DecoderCost):
            raise ValueError("walking a head's rounds needs the round cost timed in the decoder (DecoderCost)")
        return _from_walk(records, cost, max_k=max_k, tokens=tokens, gate=gate, siblings=siblings,
                          sibling_depth=sibling_depth, lookups=lookups, copies=copies)
    if taus is None or cost is None:
        return PolicyChoice(KPolicy.fixed(DEFAULT_K), None,
                            "default (no acceptance measured: neither the pair nor the distill stage has run)")
    curve = {K: predict(cost, t, K, tokens) for K, t in sorted(taus.items()) if K <= max_k and _covers(cost, K)}
    if not curve:
        raise ValueError(f"nothing to choose from (empty curve): no K in 1..{max_k} has both an expected tau "
                         f"and a verify cost")
    K = _best(curve)
    reason = (f"best predicted from {evidence} and the measured cost "
              f"({', '.join(f'K={k}: {x:.2f}x' for k, x in curve.items())})")
    return PolicyChoice(KPolicy.fixed(K), curve[K], reason, curve)


def _covers(cost: CostModel | DecoderCost, K: int) -> bool:
    return K in (cost.verify_s if isinstance(cost, DecoderCost) else cost.v)
