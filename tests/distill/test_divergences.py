"""The divergences against float64 brute force, their invariants (zero on identical inputs, TVD = 1 - beta),
masking (all-masked gives 0, not NaN), exact gradient accumulation, and the top-k teacher cache."""

import math

import pytest
import torch

from draftsmith.decode.sampling import SamplingParams, to_probs
from draftsmith.distill.divergences import (
    DIVERGENCES,
    LOG_FLOOR,
    VocabMismatchError,
    align_vocab,
    divergence_sum,
    jsd,
    token_mean,
    topk_teacher_logits,
)
from draftsmith.pairing import acceptance

F64 = torch.float64
B, T, V = 2, 3, 7
# (name, kwargs): every divergence, JSD at three mixtures
CASES = [("fkl", {}), ("rkl", {}), ("tvd", {})] + [("jsd", {"beta": b}) for b in (0.1, 0.5, 0.9)]
CASE_IDS = [f"{n}{kw.get('beta', '')}" for n, kw in CASES]


def rand_logits(seed: int, shape=(B, T, V), scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(shape, generator=g, dtype=F64)


def rand_mask(seed: int, shape=(B, T)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < 0.6
    mask.view(-1)[0] = True  # at least one position counts
    return mask


# -- brute force: one position at a time, Python floats ----------------------------------------------------


def brute_softmax(row: list[float], temp: float) -> list[float]:
    z = [x / temp for x in row]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    return [x / sum(e) for x in e]


def floored_log(x: float) -> float:
    return max(math.log(x), LOG_FLOOR) if x > 0 else LOG_FLOOR


def brute_position(name: str, q: list[float], p: list[float], beta: float = 0.5) -> float:
    if name == "fkl":
        return sum(pi * (math.log(pi) - floored_log(qi)) for pi, qi in zip(p, q) if pi > 0)
    if name == "rkl":
        return sum(qi * (math.log(qi) - floored_log(pi)) for pi, qi in zip(p, q) if qi > 0)
    if name == "tvd":
        return 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q))
    total = 0.0
    for pi, qi in zip(p, q):
        m = beta * pi + (1 - beta) * qi
        if pi > 0:
            total += beta * pi * math.log(pi / m)
        if qi > 0:
            total += (1 - beta) * qi * math.log(qi / m)
    return total


def brute_total(name, student, teacher, mask, temp=1.0, beta=0.5) -> tuple[float, int]:
    total, count = 0.0, 0
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            if mask[b, t]:
                q = brute_softmax(student[b, t].tolist(), temp)
                p = brute_softmax(teacher[b, t].tolist(), temp)
                total += brute_position(name, q, p, beta)
                count += 1
    return total, count


# -- values ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temp", [1.0, 0.7])
@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_matches_brute_force(name, kw, temp):
    s, t, mask = rand_logits(1), rand_logits(2), rand_mask(3)
    total, count = divergence_sum(name, s, t, mask, temperature=temp, **kw)
    want, n = brute_total(name, s, t, mask, temp, kw.get("beta", 0.5))
    assert int(count) == n == int(mask.sum())
    assert total.dtype == F64
    assert float(total) == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_topk_teacher_matches_brute_force_and_stays_finite(name, kw):
    s, mask = rand_logits(4).requires_grad_(), rand_mask(5)
    top = torch.log_softmax(rand_logits(6), dim=-1).topk(3, dim=-1)
    t = topk_teacher_logits(top.values, top.indices, V)  # -inf outside the top 3
    assert torch.isneginf(t).sum() == B * T * (V - 3)
    total, _ = divergence_sum(name, s, t, mask, temperature=0.7, **kw)
    want, _ = brute_total(name, s.detach(), t, mask, 0.7, kw.get("beta", 0.5))
    assert math.isfinite(total.item())
    assert total.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    total.backward()
    assert torch.isfinite(s.grad).all()


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_gradients_match_finite_differences(name, kw):
    t, mask = rand_logits(7), rand_mask(8)
    s = rand_logits(9).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: divergence_sum(name, x, t, mask, temperature=0.7, **kw)[0], (s,))


def test_topk_at_full_vocab_is_the_full_teacher():
    s, t, mask = rand_logits(10), rand_logits(11), rand_mask(12)
    top = torch.log_softmax(t, dim=-1).topk(V, dim=-1)
    rebuilt = topk_teacher_logits(top.values, top.indices, V)
    for name, kw in CASES:
        for temp in (1.0, 0.7):
            full, _ = divergence_sum(name, s, t, mask, temperature=temp, **kw)
            cached, _ = divergence_sum(name, s, rebuilt, mask, temperature=temp, **kw)
            assert float(cached) == pytest.approx(float(full), rel=1e-12, abs=1e-12), (name, kw, temp)


# -- invariants -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_zero_on_identical_inputs(name, kw):
    x, mask = rand_logits(13), torch.ones(B, T, dtype=torch.bool)
    top = torch.log_softmax(x, dim=-1).topk(3, dim=-1)
    x_topk = topk_teacher_logits(top.values, top.indices, V)
    for same in (x, x_topk):  # also with -inf entries on both sides (0 log 0 = 0)
        total, count = divergence_sum(name, same.clone().requires_grad_(), same, mask, temperature=0.7, **kw)
        assert int(count) == B * T
        assert abs(total.item()) < 1e-12
        if name != "tvd":  # |p - q| has no gradient at p = q; its subgradient 0 is what torch gives
            same = same.clone().requires_grad_()
            divergence_sum(name, same, same.detach(), mask, **kw)[0].backward()
            assert torch.isfinite(same.grad).all() and same.grad.abs().max() < 1e-12


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_non_negative_per_position_and_tvd_at_most_one(name, kw):
    for seed, scale in [(14, 1.0), (15, 5.0), (16, 20.0)]:
        s, t = rand_logits(seed, scale=scale), rand_logits(seed + 100, scale=scale)
        for pos in range(B * T):
            one = torch.zeros(B * T, dtype=torch.bool)
            one[pos] = True
            total, _ = divergence_sum(name, s, t, one.view(B, T), **kw)
            assert float(total) >= -1e-15
            if name == "tvd":
                assert float(total) <= 1.0 + 1e-15


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_tvd_is_one_minus_acceptance(temp):
    s, t = rand_logits(17), rand_logits(18)
    params = SamplingParams(temperature=temp)
    beta_t = torch.minimum(to_probs(t, params), to_probs(s, params)).sum(-1)  # (B, T): sum min(p, q)
    for pos in range(B * T):
        one = torch.zeros(B * T, dtype=torch.bool)
        one[pos] = True
        total, _ = divergence_sum("tvd", s, t, one.view(B, T), temperature=temp)
        assert float(total) == pytest.approx(1.0 - float(beta_t.view(-1)[pos]), abs=1e-12)
    mask = rand_mask(19)
    total, count = divergence_sum("tvd", s, t, mask, temperature=temp)
    alpha = beta_t[mask].mean()
    assert float(token_mean(total, count)) == pytest.approx(1.0 - float(alpha), abs=1e-12)


def test_tvd_agrees_with_pairing_beta():
    s, t = rand_logits(20).view(-1, V), rand_logits(21).view(-1, V)
    beta_t = acceptance.beta(t, s, SamplingParams(temperature=1.0))  # (N,)
    total, count = divergence_sum("tvd", s, t, torch.ones(B * T, dtype=torch.bool))
    assert float(token_mean(total, count)) == pytest.approx(1.0 - float(beta_t.mean()), abs=1e-12)


def test_jsd_limits_are_the_scaled_kls():
    s, t, mask = rand_logits(22), rand_logits(23), rand_mask(24)
    fkl, _ = divergence_sum("fkl", s, t, mask)
    rkl, _ = divergence_sum("rkl", s, t, mask)
    lo, hi = 1e-8, 1 - 1e-8  # the error is O(beta) (resp. O(1 - beta)) times a chi-square, plus rounding
    assert float(jsd(s, t, mask, beta=lo)[0]) / lo == pytest.approx(float(fkl), rel=1e-4)
    assert float(jsd(s, t, mask, beta=hi)[0]) / (1 - hi) == pytest.approx(float(rkl), rel=1e-4)


# -- masking and accumulation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_all_masked_gives_zero_not_nan(name, kw):
    s, t = rand_logits(25).requires_grad_(), rand_logits(26)
    total, count = divergence_sum(name, s, t, torch.zeros(B, T, dtype=torch.bool), **kw)
    assert total.item() == 0.0 and int(count) == 0
    loss = token_mean(total, count)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(s.grad, torch.zeros_like(s))


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_masked_positions_never_leak(name, kw):
    """Garbage (NaN, all -inf) at padding positions changes neither the value nor the gradient."""
    s, t, mask = rand_logits(27), rand_logits(28), rand_mask(29)
    s_bad, t_bad = s.clone(), t.clone()
    s_bad[~mask] = float("nan")
    t_bad[~mask] = float("-inf")
    s_bad.requires_grad_()
    s = s.clone().requires_grad_()
    clean, _ = divergence_sum(name, s, t, mask, **kw)
    dirty, _ = divergence_sum(name, s_bad, t_bad, mask, **kw)
    assert dirty.item() == clean.item()
    clean.backward()
    dirty.backward()
    assert torch.equal(s_bad.grad, s.grad)
    for as_numbers in (mask.long(), mask.double()):  # 0/1 masks mean the same as bool ones
        assert divergence_sum(name, s, t, as_numbers, **kw)[0].item() == clean.item()


@pytest.mark.parametrize("name,kw", CASES, ids=CASE_IDS)
def test_gradient_accumulation_is_exact(name, kw):
    """Micro-batches of uneven token counts, each normalised by the GLOBAL count, equal one big batch."""
    hidden, H = rand_logits(30, shape=(4, 5, 6)), 6
    teacher = rand_logits(31, shape=(4, 5, V))
    mask = rand_mask(32, shape=(4, 5))
    mask[0] = True
    mask[3, 1:] = False  # micro-batches hold 5 + k and 1 + k' tokens: per-batch means would not add up
    student = torch.nn.Linear(H, V, dtype=F64)
    with torch.no_grad():
        student.weight.copy_(rand_logits(33, shape=(V, H), scale=0.5))
        student.bias.copy_(rand_logits(34, shape=(V,), scale=0.5))

    total, count = divergence_sum(name, student(hidden), teacher, mask, temperature=0.7, **kw)
    token_mean(total, count).backward()
    want = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()

    global_count = mask.sum()
    for rows in (slice(0, 1), slice(1, 4)):
        total, _ = divergence_sum(name, student(hidden[rows]), teacher[rows], mask[rows], temperature=0.7, **kw)
        (total / global_count).backward()
    for got, expect in zip((p.grad for p in student.parameters()), want):
        torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)


def test_low_precision_inputs_are_upcast():
    s, t, mask = rand_logits(33), rand_logits(34), rand_mask(35)
    for name, kw in CASES:
        exact, _ = divergence_sum(name, s, t, mask, **kw)
        half, _ = divergence_sum(name, s.bfloat16(), t.bfloat16(), mask, **kw)
        assert half.dtype == torch.float32
        assert float(half) == pytest.approx(float(exact), rel=0.05, abs=0.02)


# -- vocabularies and arguments ---------------------------------------------------------------------------------


def test_vocab_mismatch_is_an_actionable_error():
    s, t, mask = rand_logits(36, shape=(B, T, V)), rand_logits(37, shape=(B, T, V + 2)), rand_mask(38)
    with pytest.raises(ValueError, match=r"student vocab 7 vs teacher 9: distillation needs the same tokenizer"):
        divergence_sum("fkl", s, t, mask)
    with pytest.raises(VocabMismatchError, match="align_vocab"):
        divergence_sum("tvd", s, t, mask)


def test_align_vocab_drops_padding_rows():
    s, t, mask = rand_logits(39, shape=(B, T, V)), rand_logits(40, shape=(B, T, V + 2)), rand_mask(41)
    for a, b in (align_vocab(s, t), align_vocab(t, s)[::-1]):
        assert a.shape[-1] == b.shape[-1] == V
        assert torch.equal(a, s) and torch.equal(b, t[..., :V])
        total, _ = divergence_sum("fkl", a, b, mask)
        assert float(total) == pytest.approx(brute_total("fkl", s, t[..., :V], mask)[0], rel=1e-12)
    s_big = rand_logits(42, shape=(1, 1, 200))
    t_small = rand_logits(43, shape=(1, 1, 200 - 128))
    assert align_vocab(s_big, t_small)[0].shape[-1] == 72  # exactly 128 padding rows is allowed
    with pytest.raises(VocabMismatchError, match="129 rows"):
        align_vocab(s_big, t_small[..., :-1])


def test_bad_arguments_name_the_problem():
    s, t, mask = rand_logits(44), rand_logits(45), rand_mask(46)
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        divergence_sum("kl", s, t, mask)
    for beta in (0.0, 1.0):
        with pytest.raises(ValueError, match="beta must be in"):
            divergence_sum("jsd", s, t, mask, beta=beta)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        divergence_sum("tvd", s, t, mask, temperature=0.0)
    with pytest.raises(ValueError, match="mask"):
        divergence_sum("rkl", s, t, mask[:, :2])
    with pytest.raises(ValueError, match="k=8"):
        topk_teacher_logits(torch.zeros(8), torch.arange(8), V)
    assert set(DIVERGENCES) == {"fkl", "rkl", "jsd", "tvd"}
