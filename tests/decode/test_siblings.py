"""Sibling rounds: several candidates for one position, verified as a tree. Exact at temperature 0 and above."""

from __future__ import annotations

import itertools

import pytest
import torch

import draftsmith.decode.speculative
from draftsmith.decode.head import HeadDraft
from draftsmith.decode.runtime.lean import LeanLM
from draftsmith.decode.runtime.runner import HFRunner, make_runner
from draftsmith.decode.sampling import SamplingParams, candidate_acceptance, verify_candidates, verify_candidates_greedy
from draftsmith.decode.speculative import KPolicy, RoundClock, generate
from tests.decode.test_head import law_pair, mimic_head, random_head, target_hf
from tests.decode.test_speculative import Disagree, chi2_pvalue, target_sequence_law, tiny_hf

SLOW = pytest.mark.slow  # the default suite keeps one case of each law; `pytest -m slow` runs the rest

PROMPTS = [[1, 5, 7, 9], [3], [2, 2, 2, 2, 2, 2, 8]]


# --- the candidate check: pure math against brute force -------------------------------------------------


def implied_law(p: torch.Tensor, candidates: list[int]) -> torch.Tensor:
    """The output law of checking `candidates` in turn, by summing over the paths (float64)."""
    accept, rest = candidate_acceptance(p, torch.tensor(candidates))
    law, alive = torch.zeros_like(p), 1.0
    for a, c in zip(accept.tolist(), candidates):
        law[c] += alive * a
        alive *= 1.0 - a
    return law + alive * rest


@pytest.mark.parametrize("seed,m", [(0, 1), (1, 2), (2, 3), (3, 5), (4, 7)])
def test_checking_candidates_in_turn_samples_p_exactly(seed: int, m: int) -> None:
    g = torch.Generator().manual_seed(seed)
    V = 7
    p = torch.rand(V, generator=g, dtype=torch.float64) ** 3
    p[torch.randperm(V, generator=g)[:2]] = 0.0  # impossible tokens, which may also be candidates
    p /= p.sum()
    for cands in itertools.islice(itertools.permutations(range(V), m), 40):
        assert torch.allclose(implied_law(p, list(cands)), p, atol=1e-12, rtol=0), cands


def test_a_wrong_rule_fails_the_brute_force_check() -> None:
    """Negative control: accepting a candidate with p(c) (no renormalisation after a rejection) is not p's law."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    law, alive = torch.zeros(3, dtype=torch.float64), 1.0
    for c in (0, 1):
        law[c] += alive * p[c]
        alive *= 1.0 - float(p[c])
    law[2] += alive  # the residual after both
    assert not torch.allclose(law, p, atol=1e-3)


def test_candidates_must_be_distinct_and_greedy_picks_the_argmax() -> None:
    with pytest.raises(ValueError, match="distinct"):
        candidate_acceptance(torch.tensor([0.5, 0.5]), torch.tensor([1, 1]))
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])  # ties -> lowest id, as greedy_token
    assert verify_candidates_greedy(logits, torch.tensor([2, 1])) == (1, 1)
    assert verify_candidates_greedy(logits, torch.tensor([2, 3])) == (-1, 1)


def test_verify_candidates_draws_p() -> None:
    """Empirical check of the sampler itself (n = 20000, 4 cells: detects a TV error of 0.02 with power > 0.99
    at level 1e-3); it never accepts a candidate p gives 0."""
    p = torch.tensor([0.1, 0.4, 0.0, 0.5], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n, counts = 20000, torch.zeros(4)
    for _ in range(n):
        i, tok = verify_candidates(p, torch.tensor([2, 3]), g)
        counts[tok] += 1
        assert i == (1 if tok == 3 else -1)
    expected = p * n
    stat = float(((counts - expected)[p > 0] ** 2 / expected[p > 0]).sum())
    assert counts[2] == 0 and float(torch.special.gammaincc(torch.tensor(1.0), torch.tensor(stat / 2))) > 1e-3


# --- the target's tree forward ----------------------------------------------------------------------------


@pytest.mark.parametrize("parents", [[-1, 0, 0], [-1, 0, 0, 0], [-1, 0, 1, 0, 3], [-1, 0, 1, 2]])
def test_tree_rows_equal_their_own_paths_and_keep_path_leaves_a_plain_cache(parents: list[int]) -> None:
    hf = tiny_hf(30)
    tree, ref = LeanLM(hf, 64), LeanLM(hf, 64)
    prefix = torch.tensor([3, 1, 4, 1, 5])
    tokens = torch.tensor([9, 2, 6, 5, 3][: len(parents)])
    tree.forward(prefix, 0)
    logits = tree.forward_tree(tokens, 5, parents)
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        paths.append(path)
        ref.forward(prefix, 0)
        alone = ref.forward(tokens[path], 5)[-1]
        assert torch.allclose(logits[i], alone, atol=1e-12, rtol=0), (parents, i)
    leaf = paths[-1]
    tree.keep_path(5, leaf)
    nxt = torch.tensor([7])
    ref.forward(torch.cat([prefix, tokens[leaf]]), 0)
    assert torch.allclose(tree.forward(nxt, 5 + len(leaf)), ref.forward(nxt, 5 + len(leaf)), atol=1e-12, rtol=0)


def test_tree_forward_refuses_bad_parents() -> None:
    runner = LeanLM(tiny_hf(31), 16)
    for bad in ([0, 0], [-1, 1], [-1, 0, 2], [-1]):
        with pytest.raises(ValueError, match="parents"):
            runner.forward_tree(torch.tensor([1, 2]), 0, bad)


# --- the decoder ------------------------------------------------------------------------------------------


def sibling_policies() -> list[KPolicy]:
    return [KPolicy(k=k, confidence=c, siblings=m) for k, c, m in
            [(1, 0.5, 2), (2, 0.7, 2), (3, 0.9, 3), (2, 0.999, 2), (4, 0.3, 4)]]


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_target_greedy_with_sibling_rounds(seed: int) -> None:
    """Standalone drafts (one that agrees often, one that never does) and heads (random, mimic)."""
    t_hf, d_hf = tiny_hf(seed, scale=8.0), tiny_hf(seed, scale=8.0)
    with torch.no_grad():
        d_hf.lm_head.weight.add_(torch.randn_like(d_hf.lm_head.weight) * 0.3)
    target = make_runner(t_hf, 128)
    h_hf = target_hf(seed, mix=0.0)
    h_target = make_runner(h_hf, 128)
    for prompt, policy in itertools.product(PROMPTS, sibling_policies()):
        ref = generate(target, prompt, max_new_tokens=30).tokens
        for draft in (make_runner(d_hf, 128), Disagree(make_runner(t_hf, 128))):
            assert generate(target, prompt, draft=draft, max_new_tokens=30, policy=policy).tokens == ref, policy
        h_ref = generate(h_target, prompt, max_new_tokens=30).tokens
        for head in (random_head(h_hf, 30, seed=seed), mimic_head(h_hf)):
            out = generate(h_target, prompt, draft=HeadDraft(head, 128), max_new_tokens=30, policy=policy)
            assert out.tokens == h_ref, policy


def test_sibling_rounds_accept_the_second_choice_and_count_what_they_propose() -> None:
    """A draft whose second choice is always the target's: every sibling round is accepted through the tree's
    second row, so the KV move runs each round; chains of one would accept nothing."""

    class SecondBest(Disagree):  # the target's logits with its top token pushed just below its runner-up
        def forward(self, tokens, pos, keep=0):
            logits = self.runner.forward(tokens, pos, keep).clone()
            top2 = logits.topk(2, dim=-1)
            logits.scatter_(-1, top2.indices[..., :1], top2.values[..., 1:] - 1e-3)
            return logits

    t_hf = tiny_hf(3, scale=8.0)
    target = make_runner(t_hf, 128)
    prompt = [1, 5, 7]
    ref = generate(target, prompt, max_new_tokens=24).tokens
    clock = RoundClock()
    out = generate(target, prompt, draft=SecondBest(make_runner(t_hf, 128)), max_new_tokens=24, clock=clock,
                   policy=KPolicy(k=2, confidence=0.999999, siblings=3))
    assert out.tokens == ref
    sib = [r for r in clock.rounds if r[0]]
    assert sib and all(r[0] == 3 and r[4] == 1 for r in sib)  # three tokens proposed in one draft step
    assert out.stats.accepted == len(sib) and out.stats.drafted == 3 * len(sib)  # each through the second row


def sibling_law_pair():
    """law_pair's target (V = 4) with a flat head over 3 of its ids: its top probability stays below 0.9, so
    every round that drafts is a sibling round."""
    hf, target, _ = law_pair(3)
    return hf, target, HeadDraft(random_head(hf, N=3, seed=21, scale=1.0), 32)


@pytest.mark.parametrize("params,m", [(SamplingParams(1.0), 2), (SamplingParams(0.7, top_k=3), 3)])
def test_sampled_output_law_with_sibling_rounds(params: SamplingParams, m: int) -> None:
    """Chi-square over all 64 continuations of 3 tokens (V = 4), n = 3000 draws, as for chains (the power is
    stated there)."""
    n = 3000
    hf, target, draft = sibling_law_pair()
    law = target_sequence_law(hf, [1, 3], params)
    counts, drafted = sibling_counts(target, draft, params, n, m)
    assert drafted == {m}  # every drafting round was a sibling round
    assert chi2_pvalue(counts, law, n) > 1e-3


def test_a_sibling_check_that_always_accepts_fails_the_law_test(monkeypatch) -> None:
    """Negative control: accepting the head's first candidate every time (its own top token) must fail."""
    params, n = SamplingParams(1.0), 1000
    hf, target, draft = sibling_law_pair()
    law = target_sequence_law(hf, [1, 3], params)
    monkeypatch.setattr(draftsmith.decode.speculative, "verify_candidates", lambda p, cands, g: (0, int(cands[0])))
    assert chi2_pvalue(sibling_counts(target, draft, params, n, 2)[0], law, n) < 1e-6


def sibling_counts(target, draft, params, n, m, depth: int = 1) -> tuple[dict, set]:
    from tests.decode.test_speculative import N_NEW

    g = torch.Generator().manual_seed(0)
    counts: dict = {}
    clock = RoundClock()
    policy = KPolicy(k=2, confidence=0.9, siblings=m, sibling_depth=depth)
    for _ in range(n):
        out = generate(target, [1, 3], draft=draft, max_new_tokens=N_NEW, sampling=params, policy=policy, generator=g,
                       clock=clock)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    return counts, {r[0] for r in clock.rounds if r[0]}


def test_policy_and_runner_checks() -> None:
    with pytest.raises(ValueError, match="siblings"):
        KPolicy(k=2, siblings=2)  # no confidence threshold
    with pytest.raises(ValueError, match="siblings"):
        KPolicy(k=2, confidence=0.5, siblings=1)
    hf = tiny_hf(5)
    with pytest.raises(ValueError, match="forward_tree"):
        generate(HFRunner(hf, 64), [1, 2], draft=make_runner(hf, 64), max_new_tokens=4,
                 policy=KPolicy(k=2, confidence=0.5, siblings=2))


# --- sibling_depth 2: each sibling also gets the head's next token ---------------------------------------


def test_forward_siblings_equals_one_candidate_at_a_time() -> None:
    hf = target_hf(4, mix=0.5)
    target = make_runner(hf, 64)
    draft = HeadDraft(random_head(hf, 30, seed=4, scale=3.0), 64)
    target.capture_layers = draft.capture_layers
    seq = [1, 5, 7, 9, 11]
    target.forward(torch.tensor(seq[:-1]), 0)
    draft.observe(target.last_hidden, torch.tensor(seq[:-1]), 0)
    draft.forward(torch.tensor(seq[-2:]), 3, keep=1)  # drafts position 5: entries 0..3 in its cache
    cands = torch.tensor([2, 40, 17])
    together = draft.forward_siblings(cands, 5)
    assert together.shape == (3, hf.config.vocab_size)
    for i, c in enumerate(cands.tolist()):  # one at a time, each recomputing entry 4 with its own token
        alone = draft.forward(torch.tensor([c]), 5, keep=1)
        assert torch.allclose(together[i], alone[0], atol=1e-12, rtol=0)
    assert not torch.allclose(together[0], together[1])  # the candidates differ: a test that can fail
    with pytest.raises(ValueError, match="forward_siblings"):
        draft.forward_siblings(cands, 7)  # the head drafted 5, not 7


def children_policies() -> list[KPolicy]:
    return [KPolicy(k=k, confidence=c, siblings=m, sibling_depth=2) for k, c, m in
            [(2, 0.7, 2), (3, 0.9, 3), (2, 0.999, 2), (4, 0.3, 4), (1, 0.999, 3)]]


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_target_greedy_with_children(seed: int) -> None:
    h_hf = target_hf(seed, mix=0.0)
    h_target = make_runner(h_hf, 128)
    for prompt, policy in itertools.product(PROMPTS, children_policies()):
        h_ref = generate(h_target, prompt, max_new_tokens=30).tokens
        for head in (random_head(h_hf, 30, seed=seed), mimic_head(h_hf)):
            clock = RoundClock()
            out = generate(h_target, prompt, draft=HeadDraft(head, 128), max_new_tokens=30, policy=policy, clock=clock)
            assert out.tokens == h_ref, policy
            if policy.k >= 2 and policy.confidence > 0.99:  # every drafting round with room for two branches
                assert any(r[4] == 2 and r[0] == 2 * policy.siblings for r in clock.rounds)


def test_children_are_accepted_through_the_tree_and_counted() -> None:
    """A mimic head on a bigram target agrees with it at depth 1 often: under a threshold no draft reaches,
    every round is a sibling round with children, and some accept three tokens (sibling, child, bonus)."""
    h_hf = target_hf(2, mix=0.0)
    target = make_runner(h_hf, 128)
    prompt = [1, 5, 7]
    ref = generate(target, prompt, max_new_tokens=40).tokens
    clock = RoundClock()
    out = generate(target, prompt, draft=HeadDraft(mimic_head(h_hf), 128), max_new_tokens=40, clock=clock,
                   policy=KPolicy(k=2, confidence=0.999999, siblings=3, sibling_depth=2))
    assert out.tokens == ref
    assert out.stats.tau_hist.get(3, 0) > 0  # children accepted
    drafted = [r for r in clock.rounds if r[0]]
    assert all(r[0] in (3, 6) for r in drafted) and sum(r[0] == 6 for r in drafted) > 0
    assert out.stats.drafted == sum(r[0] for r in drafted)


@pytest.mark.parametrize("params,m", [(SamplingParams(1.0), 2),
                                      pytest.param(SamplingParams(0.7, top_k=3), 3, marks=SLOW)])
def test_sampled_output_law_with_children(params: SamplingParams, m: int) -> None:
    """As for sibling rounds (3000 draws, chi-square over all 64 continuations of 3 tokens, V = 4); the first
    round of each draw has room for two tokens and drafts children."""
    n = 3000
    hf, target, draft = sibling_law_pair()
    law = target_sequence_law(hf, [1, 3], params)
    counts, drafted = sibling_counts(target, draft, params, n, m, depth=2)
    assert 2 * m in drafted  # children were drafted
    assert chi2_pvalue(counts, law, n) > 1e-3


def test_a_child_check_that_always_accepts_fails_the_law_test(monkeypatch) -> None:
    """Negative control: the siblings checked honestly, a child (a candidate list of one) always accepted."""
    params, n = SamplingParams(1.0), 1000
    hf, target, draft = sibling_law_pair()
    law = target_sequence_law(hf, [1, 3], params)
    honest = draftsmith.decode.speculative.verify_candidates
    monkeypatch.setattr(draftsmith.decode.speculative, "verify_candidates",
                        lambda p, cands, g: (0, int(cands[0])) if cands.numel() == 1 else honest(p, cands, g))
    assert chi2_pvalue(sibling_counts(target, draft, params, n, 2, depth=2)[0], law, n) < 1e-6


def test_children_need_a_draft_that_drafts_after_siblings() -> None:
    with pytest.raises(ValueError, match="sibling_depth"):
        KPolicy(k=2, sibling_depth=2)  # no siblings
    with pytest.raises(ValueError, match="sibling_depth"):
        KPolicy(k=2, confidence=0.5, siblings=2, sibling_depth=3)
    hf = tiny_hf(5)
    with pytest.raises(ValueError, match="forward_siblings"):
        generate(make_runner(hf, 64), [1, 2], draft=make_runner(hf, 64), max_new_tokens=4,
                 policy=KPolicy(k=2, confidence=0.5, siblings=2, sibling_depth=2))
