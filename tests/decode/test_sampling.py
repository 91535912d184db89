"""The sampling math against brute force in float64, and the accept/reject rule's exact output law."""

import itertools
import math

import pytest
import torch

from draftsmith.decode.sampling import (
    SamplingParams,
    accept_probability,
    greedy_token,
    residual,
    sample,
    to_probs,
    verify,
    verify_greedy,
)

@pytest.fixture(autouse=True)
def float64_by_default():
    """Brute force in float64; restored afterwards so other test modules keep float32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def brute_probs(logits: list[float], T: float, top_k: int, top_p: float) -> list[float]:
    """Temperature, then top-k, then top-p, written the slow obvious way."""
    z = [l / T for l in logits]
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    keep = set(order[:top_k]) if top_k else set(order)
    # top-k keeps ties with the k-th value too (a threshold rule)
    if top_k:
        kth = z[order[top_k - 1]]
        keep = {i for i in range(len(z)) if z[i] >= kth}
    m = max(z)
    e = [math.exp(z[i] - m) if i in keep else 0.0 for i in range(len(z))]
    s = sum(e)
    p = [x / s for x in e]
    if top_p < 1.0:
        order = sorted(range(len(p)), key=lambda i: -p[i])
        kept, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.add(i)
            mass += p[i]
        p = [p[i] if i in kept else 0.0 for i in range(len(p))]
        s = sum(p)
        p = [x / s for x in p]
    return p


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8), (0.9, 5, 0.6)])
def test_to_probs_matches_brute_force(T: float, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(9, generator=g, dtype=torch.float64) * 2
        got = to_probs(logits, SamplingParams(T, top_k, top_p))
        want = torch.tensor(brute_probs(logits.tolist(), T, top_k, top_p))
        assert torch.allclose(got, want, atol=1e-12), (got, want)


def test_greedy_is_one_hot_argmax_lowest_id_on_ties() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    assert int(greedy_token(logits)) == 1
    assert to_probs(logits, SamplingParams(0.0)).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_residual_and_accept_probability_brute_force() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        p = torch.rand(7, generator=g).softmax(0)
        q = (torch.rand(7, generator=g) * 3).softmax(0)
        r = residual(p, q)
        raw = [max(0.0, a - b) for a, b in zip(p.tolist(), q.tolist())]
        assert torch.allclose(r, torch.tensor([x / sum(raw) for x in raw]), atol=1e-14)
        for x in range(7):
            assert float(accept_probability(p[x], q[x])) == pytest.approx(min(1.0, float(p[x] / q[x])))


def test_residual_of_equal_distributions_is_p() -> None:
    p = torch.tensor([0.25, 0.25, 0.5])
    assert torch.equal(residual(p, p.clone()), p)


def test_one_step_rule_reproduces_p_exactly() -> None:
    """Enumerate the draft's choice x ~ q: P(emit y) = q(y) a(y) + P(reject) r(y) must equal p(y)."""
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        p = (torch.randn(6, generator=g) * 2).softmax(0)
        q = (torch.randn(6, generator=g) * 2).softmax(0)
        a = accept_probability(p, q)
        p_reject = float((q * (1 - a)).sum())
        out = q * a + p_reject * residual(p, q)
        assert torch.allclose(out, p, atol=1e-14)


def _verify_law_chi2(verify_fn, n: int = 6000) -> float:
    """Chi-square statistic p-value for the first emitted token of verify_fn vs p (K = 2, V = 4)."""
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])
    counts = torch.zeros(4)
    for _ in range(n):
        d = torch.stack([sample(q[0], g), sample(q[1], g)])
        n_acc, nxt = verify_fn(p, q, d, g)
        first = int(d[0]) if n_acc >= 1 else nxt
        counts[first] += 1
    expected = p[0] * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor(1.5), torch.tensor(stat / 2)))  # df = 3


def test_verify_first_token_follows_p_and_the_test_has_power() -> None:
    # With n = 6000 draws the chi-square test at level 1e-3 rejects a TV error of 0.06 with power > 0.99;
    # the broken rule below (accept every draft) is off by TV 0.3 and must be rejected.
    assert _verify_law_chi2(verify) > 1e-3

    def accept_all(p, q, d, g):
        return d.shape[0], int(sample(p[-1], g))

    assert _verify_law_chi2(accept_all) < 1e-6


def test_verify_greedy() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    assert verify_greedy(logits, torch.tensor([1, 0])) == (2, 2)
    assert verify_greedy(logits, torch.tensor([1, 2])) == (1, 0)
    assert verify_greedy(logits, torch.tensor([0, 0])) == (0, 1)
    assert verify_greedy(logits[:1], torch.tensor([], dtype=torch.long)) == (0, 1)


def test_sampling_params_validated() -> None:
    for bad in (dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_exhaustive_tiny_enumeration_of_verify_law() -> None:
    """Exact law of (n_accepted, next) for K = 2 on V = 3, enumerating both draft tokens, vs sampling p twice."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]])
    q = torch.tensor([[0.2, 0.2, 0.6], [0.6, 0.3, 0.1]])
    V = 3
    law = torch.zeros(V, V)  # joint law of the first two emitted tokens
    for d0, d1 in itertools.product(range(V), range(V)):
        w = q[0, d0] * q[1, d1]
        a0 = accept_probability(p[0, d0], q[0, d0])
        a1 = accept_probability(p[1, d1], q[1, d1])
        # rejected at 0: first ~ residual0, second would come from the next round, i.e. ~ p[1] given first
        # (here p[1] does not depend on the first token: a context-free toy, so the product law applies)
        law += w * (1 - a0) * residual(p[0], q[0])[:, None] * p[1][None, :]
        law[d0] += w * a0 * (1 - a1) * residual(p[1], q[1])
        law[d0, d1] += w * a0 * a1
    assert torch.allclose(law, p[0][:, None] * p[1][None, :], atol=1e-14)


def test_sample_is_the_inverse_cdf_and_follows_the_law() -> None:
    # brute force: the draw for uniform u is the first token whose cumulative probability exceeds u * total
    p = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    u = torch.rand(2, 1, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    got = sample(p, g)
    for row in range(2):
        cdf = p[row].cumsum(0)
        assert int(got[row]) == next(i for i in range(5) if cdf[i] > u[row, 0] * cdf[-1])
    # the law: n = 20000 draws, chi-square at 1e-3 has power > 0.99 against a TV error of 0.03; a sampler
    # that swaps two tokens' probabilities (TV 0.25) must be rejected (negative control)
    n = 20000
    draws = sample(p[0].expand(n, 5), torch.Generator().manual_seed(5))
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[0] == 0 and counts[2] == 0  # probability 0 is never drawn

    def pvalue(expected_p: torch.Tensor) -> float:
        keep = expected_p > 0
        e = expected_p[keep] * n
        stat = float(((counts[keep] - e) ** 2 / e).sum())
        return float(torch.special.gammaincc(torch.tensor(1.0), torch.tensor(stat / 2)))  # df = 2

    assert pvalue(p[0]) > 1e-3
    assert pvalue(torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25], dtype=torch.float64)) < 1e-6
