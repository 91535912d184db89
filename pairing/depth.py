"""Acceptance by depth: E[tau] and the predicted speedup without assuming that positions are independent.

    a = depth_rates(beta_rows, 16)                  # a_j, j = 1..16, from teacher-forced beta rows
    curve = speedup_curve_from_depth(a, cost.c, cost.v)   # K -> predicted speedup (K chosen: pairing.policy)

Definitions (docs/design.md, "Acceptance by depth"): a_j = P(depth j accepted | depths 1..j-1 accepted),
E[tau] = 1 + a_1 + a_1 a_2 + ... + a_1...a_K (tau counts the bonus/corrected token); the i.i.d. formula
of `pairing.cost.expected_tau` is the case a_j = alpha.

**From teacher-forced rows.** A row is beta_0..beta_{T-1} of one sequence (the target's own continuation,
read by target and draft): 0/1 at temperature 0, probabilities when sampled. Imagine a speculative round
starting at every position t. It reaches depth j only if depths 1..j-1 were accepted, and then accepts
depth j with probability beta_{t+j-1}, so P(first j drafts accepted | start t) = prod_{i<=j} beta_{t+i-1}
and E[accepted at K | t] = sum_{j=1..K} prod_{i<=j} beta_{t+i-1}. For a standalone draft at temperature 0
this is exact: the j-th proposal is compared with the target's token t+j-1 only when every earlier one
matched, and then the matched prefix *is* the target's text that the draft was teacher-forced on. When
sampling it is an approximation (an accepted sampled token need not be the reference token), and it does
not hold for heads, whose depths >= 2 read their own output: measure a_j in the decoder and use
`expected_tau_from_depth_rates`.

**Rounds near the end of a row.** A round from t needs positions t..t+H-1; near the end of a row they do not
exist. Two ways to handle it, both tested:

- `horizon` (the estimators `depth_survival`, `expected_tau_from_runs`, `depth_rates`): only starts with
  room for a whole round of `horizon` tokens count, t = 0..T-horizon; shorter rows contribute nothing.
  Every depth is averaged over the same rounds, so a_j = mean(prod_{i<=j}) / mean(prod_{i<j}) lies in
  [0, 1] and 1 + a_1 + a_1 a_2 + ... equals `expected_tau_from_runs` exactly (same horizon). Positions past
  the end are never counted as rejections, so all-ones rows give K + 1 and there is no end-of-row bias
  in a stationary sequence; the price is the last horizon-1 starts of each row.
- `depth_rates_censored`: every start counts, a round is cut ("censored") at the end of its row and depth
  j is judged only on the starts where position t+j-1 exists: a_j = sum prod_{i<=j} / sum prod_{i<j} over
  those starts. At 0/1 this is the Kaplan-Meier product-limit estimator of the accepted run length; it
  uses every position (shallow depths see short rows too), which matters for 64-token continuations.

Everything is computed in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from draftsmith.decode.speculative import check_sibling_depth, check_siblings
from draftsmith.pairing.cost import speedup_from_tau

BetaRows = Tensor | Sequence[Tensor | Sequence[float]]


# -- estimating a_j from teacher-forced rows --


def _rows(beta_rows: BetaRows) -> list[Tensor]:
    """float64 1-D rows, checked to lie in [0, 1]; a 2-D tensor is read as equal-length rows."""
    if isinstance(beta_rows, Tensor):
        if beta_rows.dim() != 2:
            raise ValueError(f"a tensor of beta rows must be 2-D (rows, positions), got shape {tuple(beta_rows.shape)}")
        beta_rows = list(beta_rows)
    out = []
    for i, r in enumerate(beta_rows):
        b = r.detach().to("cpu", torch.float64) if isinstance(r, Tensor) else torch.tensor(list(r), dtype=torch.float64)
        if b.dim() != 1:
            raise ValueError(f"beta row {i} must be 1-D, got shape {tuple(b.shape)}")
        if not bool(((b >= 0) & (b <= 1)).all()):  # also rejects NaN
            raise ValueError(f"beta row {i} has values outside [0, 1]")
        out.append(b)
    return out


def _check_k(K: int, name: str = "K") -> None:
    if K < 1:
        raise ValueError(f"{name} must be >= 1, got {K}")


def _horizon_sums(beta_rows: BetaRows, depth: int, horizon: int | None) -> tuple[list[float], int]:
    """S_j = sum over starts t of prod_{i<=j} beta_{t+i-1}, j = 0..depth (S_0 = number of starts), over the
    starts with room for `horizon` tokens (default: depth)."""
    _check_k(depth)
    horizon = depth if horizon is None else horizon
    if horizon < depth:
        raise ValueError(f"horizon must be >= {depth} (the deepest depth asked for), got {horizon}")
    S = [0.0] * (depth + 1)
    for b in _rows(beta_rows):
        n = b.numel() - horizon + 1  # starts t = 0..n-1
        if n <= 0:
            continue
        w = torch.ones(n, dtype=torch.float64)
        S[0] += n
        for j in range(1, depth + 1):
            w = w * b[j - 1 : j - 1 + n]
            S[j] += float(w.sum())
    if S[0] == 0:
        raise ValueError(f"no round start: no beta row has the {horizon} positions one round needs")
    return S, int(S[0])


def depth_survival(beta_rows: BetaRows, K: int, *, horizon: int | None = None) -> list[float]:
    """P_j = mean over round starts of prod_{i<=j} beta_{t+i-1} (P(first j drafts accepted)), j = 1..K.

    Starts: those with room for `horizon` tokens (default K); see the module docstring."""
    S, n = _horizon_sums(beta_rows, K, horizon)
    return [s / n for s in S[1:]]


def expected_tau_from_runs(beta_rows: BetaRows, K: int, *, horizon: int | None = None) -> float:
    """E[tau] at K drafts per round = 1 + mean_t sum_{j<=K} prod_{i<=j} beta_{t+i-1}, over the starts with room
    for `horizon` tokens (default K). Counts the bonus token."""
    return 1.0 + sum(depth_survival(beta_rows, K, horizon=horizon))


def depth_rates(beta_rows: BetaRows, K_max: int, *, horizon: int | None = None) -> list[float]:
    """a_j = mean(prod_{i<=j}) / mean(prod_{i<j}), j = 1..K_max, over the starts with room for `horizon`
    tokens (default K_max). In [0, 1]; 0 where no round reached depth j (it then does not affect E[tau])."""
    S, _ = _horizon_sums(beta_rows, K_max, horizon)
    return [S[j] / S[j - 1] if S[j - 1] > 0 else 0.0 for j in range(1, K_max + 1)]


def depth_rates_censored(beta_rows: BetaRows, K_max: int) -> list[float]:
    """a_j with every start counted and rounds censored at the end of their row (Kaplan-Meier at 0/1):
    a_j = sum prod_{i<=j} / sum prod_{i<j} over the starts t where position t+j-1 exists.

    Returns j = 1..min(K_max, longest row); 0 where no observed round reached depth j."""
    _check_k(K_max, "K_max")
    rows = _rows(beta_rows)
    depth = min(K_max, max((b.numel() for b in rows), default=0))
    if depth == 0:
        raise ValueError("no beta positions: every row is empty")
    num, den = [0.0] * (depth + 1), [0.0] * (depth + 1)
    for b in rows:
        T = b.numel()
        w = torch.ones(T, dtype=torch.float64)  # prod_{i<j} for starts 0..T-j+1
        for j in range(1, min(depth, T) + 1):
            n = T - j + 1  # starts whose depth j lies in the row
            prev = w[:n]
            w = prev * b[j - 1 : j - 1 + n]
            den[j] += float(prev.sum())
            num[j] += float(w.sum())
    return [num[j] / den[j] if den[j] > 0 else 0.0 for j in range(1, depth + 1)]


# -- the decoder's own rounds on a row ("acceptance as it happens") --


def round_matrix(beta: Tensor | Sequence[float], depth: int) -> Tensor:
    """(T, depth) float64: entry [s, j-1] = beta_{s+j-1}, the acceptance of depth j in a round whose first draft
    is position s, for a standalone draft (it reads the accepted text, so depth j at s is position s+j-1).
    Cells past the row are 0 (they are never reached: see `expected_rounds`)."""
    _check_k(depth, "depth")
    b = _rows([beta])[0]
    T = b.numel()
    m = torch.zeros(T, depth, dtype=torch.float64)
    for j in range(depth):
        m[: max(T - j, 0), j] = b[j:]
    return m


def depth_rates_from_rounds(accepts: Sequence[Tensor], K_max: int) -> list[float]:
    """`depth_rates_censored` for round matrices (`expected_rounds`'s `accept`, e.g. a head's, whose depth j from
    start s need not be depth 1 at s+j-1): a_j = sum prod_{i<=j} A[s,i] / sum prod_{i<j} A[s,i] over the starts s
    whose depth j lies in the row (s + j - 1 < T), j = 1..K_max; 0 where no round reached depth j."""
    _check_k(K_max, "K_max")
    num, den = [0.0] * K_max, [0.0] * K_max
    for a in accepts:
        T = a.shape[0]
        surv = torch.ones(T, dtype=torch.float64)
        for j in range(min(K_max, a.shape[1])):
            live = torch.arange(T) + j < T
            den[j] += float(surv[live].sum())
            surv = surv * a[:, j].to(torch.float64)
            num[j] += float(surv[live].sum())
    return [n / d if d > 0 else 0.0 for n, d in zip(num, den)]


def expected_rounds(accept: Tensor, K: int, *, budget: int | None = None) -> float:
    """E[number of target forwards] the decoder needs to emit a row of T = len(accept) tokens at K drafts a round.

    `accept[s, j-1]` (float64 in [0, 1]) is P(depth j accepted | depths < j accepted) in a round whose first
    draft is position s (`round_matrix` for a standalone draft; a head's own depths for a head). The walk is
    `decode.speculative.generate`'s: a round from s drafts K_s = min(K, budget - s - 1, T - s) tokens (never
    past the budget; `budget` = max_new_tokens, default T, so a row shorter than its budget ended at EOS and a
    round that accepts the EOS stops there), accepts a prefix of n with P(n) = prod_{i<=n} a_i (1 - a_{n+1})
    (n < K_s) or prod_{i<=K_s} a_i (n = K_s), and emits n + 1 tokens. Every position is judged at most once
    (a rejected position gets the target's token), so R(s) = 1 + sum_n P(n | s) R(s + n + 1), R(s >= T) = 0,
    is exact when acceptances are independent given their cells, and exact outright at temperature 0 (0/1).
    """
    if accept.dim() != 2:
        raise ValueError(f"accept must be (positions, depths), got shape {tuple(accept.shape)}")
    if not bool(((accept >= 0) & (accept <= 1)).all()):
        raise ValueError("accept has values outside [0, 1]")
    return expected_round_counts(accept, K, budget=budget)[0]


def expected_round_counts(accept: Tensor, K: int, *, budget: int | None = None) -> tuple[float, float, float]:
    """(E[target forwards], E[tokens drafted], E[drafts accepted]) for one row, walked as `expected_rounds`
    walks it (same recursion: a round from s drafts K_s tokens and accepts a prefix of n); accepted / drafted
    is what an engine that stops a round at the first rejection counts."""
    _check_k(K)
    a = accept.detach().to("cpu", torch.float64)
    if a.dim() != 2 or not bool(((a >= 0) & (a <= 1)).all()):
        raise ValueError("accept must be (positions, depths) with values in [0, 1]")
    T = a.shape[0]
    budget = T if budget is None else budget
    if budget < T:
        raise ValueError(f"budget ({budget}) must be >= the row's length ({T})")
    R, D, A = ([0.0] * (T + K + 2) for _ in range(3))
    for s in range(T - 1, -1, -1):
        k = max(0, min(K, budget - s - 1, T - s))
        if k > a.shape[1]:
            raise ValueError(f"K={K} needs {k} depths of acceptance, accept has {a.shape[1]}")
        r, d, acc, surv = 1.0, float(k), 0.0, 1.0
        for n in range(k):
            p_n = surv * (1.0 - float(a[s, n]))  # accepts exactly n
            r, d, acc = r + p_n * R[s + n + 1], d + p_n * D[s + n + 1], acc + p_n * (n + A[s + n + 1])
            surv *= float(a[s, n])
        nxt = s + k + 1
        R[s], D[s], A[s] = r + surv * R[nxt], d + surv * D[nxt], acc + surv * (k + A[nxt])
    return R[0], D[0], A[0]


def tokens_per_round(rows: Sequence[Tensor], K: int, *, budgets: Sequence[int | None] | None = None) -> float:
    """Tokens per target forward over rows decoded one after another: sum T / sum E[rounds] (the decoder's
    `new_tokens / target_forwards`). `rows`: one `accept` matrix per row; `budgets`: each row's max_new_tokens."""
    budgets = [None] * len(rows) if budgets is None else list(budgets)
    if len(budgets) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(budgets)} budgets")
    tokens = sum(int(r.shape[0]) for r in rows)
    rounds = sum(expected_rounds(r, K, budget=b) for r, b in zip(rows, budgets) if r.shape[0])
    if rounds == 0:
        raise ValueError("no tokens: every row is empty")
    return tokens / rounds


# -- from a_j to E[tau] and the predicted speedup (mirrors pairing.cost) --


def _check_rates(a: Sequence[float], K: int) -> None:
    _check_k(K)
    if K > len(a):
        raise ValueError(f"K={K} needs a_j for j = 1..{K}, got {len(a)} rate(s)")
    bad = [x for x in a[:K] if not 0.0 <= x <= 1.0]  # also rejects NaN
    if bad:
        raise ValueError(f"depth rates a_j must be in [0, 1], got {bad[0]}")


def expected_tau_from_depth_rates(a: Sequence[float], K: int) -> float:
    """E[tau] = 1 + a_1 + a_1 a_2 + ... + a_1...a_K (counts the bonus token); a_j = alpha gives the i.i.d. value."""
    _check_rates(a, K)
    total, prod = 1.0, 1.0
    for x in a[:K]:
        prod *= x
        total += prod
    return total


def predicted_speedup_from_depth(a: Sequence[float], K: int, c: float, v_K: float) -> float:
    """E[tau] / (K*c + v(K)) with E[tau] from depth rates; cf. `pairing.cost.predicted_speedup`."""
    _check_rates(a, K)
    return speedup_from_tau(expected_tau_from_depth_rates(a, K), K, c, v_K)


def speedup_curve_from_depth(a: Sequence[float], c: float, v: dict[int, float]) -> dict[int, float]:
    """K -> predicted speedup, for every K in v with K <= len(a) (a_j known up to that depth)."""
    ks = sorted(K for K in v if K <= len(a))
    if not ks:
        raise ValueError(f"no K in v ({sorted(v)}) is covered by the {len(a)} depth rate(s)")
    return {K: predicted_speedup_from_depth(a, K, c, v[K]) for K in ks}




__all__ = [
    "BetaRows", "depth_rates_from_rounds", "expected_round_counts", "expected_rounds", "round_matrix",
    "tokens_per_round", "depth_rates", "depth_rates_censored", "depth_survival",
    "expected_tau_from_depth_rates", "expected_tau_from_runs", "predicted_speedup_from_depth",
    "speedup_curve_from_depth",
]


# -- rounds that stop early when the draft is unsure (KPolicy.confidence) --


def gated_walk(rows: Sequence[tuple[Tensor, ...]], K: int, threshold: float, *,
               budget: int) -> tuple[int, list[int]]:
    """The decoder's own rounds on teacher-forced rows at temperature 0, for rounds that stop early: a round
    drafts depth 1 and goes on to depth j + 1 only while the draft gave its depth-j token a probability >=
    `threshold` (the decoder's `KPolicy(confidence=threshold)`; 0 never stops early).

    A row is (hits, tops), each (D, T), D >= K: column n is the round whose first draft is new token n, hits[j-1, n]
    is 1 when its depth-j token equals the target's, tops[j-1, n] that token's draft probability (0 past the row).
    The walk is `decode.speculative.generate`'s: from new token n a round may draft k = min(K, budget - n - 1)
    tokens (never past `budget` = max_new_tokens), drafts d of them (stopping early as above), accepts the
    leading hits among those d, and emits them plus one token; the next round starts after them. A row of
    T < budget tokens ended at EOS, so the round that reaches it stops there. At 0/1 hits this is not an
    estimate: it is the decoder's count on those rows. Returns (tokens emitted, drafts of every round)."""
    tokens, rounds = round_walk(rows, K, threshold, budget=budget)
    return tokens, [d for _, d in rounds]


def round_walk(rows: Sequence[tuple[Tensor, ...]], K: int, threshold: float, *, budget: int,
               siblings: int = 0, sibling_depth: int = 1, lookup: int = 0,
               copies: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None
               ) -> tuple[int, list[tuple[int, int]]]:
    """`gated_walk`, with sibling rounds (`KPolicy(confidence=threshold, siblings=m)`) when `siblings` = m >= 2:
    a round whose depth-1 token has a draft probability below `threshold` proposes the draft's m most probable
    tokens for that position in one draft step, and emits two tokens when the target's is among them, else one.
    Those rows need a third entry, ranks (T,): where the target's token n stands in the draft's depth-1
    distribution (0: its top token, which is what hits[0] says). With `sibling_depth` 2 (`KPolicy.sibling_depth`)
    a sibling round with room for two tokens also drafts each sibling's next token (two draft steps, 2m tokens)
    and emits three tokens when the target's token is a sibling and hits[1] (the draft's depth-2 token after the
    target's own, which is what the accepted sibling's child is) holds too. With `lookup` = L > 0
    (`KPolicy.lookup`) a chain round that drafted d tokens from new token n appends up to min(L, budget - n - 1 -
    d) lookup tokens, read from the row's `copies` entry (`decode.lookup.copy_table`: proposed and matched
    counts at every new-token position, for a limit >= L) at position n + d: where all d drafts hit, the
    context there is the decoder's and so are the lookup tokens; the matched ones are accepted after the drafts.
    (Past a miss the decoder's lookup reads its own drafts, so only the number proposed, the round's cost, may
    differ.) Returns (tokens emitted, (draft steps, tokens drafted) of every round)."""
    _check_k(K)
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
    check_siblings(siblings)
    check_sibling_depth(sibling_depth, siblings)
    if lookup < 0 or (lookup and (copies is None or len(copies) != len(rows))):
        raise ValueError(f"lookup ({lookup}) must be >= 0, and > 0 needs one copies entry (proposed, matched) a row")
    tokens, rounds = 0, []
    for i_row, row in enumerate(rows):
        hits, tops = row[0], row[1]
        if hits.dim() != 2 or hits.shape != tops.shape or hits.shape[0] < K:
            raise ValueError(f"a row needs hits and tops of one shape (>= {K} depths, positions), got "
                             f"{tuple(hits.shape)}, {tuple(tops.shape)}")
        if siblings and (len(row) < 3 or row[2].shape != hits.shape[1:]):
            raise ValueError("sibling rounds need each row's depth-1 ranks (T,) as its third entry")
        h, p = hits.tolist(), tops.tolist()
        if any(x not in (0, 1) for r in h for x in r):
            raise ValueError("hits must be 0/1")
        rank = row[2].tolist() if siblings else None
        T = min(hits.shape[1], budget)
        n = 0
        while n < T:
            k = min(K, budget - n - 1)
            if k > 0 and siblings and p[0][n] < threshold:
                a = 1 if rank[n] < siblings else 0
                two = sibling_depth == 2 and k >= 2
                if two and a and h[1][n] == 1:
                    a = 2
                n += min(a + 1, T - n)
                rounds.append((2, 2 * siblings) if two else (1, siblings))
                continue
            d = 1 if k > 0 else 0
            while d and d < k and p[d - 1][n] >= threshold:
                d += 1
            a = 0
            while a < d and h[a][n] == 1:
                a += 1
            extra = 0
            if lookup and d:
                proposed, matched = copies[i_row]
                at = n + d
                if at < len(proposed):
                    extra = min(proposed[at], lookup, budget - n - 1 - d)
                    if a == d:
                        a += min(matched[at], extra)
            n += min(a + 1, T - n)
            rounds.append((d, d + extra))
        tokens += T
    return tokens, rounds
