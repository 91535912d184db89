"""Acceptance by depth: the estimators against rounds walked one by one on 0/1 rows (and against exact
enumeration for probability rows), clustered acceptance where the i.i.d. formula is wrong, i.i.d. rows where
both agree, and the speedup functions against their i.i.d. counterparts in pairing.cost."""

import itertools
import random

import pytest
import torch

from draftsmith.pairing.cost import CostModel, expected_tau, speedup_curve
from draftsmith.pairing.depth import (
    depth_rates, depth_rates_censored, depth_rates_from_rounds, depth_survival, expected_round_counts, expected_rounds,
    expected_tau_from_depth_rates, expected_tau_from_runs, gated_walk, predicted_speedup_from_depth, round_matrix,
    speedup_curve_from_depth, tokens_per_round,
)
from draftsmith.pairing.policy import choose_policy, taus_from_alpha, taus_from_rates

KS = range(1, 17)


def best_k(alpha: float, c: float, v: dict[int, float]) -> tuple[int, float]:
    """K and its predicted speedup for i.i.d. acceptance, through the one chooser (pairing.policy)."""
    choice = choose_policy(CostModel.from_ratios(c, v), taus=taus_from_alpha(alpha, 16))
    return choice.k, choice.predicted


def best_k_from_depth(a: list[float], c: float, v: dict[int, float]) -> tuple[int, float]:
    """K and its predicted speedup from acceptance by depth (K up to len(a)), through the one chooser."""
    choice = choose_policy(CostModel.from_ratios(c, v), taus=taus_from_rates(a, len(a)), max_k=len(a))
    return choice.k, choice.predicted


# -- brute force: walk a round from every start --


def walk(row: list[int], t: int, K: int) -> tuple[int, bool]:
    """Drafts accepted by a round of K from t, and whether it was cut by the end of the row."""
    n = 0
    while n < K and t + n < len(row) and row[t + n] == 1:
        n += 1
    return n, n < K and t + n == len(row)


def brute_rounds(rows: list[list[int]], K: int, horizon: int) -> list[int]:
    """Accepted count of every round from a start with room for `horizon` tokens."""
    return [walk(r, t, K)[0] for r in rows for t in range(len(r) - horizon + 1)]


def brute_tau(rows: list[list[int]], K: int, horizon: int | None = None) -> float:
    ns = brute_rounds(rows, K, horizon or K)
    return sum(n + 1 for n in ns) / len(ns)


def brute_rates(rows: list[list[int]], K_max: int, horizon: int | None = None) -> list[float]:
    ns = brute_rounds(rows, K_max, horizon or K_max)
    reach = [sum(n >= j for n in ns) for j in range(K_max + 1)]
    return [reach[j] / reach[j - 1] if reach[j - 1] else 0.0 for j in range(1, K_max + 1)]


def brute_kaplan_meier(rows: list[list[int]], K_max: int) -> list[float]:
    """At risk at depth j: rounds that accepted j-1 drafts and whose depth j lies inside the row."""
    at_risk, accepted = [0] * (K_max + 1), [0] * (K_max + 1)
    for r in rows:
        for t in range(len(r)):
            n, _ = walk(r, t, K_max)
            for j in range(1, K_max + 1):
                if n >= j - 1 and t + j - 1 < len(r):
                    at_risk[j] += 1
                    accepted[j] += n >= j
    depth = min(K_max, max(len(r) for r in rows))
    return [accepted[j] / at_risk[j] if at_risk[j] else 0.0 for j in range(1, depth + 1)]


def random_rows(seed: int, n: int, lengths: tuple[int, int], p: float = 0.6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[int(rng.random() < p) for _ in range(rng.randint(*lengths))] for _ in range(n)]


# -- the estimators against brute force --


@pytest.mark.parametrize("seed", range(6))
def test_tau_and_rates_equal_walked_rounds(seed: int) -> None:
    rows = random_rows(seed, 12, (0, 40), p=[0.3, 0.6, 0.85][seed % 3])
    for K in (1, 2, 3, 5, 8, 16):
        for horizon in (K, K + 3):
            got = expected_tau_from_runs(rows, K, horizon=horizon)
            assert got == pytest.approx(brute_tau(rows, K, horizon), rel=1e-12)
        assert depth_rates(rows, K) == pytest.approx(brute_rates(rows, K), rel=1e-12)
        assert depth_survival(rows, K) == pytest.approx(
            [sum(n >= j for n in brute_rounds(rows, K, K)) / len(brute_rounds(rows, K, K)) for j in range(1, K + 1)],
            rel=1e-12,
        )


@pytest.mark.parametrize("seed", range(6))
def test_rates_give_back_tau_at_every_k(seed: int) -> None:
    """E[tau] = 1 + a_1 + a_1 a_2 + ... equals the mean over rounds, for every K up to the horizon."""
    rows = random_rows(100 + seed, 10, (5, 60))
    a = depth_rates(rows, 16)
    assert all(0.0 <= x <= 1.0 for x in a)
    for K in KS:
        want = expected_tau_from_runs(rows, K, horizon=16)
        assert expected_tau_from_depth_rates(a, K) == pytest.approx(want, rel=1e-12)
    for K in (1, 4, 9):  # same start set by default
        want = expected_tau_from_runs(rows, K)
        assert expected_tau_from_depth_rates(depth_rates(rows, K), K) == pytest.approx(want, rel=1e-12)


def test_probability_rows_equal_the_expectation_over_accept_reject_draws() -> None:
    """Sampled beta: the estimator on probabilities = the exact mean of the walked estimate over every 0/1
    realisation of independent Bernoulli(beta_t) outcomes."""
    rows = [[0.9, 0.2, 0.7, 1.0, 0.5, 0.35, 0.8], [0.6, 0.95, 0.1, 0.45, 0.99, 0.3]]
    for K in (1, 2, 3, 5):
        want = 0.0
        outcomes = [list(itertools.product([0, 1], repeat=len(r))) for r in rows]
        for real in itertools.product(*outcomes):
            w = 1.0
            for r, o in zip(rows, real):
                for b, x in zip(r, o):
                    w *= b if x else 1 - b
            want += w * brute_tau([list(o) for o in real], K)
        assert expected_tau_from_runs(rows, K) == pytest.approx(want, rel=1e-12)
        a = depth_rates(rows, K)
        assert all(0.0 <= x <= 1.0 for x in a)
        assert expected_tau_from_depth_rates(a, K) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_censored_rates_are_kaplan_meier(seed: int) -> None:
    rows = random_rows(200 + seed, 15, (0, 30))
    rows.append([1, 1])  # short rows count at the depths they reach
    a = depth_rates_censored(rows, 16)
    assert a == pytest.approx(brute_kaplan_meier(rows, 16), rel=1e-12)
    assert all(0.0 <= x <= 1.0 for x in a)


def test_censored_uses_rows_too_short_for_a_whole_round() -> None:
    rows = [[1, 1, 0], [1, 0, 1, 1], [0]]
    with pytest.raises(ValueError, match="no round start"):
        depth_rates(rows, 5)
    assert depth_rates_censored(rows, 5) == pytest.approx([5 / 8, 2 / 4, 0.0, 0.0])  # only 4 depths exist
    assert depth_rates_censored([[1] * 3], 16) == [1.0, 1.0, 1.0]
    # a short row of rejections does not make a deeper depth look better than a shallower one
    a = depth_rates_censored([[1] * 10, [0]], 3)
    assert a == pytest.approx([10 / 11, 1.0, 1.0])


# -- correlation: where the i.i.d. formula fails --


def clustered(period_ones: int, period_zeros: int, periods: int, extra: int) -> list[int]:
    block = [1] * period_ones + [0] * period_zeros
    return block * periods + block[:extra]


def test_clustered_acceptance_by_hand() -> None:
    """Runs of 8 accepts then 8 rejects, alpha = 1/2: a round from a 1 usually runs on."""
    row = clustered(8, 8, 20, 3)  # 20*16 + 3 positions: at K = 4, 320 starts = 20 whole periods
    alpha = sum(row[: 320]) / 320
    assert alpha == 0.5
    want = 1 + (4 * 5 + 3 + 2 + 1) / 16  # from a 1 at offset o: min(4, 8-o) accepted; from a 0: none
    assert expected_tau_from_runs([row], 4) == want == 2.625
    assert depth_rates([row], 4) == [1 / 2, 7 / 8, 6 / 7, 5 / 6]
    assert expected_tau(alpha, 4) == 1.9375  # i.i.d.: clearly wrong
    assert expected_tau_from_runs([row], 4) - expected_tau(alpha, 4) > 0.6


def test_clustered_acceptance_moves_best_k() -> None:
    rows = [clustered(8, 8, 10, 15), clustered(12, 4, 8, 15), clustered(3, 13, 10, 15)]
    alpha = sum(map(sum, rows)) / sum(map(len, rows))
    c, v = 0.05, {K: 1.0 + 0.02 * K for K in KS}
    a = depth_rates(rows, 16)
    brute = {K: brute_tau(rows, K, 16) / (K * c + v[K]) for K in KS}
    K_brute = max(brute, key=lambda k: (brute[k], -k))
    assert speedup_curve_from_depth(a, c, v) == pytest.approx(brute, rel=1e-12)
    assert best_k_from_depth(a, c, v) == (K_brute, pytest.approx(brute[K_brute], rel=1e-12))
    K_iid, s_iid = best_k(alpha, c, v)
    assert K_iid < K_brute
    assert abs(s_iid - brute[K_brute]) > 0.3
    # once a round is under way it tends to continue: deeper depths accept far more often than depth 1
    assert a[0] == pytest.approx(0.5, abs=0.05) and min(a[1:8]) > 0.7


def test_iid_rows_agree_with_the_iid_formula() -> None:
    g = torch.Generator().manual_seed(0)
    for alpha in (0.3, 0.7, 0.9):
        rows = (torch.rand(300, 160, generator=g, dtype=torch.float64) < alpha).double()
        a_hat = float(rows.mean())
        a = depth_rates(rows, 8)
        deep = 8 if alpha >= 0.7 else 4  # at alpha 0.3 only ~10 rounds of 45k reach depth 8
        assert a[:deep] == pytest.approx([alpha] * deep, abs=0.02)
        for K in (1, 4, 8):
            assert expected_tau_from_runs(rows, K, horizon=8) == pytest.approx(expected_tau(a_hat, K), rel=0.02)
        # the censored estimate agrees too on long rows
        assert depth_rates_censored(rows, 8)[:deep] == pytest.approx(a[:deep], abs=0.005)


# -- edge cases --


def test_all_zero_and_all_one_rows() -> None:
    zeros, ones = [[0.0] * 20] * 3, [[1.0] * 20] * 3
    for K in (1, 5, 16):
        assert expected_tau_from_runs(zeros, K) == 1.0
        assert expected_tau_from_runs(ones, K) == K + 1.0  # no end-of-row penalty
        assert depth_rates(zeros, K) == [0.0] * K  # no round reached depth >= 2: 0 by convention
        assert depth_rates(ones, K) == [1.0] * K
        assert depth_rates_censored(ones, K) == [1.0] * K
        assert depth_rates_censored(zeros, K) == [0.0] * K
        assert expected_tau_from_depth_rates(depth_rates(ones, K), K) == K + 1.0


def test_tensor_input_equals_lists() -> None:
    rows = random_rows(7, 5, (30, 30))
    t = torch.tensor(rows, dtype=torch.float32)
    assert depth_rates(t, 6) == pytest.approx(depth_rates(rows, 6), rel=1e-12)
    assert expected_tau_from_runs(list(t), 6) == pytest.approx(expected_tau_from_runs(rows, 6), rel=1e-12)


@pytest.mark.parametrize("rows", [[], [[]], [[], [1.0]], torch.zeros(0, 5)])
def test_no_round_raises(rows) -> None:
    with pytest.raises(ValueError, match="no round start"):
        expected_tau_from_runs(rows, 2)
    with pytest.raises(ValueError, match="no round start"):
        depth_rates(rows, 2)


@pytest.mark.parametrize("rows", [[], [[]], torch.zeros(0, 5)])
def test_censored_without_positions_raises(rows) -> None:
    with pytest.raises(ValueError, match="empty"):
        depth_rates_censored(rows, 3)


def test_invalid_inputs_raise() -> None:
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        depth_rates([[0.5, 1.5, 0.2]], 1)
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        expected_tau_from_runs([[0.5, float("nan"), 0.2]], 1)
    with pytest.raises(ValueError, match="1-D"):
        depth_rates([torch.ones(2, 3)], 1)
    with pytest.raises(ValueError, match="2-D"):
        depth_rates(torch.ones(3), 1)
    with pytest.raises(ValueError, match="K must be >= 1"):
        expected_tau_from_runs([[1.0]], 0)
    with pytest.raises(ValueError, match="horizon"):
        expected_tau_from_runs([[1.0] * 5], 3, horizon=2)
    with pytest.raises(ValueError, match="K_max"):
        depth_rates_censored([[1.0]], 0)


# -- from a_j to the speedup: the i.i.d. case is pairing.cost --


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
def test_constant_rates_are_the_iid_formula(alpha: float) -> None:
    a = [alpha] * 16
    for K in KS:
        assert expected_tau_from_depth_rates(a, K) == pytest.approx(expected_tau(alpha, K), rel=1e-12)
    for c, v in ((0.05, {K: 1.0 for K in KS}), (0.2, {K: 1.0 + 0.3 * K for K in KS})):
        assert speedup_curve_from_depth(a, c, v) == pytest.approx(speedup_curve(alpha, c, v), rel=1e-12)
        assert best_k_from_depth(a, c, v) == (best_k(alpha, c, v)[0], pytest.approx(best_k(alpha, c, v)[1], rel=1e-12))


def test_speedup_by_hand_and_k_limited_by_rates() -> None:
    a = [0.9, 0.5, 0.5]
    assert expected_tau_from_depth_rates(a, 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)
    assert predicted_speedup_from_depth(a, 2, 0.1, 1.2) == pytest.approx(2.35 / 1.4)
    curve = speedup_curve_from_depth(a, 0.1, {K: 1.0 for K in KS})
    assert list(curve) == [1, 2, 3]  # no a_j beyond depth 3
    assert best_k_from_depth([1.0, 1.0], 0.0, {1: 1.0, 2: 1.5}) == (1, 2.0)  # tie: 2/1 == 3/1.5 -> smaller K


def test_speedup_invalid_inputs_raise() -> None:
    with pytest.raises(ValueError, match="needs a_j"):
        expected_tau_from_depth_rates([0.5], 2)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        expected_tau_from_depth_rates([0.5, 1.2], 2)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        expected_tau_from_depth_rates([float("nan")], 1)
    with pytest.raises(ValueError, match="c must be >= 0"):
        predicted_speedup_from_depth([0.5], 1, -0.1, 1.0)
    with pytest.raises(ValueError, match=r"v\(K\) must be > 0"):
        best_k_from_depth([0.5, 0.5], 0.1, {1: 1.0, 2: 0.0})
    with pytest.raises(ValueError, match="empty"):
        best_k_from_depth([0.5], 0.1, {})
    with pytest.raises(ValueError, match="covered"):
        speedup_curve_from_depth([0.5], 0.1, {2: 1.0, 3: 1.0})


# -- the decoder's own rounds: expected_rounds against the decoder's walk, enumerated --


def decoder_rounds(judge, T: int, K: int, budget: int) -> int:
    """Rounds `decode.speculative.generate` takes to emit T tokens: `judge(s, j)` says whether depth j of the
    round whose first draft is position s is accepted (consulted only where the decoder would look)."""
    s, rounds = 0, 0
    while s < T:
        k = min(K, budget - s - 1, T - s)
        n = 0
        while n < k and judge(s, n + 1):
            n += 1
        s += n + 1
        rounds += 1
    return rounds


@pytest.mark.parametrize("seed", range(8))
def test_expected_rounds_on_01_rows_equal_the_walk(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(20):
        row = [int(rng.random() < 0.7) for _ in range(rng.randint(1, 30))]
        T = len(row)
        for K in (1, 2, 3, 5, 16):
            for budget in (T, T + 3):
                want = decoder_rounds(lambda s, j: row[s + j - 1] == 1, T, K, budget)
                got = expected_rounds(round_matrix(row, 16), K, budget=budget)
                assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_expected_rounds_equal_enumeration_over_cell_outcomes(seed: int) -> None:
    """Probability cells (a head's matrix: any value per start and depth), every 0/1 outcome of every cell
    enumerated with its probability in float64, the decoder walked on each."""
    g = torch.Generator().manual_seed(seed)
    T, J = 4, 3
    a = torch.rand(T, J, generator=g, dtype=torch.float64)
    a[0, 0] = 1.0  # certain cells too
    cells = [(s, j) for s in range(T) for j in range(J)]
    for K in (1, 2, 3):
        for budget in (T, T + 2):
            want = 0.0
            for bits in itertools.product((0, 1), repeat=len(cells)):
                out = dict(zip(cells, bits))
                p = 1.0
                for (s, j), b in out.items():
                    p *= float(a[s, j]) if b else 1.0 - float(a[s, j])
                want += p * decoder_rounds(lambda s, j: out[(s, j - 1)] == 1, T, K, budget)
            assert expected_rounds(a, K, budget=budget) == pytest.approx(want, rel=1e-12)


def decoder_counts(judge, T: int, K: int, budget: int) -> tuple[int, int, int]:
    """(rounds, tokens drafted, drafts accepted) of the decoder's walk, as `decoder_rounds` walks it."""
    s, rounds, drafted, accepted = 0, 0, 0, 0
    while s < T:
        k = min(K, budget - s - 1, T - s)
        n = 0
        while n < k and judge(s, n + 1):
            n += 1
        s, rounds, drafted, accepted = s + n + 1, rounds + 1, drafted + k, accepted + n
    return rounds, drafted, accepted


@pytest.mark.parametrize("seed", range(4))
def test_expected_round_counts_equal_the_walk_and_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(20):
        row = [int(rng.random() < 0.7) for _ in range(rng.randint(1, 30))]
        for K in (1, 3, 16):
            for budget in (len(row), len(row) + 3):
                want = decoder_counts(lambda s, j: row[s + j - 1] == 1, len(row), K, budget)
                got = expected_round_counts(round_matrix(row, 16), K, budget=budget)
                assert got == pytest.approx(want, abs=1e-12)
    g = torch.Generator().manual_seed(seed)
    T, J = 4, 3
    a = torch.rand(T, J, generator=g, dtype=torch.float64)
    cells = [(s, j) for s in range(T) for j in range(J)]
    for K in (1, 3):
        want = [0.0, 0.0, 0.0]
        for bits in itertools.product((0, 1), repeat=len(cells)):
            out = dict(zip(cells, bits))
            p = 1.0
            for (s, j), b in out.items():
                p *= float(a[s, j]) if b else 1.0 - float(a[s, j])
            for i, x in enumerate(decoder_counts(lambda s, j: out[(s, j - 1)] == 1, T, K, T + 1)):
                want[i] += p * x
        assert expected_round_counts(a, K, budget=T + 1) == pytest.approx(tuple(want), rel=1e-12)


def test_expected_rounds_by_hand() -> None:
    # all accepted, budget = T = 5, K = 2: rounds emit 3, then K = min(2, 5-3-1) = 1 -> 2 tokens: 2 rounds
    assert expected_rounds(round_matrix([1.0] * 5, 4), 2) == 2.0
    # ended at EOS (budget 9): the second round drafts min(2, 5, 2) = 2, accepts both, stops: still 2
    assert expected_rounds(round_matrix([1.0] * 5, 4), 2, budget=9) == 2.0
    # nothing accepted: one round a token
    assert expected_rounds(round_matrix([0.0] * 5, 4), 3) == 5.0
    # one token, one depth at 1/2: one round whatever happens
    assert expected_rounds(torch.tensor([[0.5]], dtype=torch.float64), 1) == 1.0
    # two tokens, budget 3, a = 1/2 at depth 1 from 0: 1/2 * 1 + 1/2 * 2
    a = torch.tensor([[0.5], [0.0]], dtype=torch.float64)
    assert expected_rounds(a, 1, budget=3) == 1.5


def test_tokens_per_round_is_tokens_over_rounds() -> None:
    rows = [round_matrix([1, 0, 1, 1], 4), round_matrix([0, 0], 4)]
    got = tokens_per_round(rows, 2, budgets=[4, 2])
    assert got == pytest.approx(6 / (decoder_rounds(lambda s, j: [1, 0, 1, 1][s + j - 1], 4, 2, 4) + 2))


def test_expected_rounds_bad_input() -> None:
    with pytest.raises(ValueError):
        expected_rounds(torch.full((3, 2), 1.5, dtype=torch.float64), 1)
    with pytest.raises(ValueError):
        expected_rounds(torch.zeros(3), 1)
    with pytest.raises(ValueError):
        expected_rounds(torch.zeros(3, 2, dtype=torch.float64), 1, budget=2)
    with pytest.raises(ValueError):
        expected_rounds(torch.ones(5, 2, dtype=torch.float64), 4)  # K needs 4 depths
    with pytest.raises(ValueError):
        tokens_per_round([torch.zeros(0, 2)], 1)


@pytest.mark.parametrize("seed", range(4))
def test_rates_from_round_matrices_are_kaplan_meier_on_standalone_rows(seed: int) -> None:
    """A standalone draft's round matrices give exactly the censored rates of its rows (zeros past the longest)."""
    rows = random_rows(seed, 7, (1, 12))
    got = depth_rates_from_rounds([round_matrix(r, 16) for r in rows], 16)
    want = brute_kaplan_meier(rows, 16)
    assert got[: len(want)] == pytest.approx(want, abs=1e-12) and all(x == 0.0 for x in got[len(want):])
    assert depth_rates_censored(rows, 16) == pytest.approx(want, abs=1e-12)


# -- rounds that stop early (confidence): the walk by hand (the decoder's own count: tests/distill) --


def test_gated_walk_by_hand():
    hits = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 0, 1]], dtype=torch.float64)
    tops = torch.tensor([[0.9, 0.1, 0.9, 0.2, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    # K = 2, never stopping early: from 0 both accepted (3 tokens), from 3 both (3 tokens): 2 rounds of 2 drafts
    assert gated_walk([(hits, tops)], 2, 0.0, budget=100) == (6, [2, 2])
    # stopping below 0.5: from 0 (0.9) as above; from 3 (0.2) one draft, accepted: 2 tokens; from 5 two drafts
    assert gated_walk([(hits, tops)], 2, 0.5, budget=100) == (6, [2, 1, 2])
    # K = 1: 0 -> 2 -> 3 (miss at 2) -> 5 -> done
    assert gated_walk([(hits, tops)], 1, 0.0, budget=100) == (6, [1, 1, 1, 1])
    # a budget of 4 tokens: the last token is never drafted (k = budget - n - 1 = 0 at n = 3)
    assert gated_walk([(hits, tops)], 2, 0.0, budget=4) == (4, [2, 0])
    assert gated_walk([(hits, tops), (hits[:, :1], tops[:, :1])], 2, 0.0, budget=100) == (7, [2, 2, 2])


def test_sibling_walk_by_hand():
    from draftsmith.pairing.depth import round_walk

    hits = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 0, 1]], dtype=torch.float64)
    tops = torch.tensor([[0.9, 0.1, 0.9, 0.2, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    rank = torch.tensor([0, 0, 1, 0, 0, 0])
    # as gated_walk's K = 2 below 0.5 until the round from 3 (0.2): siblings, one step, rank 0 accepted -> 2 tokens
    assert round_walk([(hits, tops, rank)], 2, 0.5, budget=100, siblings=2) == (6, [(2, 2), (1, 2), (2, 2)])
    # below 0.95 every round is a sibling round: 0 -> 2 (rank 0) -> 4 (rank 1 at 2: accepted) -> 6
    assert round_walk([(hits, tops, rank)], 2, 0.95, budget=100, siblings=2) == (6, [(1, 2)] * 3)
    # the same with rank 2 at position 2 and two siblings: missed, one token
    far = torch.tensor([0, 0, 2, 0, 0, 0])
    assert round_walk([(hits, tops, far)], 2, 0.95, budget=100, siblings=2) == (6, [(1, 2)] * 4)
    assert round_walk([(hits, tops, far)], 2, 0.95, budget=100, siblings=3) == (6, [(1, 3)] * 3)
    # without siblings it is gated_walk, steps = drafts
    assert round_walk([(hits, tops)], 2, 0.5, budget=100) == (6, [(2, 2), (1, 1), (2, 2)])
    # sibling_depth 2: a sibling round with room for two tokens drafts children (2 steps, 2m tokens) and emits
    # three tokens where the target's token is a sibling and hits[1] holds: 0 -> 3 -> 6
    assert round_walk([(hits, tops, rank)], 2, 0.95, budget=100, siblings=2, sibling_depth=2) == (6, [(2, 4)] * 2)
    missed = hits.clone()
    missed[1, 0] = 0  # the child of the round from 0 misses: 0 -> 2 -> 5 (rank 1 at 2, its child hits) -> 6
    assert round_walk([(missed, tops, rank)], 2, 0.95, budget=100, siblings=2, sibling_depth=2) == (6, [(2, 4)] * 3)
    # no room for two tokens (budget 2): a plain sibling round
    assert round_walk([(hits, tops, rank)], 2, 0.95, budget=2, siblings=2, sibling_depth=2) == (2, [(1, 2)])
    with pytest.raises(ValueError, match="sibling_depth"):
        round_walk([(hits, tops, rank)], 2, 0.95, budget=100, sibling_depth=2)
    with pytest.raises(ValueError, match="ranks"):
        round_walk([(hits, tops)], 2, 0.5, budget=100, siblings=2)
    with pytest.raises(ValueError, match="siblings"):
        round_walk([(hits, tops, rank)], 2, 0.5, budget=100, siblings=1)


def test_gated_walk_refuses_bad_input():
    with pytest.raises(ValueError, match="depths"):
        gated_walk([(torch.ones(1, 3), torch.ones(1, 3))], 2, 0.5, budget=8)
    with pytest.raises(ValueError, match="0/1"):
        gated_walk([(torch.full((2, 3), 0.5), torch.ones(2, 3))], 2, 0.5, budget=8)
    with pytest.raises(ValueError, match="threshold"):
        gated_walk([(torch.ones(2, 3), torch.ones(2, 3))], 2, 1.5, budget=8)


def test_round_walk_with_lookup_by_hand_and_its_errors() -> None:
    """A round of 2 hits reads the copy table at n + 2: 3 proposed, 2 matched -> 5 tokens emitted (2 drafts, 2 lookup,
    the bonus) and 5 tokens drafted; a miss keeps the lookup rows' cost and nothing of them."""
    from draftsmith.pairing.depth import round_walk
    from draftsmith.pairing.validate import ValidateConfig

    T = 10
    hits, tops = torch.ones(2, T, dtype=torch.float64), torch.ones(2, T, dtype=torch.float64)
    proposed, matched = [3] * (T + 1), [2] * (T + 1)
    assert round_walk([(hits, tops)], 2, 0.0, budget=T, lookup=3, copies=[(proposed, matched)]) == (
        T, [(2, 5), (2, 4)])  # the second round, from new token 5, has room for 2 lookup tokens, not 3
    hits[0, 0] = 0.0
    n, rounds = round_walk([(hits, tops)], 2, 0.0, budget=T, lookup=3, copies=[(proposed, matched)])
    assert n == T and rounds[0] == (2, 5)  # the first draft missed: one token, the rows paid for
    with pytest.raises(ValueError, match="copies"):
        round_walk([(hits, tops)], 2, 0.0, budget=T, lookup=3)
    with pytest.raises(ValueError, match="lookup must list"):
        ValidateConfig(lookup=[-1])


def test_a_recorded_policy_reads_back_as_the_same_policy() -> None:
    """race.json records each draft's policy (`KPolicy.to_dict`); validate serves it from there (`KPolicy.from_dict`)."""
    from draftsmith.decode.speculative import KPolicy
    for p in [KPolicy(k=8, confidence=0.7, siblings=2, lookup=4), KPolicy(k=3), KPolicy(k=20, k_max=20),
              KPolicy(k=6, confidence=0.6, siblings=3, sibling_depth=2)]:
        back = KPolicy.from_dict(p.to_dict())
        assert back.to_dict() == p.to_dict() and back.k_max >= back.k and not back.dynamic
