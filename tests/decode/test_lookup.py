"""Lookup tokens: the pure search against brute force, and the decoder's contract with lookup rounds."""

import itertools
import random

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.lookup import continuation, copy_table
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.speculative import KPolicy, generate, parse_policy_label, policy_label
from tests.decode.test_speculative import chi2_pvalue, target_sequence_law, tiny_hf

SLOW = pytest.mark.slow  # the default suite keeps one case of each law; `pytest -m slow` runs the rest


def brute_continuation(seq: list[int], limit: int, min_n: int, max_n: int) -> list[int]:
    """Every suffix length from the longest, every earlier start from the latest: the first match wins."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(seq):
            continue
        starts = [s for s in range(len(seq) - n) if seq[s : s + n] == seq[len(seq) - n :]]
        if starts:
            s = max(starts)
            return seq[s + n : s + n + limit]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_continuation_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        seq = [rng.randrange(1 + seed % 4 + 1) for _ in range(rng.randrange(0, 30))]
        limit, min_n = rng.randrange(0, 6), rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 3)
        assert continuation(seq, limit=limit, min_n=min_n, max_n=max_n) == brute_continuation(seq, limit, min_n, max_n)


def test_continuation_examples_and_errors() -> None:
    assert continuation([5, 6, 7, 1, 5, 6], limit=3) == [7, 1, 5]
    assert continuation([5, 6, 7, 1, 5, 6], limit=0) == []
    assert continuation([1, 2, 3, 4], limit=3) == []  # no suffix of 2..4 tokens occurred before
    assert continuation([1, 2, 9, 1, 2, 8, 1, 2], limit=1) == [8]  # the latest occurrence
    assert continuation([3, 1, 2, 4, 9, 1, 2, 5, 3, 1, 2], limit=1) == [4]  # the longest suffix first
    assert continuation([7, 7, 7], limit=4) == [7]  # overlapping: "7 7" at 0 is followed by one 7
    with pytest.raises(ValueError):
        continuation([1, 2], limit=-1)
    with pytest.raises(ValueError):
        continuation([1, 2], limit=1, min_n=3, max_n=2)


def test_copy_table_reads_continuation_at_every_position() -> None:
    prompt, cont = [1, 2, 3, 4, 1, 2], [3, 4, 9, 1, 2, 3]
    proposed, matched = copy_table(prompt, cont, 3)
    assert len(proposed) == len(matched) == len(cont) + 1
    for i in range(len(cont) + 1):
        prop = continuation(prompt + cont[:i], limit=3)
        m = next((j for j in range(len(prop)) if i + j >= len(cont) or prop[j] != cont[i + j]), len(prop))
        assert (proposed[i], matched[i]) == (len(prop), m)
    assert (proposed[0], matched[0]) == (3, 2)  # proposes 3 4 1; the target wrote 3 4 9


def test_policy_label_round_trips_lookup() -> None:
    p = KPolicy(k=6, confidence=0.6, siblings=2, lookup=4)
    assert policy_label(p) == "K=6 stop<0.6 siblings=2 lookup=4"
    assert parse_policy_label(policy_label(p)) == KPolicy(k=6, k_max=16, confidence=0.6, siblings=2, lookup=4)
    with pytest.raises(DraftsmithError, match="lookup must be >= 0"):
        KPolicy(lookup=-1)
    with pytest.raises(DraftsmithError, match="lookup=L"):
        parse_policy_label("K=4 lookup=x")


REPEATING = [[1, 5, 7, 9, 1, 5, 7, 9, 1, 5], [3, 4, 3, 4, 3], [2, 2, 2, 2, 2, 2, 8, 2]]


@pytest.mark.parametrize("seed,vocab", [(0, 61), (1, 7)])
def test_greedy_equals_target_greedy_with_lookup(seed: int, vocab: int) -> None:
    """Greedy with lookup tokens after every chain (also after rounds that stop early, with sibling rounds and
    with a draft that never agrees) equals the target's greedy decode; the counts add up."""
    target_hf = tiny_hf(seed, vocab)
    target = make_runner(target_hf, 128)
    drafts = {"other": make_runner(tiny_hf(seed + 100, vocab, layers=1), 128), "same": make_runner(target_hf, 128)}
    looked = 0
    for prompt in REPEATING:
        prompt = [t % vocab for t in prompt]
        ref = generate(target, prompt, max_new_tokens=30).tokens
        for (name, draft), k, L in itertools.product(drafts.items(), (1, 3), (1, 4)):
            for policy in (KPolicy(k=k, lookup=L), KPolicy(k=k, confidence=0.5, siblings=2, lookup=L)):
                out = generate(target, prompt, draft=draft, max_new_tokens=30, policy=policy)
                assert out.tokens == ref, (name, k, L, prompt)
                s = out.stats
                assert s.lookup_accepted <= s.looked_up <= s.drafted and s.lookup_accepted <= s.accepted
                assert s.new_tokens == 30 and sum(t * c for t, c in s.tau_hist.items()) >= 30
                looked += s.looked_up
    assert looked > 0  # lookup tokens were proposed (the repeating prompts and tiny vocabularies see to it)


def test_lookup_tokens_are_accepted_where_the_target_repeats_itself() -> None:
    """A target that continues a repeating prompt by repeating it: lookup tokens are accepted and each round
    emits more than the chain alone could."""
    hf = tiny_hf(5, vocab=7, scale=8.0)
    target = make_runner(hf, 256)
    prompt = [1, 2, 3]
    ref = generate(target, prompt, max_new_tokens=60).tokens
    # the target's own greedy text as the prompt: its second pass repeats the first
    out = generate(target, prompt + ref, draft=make_runner(tiny_hf(6, vocab=7, layers=1), 256), max_new_tokens=40,
                   policy=KPolicy(k=1, lookup=6))
    assert out.tokens == generate(target, prompt + ref, max_new_tokens=40).tokens
    assert out.stats.lookup_accepted > 0
    assert max(out.stats.tau_hist) > 2  # a round of one draft emitted more than 2 tokens


def test_lookup_never_proposes_past_the_budget() -> None:
    hf = tiny_hf(7, vocab=5)
    target = make_runner(hf, 24)  # room for the prompt and 12 new tokens, not one position more
    prompt = [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2]
    out = generate(target, prompt, draft=make_runner(hf, 24), max_new_tokens=12, policy=KPolicy(k=2, lookup=16))
    assert out.tokens == generate(target, prompt, max_new_tokens=12).tokens


V, N_NEW = 4, 3
LAW_PROMPT = [3, 0, 3, 1, 3, 2, 3, 3]  # every pair "3 x" occurred: whatever follows a 3, lookup proposes


def lookup_counts(target, draft, prompt, params, n, seed, policy) -> dict:
    g = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(n):
        out = generate(target, prompt, draft=draft, max_new_tokens=N_NEW, sampling=params, policy=policy, generator=g)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    return counts


def law_check(params: SamplingParams, n: int = 3000):
    """The tiny law pair decoding LAW_PROMPT n times with one draft token and 2 lookup tokens a round:
    (target, draft, the chi-square p-value of the outputs against the target's exact law)."""
    t_hf, d_hf = tiny_hf(20, vocab=V, layers=1, scale=8.0), tiny_hf(21, vocab=V, layers=1, scale=8.0)
    target, draft = make_runner(t_hf, 32), make_runner(d_hf, 32)
    law = target_sequence_law(t_hf, LAW_PROMPT, params)
    counts = lookup_counts(target, draft, LAW_PROMPT, params, n, 0, KPolicy(k=1, lookup=2))
    return target, draft, chi2_pvalue(counts, law, n)


@pytest.mark.parametrize("params", [SamplingParams(1.0), pytest.param(SamplingParams(0.8, top_k=3), marks=SLOW)])
def test_sampled_output_law_with_lookup(params: SamplingParams) -> None:
    """Chi-square over the 64 continuations, n = 3000 draws (power as in test_speculative: a total-variation
    error of 0.1 is detected with power > 0.99 at level 1e-3); the prompt holds every pair "3 x", so a round
    whose draft follows a 3 always has lookup tokens to propose. The negative control below must fail the same
    test."""
    target, draft, pvalue = law_check(params)
    assert pvalue > 1e-3
    g, stats = torch.Generator().manual_seed(1), []
    for _ in range(50):
        stats.append(generate(target, LAW_PROMPT, draft=draft, max_new_tokens=N_NEW, sampling=params,
                              policy=KPolicy(k=1, lookup=2), generator=g).stats)
    assert sum(s.looked_up for s in stats) > 20 and sum(s.lookup_accepted for s in stats) > 5  # the law saw them


def test_a_lookup_token_verified_as_if_drafted_uniformly_fails_the_law_test(monkeypatch) -> None:
    """Negative control: lookup tokens checked against a uniform law (as if drawn from it; they were not) bias
    the output, and the law test above rejects it."""
    import draftsmith.decode.speculative as spec

    monkeypatch.setattr(spec, "lookup_q", lambda tokens, V, like: list(like.new_full((len(tokens), V), 1.0 / V)))
    assert law_check(SamplingParams(1.0))[2] < 1e-6


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_pruned_draft_with_context_ids_and_lookup_equals_the_target(quantize) -> None:
    """The recipe's kind of draft (pruned, context ids, int8) with lookup rounds: greedy equals the target's decode
    and the draft keeps reading what lookup rounds accepted (several tokens fed at once)."""
    from draftsmith.decode.pruned import PrunedRunner

    V = 61
    t_hf = tiny_hf(4, vocab=V, dtype=torch.float32)
    target = make_runner(t_hf, 128)
    kept = torch.arange(0, V, 2)
    looked = 0
    for prompt, k, L in itertools.product(REPEATING, (1, 4), (2, 6)):
        draft = PrunedRunner(make_runner(tiny_hf(4, vocab=V, dtype=torch.float32), 128, quantize=quantize), kept,
                             context=True)
        ref = generate(target, prompt, max_new_tokens=30).tokens
        for policy in (KPolicy(k=k, lookup=L), KPolicy(k=k, confidence=0.6, siblings=2, lookup=L)):
            out = generate(target, prompt, draft=draft, max_new_tokens=30, policy=policy)
            assert out.tokens == ref, (prompt, k, L)
            looked += out.stats.lookup_accepted
    assert looked > 0


def test_sampled_output_law_with_a_pruned_draft_and_lookup() -> None:
    from draftsmith.decode.pruned import PrunedRunner

    params, n = SamplingParams(1.0), 3000
    t_hf, d_hf = tiny_hf(20, vocab=V, layers=1, scale=8.0), tiny_hf(21, vocab=V, layers=1, scale=8.0)
    target = make_runner(t_hf, 32)
    draft = PrunedRunner(make_runner(d_hf, 32), torch.tensor([0, 2]), context=True)
    law = target_sequence_law(t_hf, LAW_PROMPT, params)
    counts = lookup_counts(target, draft, LAW_PROMPT, params, n, 0, KPolicy(k=2, lookup=2))
    assert chi2_pvalue(counts, law, n) > 1e-3


@pytest.mark.parametrize("N", [None, 30])
def test_a_head_with_lookup_tokens_equals_the_target(N) -> None:
    """A draft head reads the target's features of every accepted row, lookup tokens included: greedy equals the
    target's decode, lookup tokens are accepted, and the sampled law holds."""
    from draftsmith.decode.head import HeadDraft
    from tests.decode.test_head import mimic_head, random_head, target_hf

    hf = target_hf(0)
    target = make_runner(hf, 256)
    accepted = 0
    for start in REPEATING:
        prompt = start + generate(target, start, max_new_tokens=20).tokens
        ref = generate(target, prompt, max_new_tokens=30).tokens
        for head, k, L in itertools.product((random_head(hf, N), mimic_head(hf, N)), (1, 3), (2, 6)):
            out = generate(target, prompt, draft=HeadDraft(head, 256), max_new_tokens=30, policy=KPolicy(k=k, lookup=L))
            assert out.tokens == ref, (k, L, prompt)
            accepted += out.stats.lookup_accepted
    assert accepted > 0


def test_sampled_output_law_with_a_head_and_lookup() -> None:
    from tests.decode.test_head import law_pair

    params, n = SamplingParams(1.0), 3000
    hf, target, draft = law_pair(3)
    law = target_sequence_law(hf, LAW_PROMPT, params)
    counts = lookup_counts(target, draft, LAW_PROMPT, params, n, 0, KPolicy(k=2, lookup=2))
    assert chi2_pvalue(counts, law, n) > 1e-3
