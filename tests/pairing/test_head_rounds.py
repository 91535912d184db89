"""A head's teacher-forced rounds (`pairing.head_rounds.depth_records`): walked as the decoder walks them, they
give the decoder's own count at temperature 0."""

from __future__ import annotations

import pytest
import torch

from draftsmith.decode.head import HeadDraft
from tests.decode.test_head import random_head, target_hf


@pytest.mark.parametrize("K,threshold,siblings,depth", [
    (1, 0.0, 0, 1), (2, 0.0, 0, 1), (3, 0.0, 0, 1), (2, 0.5, 0, 1), (3, 0.3, 0, 1), (4, 0.9, 0, 1), (1, 0.9, 2, 1),
    (2, 0.7, 2, 1), (3, 0.95, 3, 1), (2, 0.7, 2, 2), (3, 0.95, 3, 2), (2, 0.9999, 3, 2)])
def test_walking_depth_records_gives_the_decoders_own_rounds(K, threshold, siblings, depth) -> None:
    """At temperature 0 the walk over the head's teacher-forced records is the decoder's count: the same number
    of tokens, the same drafts and draft steps in every round (stopping early, sibling rounds and their children
    included), the same tau."""
    from draftsmith.decode.runtime.runner import make_runner
    from draftsmith.decode.speculative import KPolicy, RoundClock, generate
    from draftsmith.pairing.head_rounds import depth_records
    from draftsmith.pairing.depth import round_walk
    from tests.decode.test_head import mimic_head

    hf = target_hf(5, mix=0.0)  # a bigram target, which the mimic head often agrees with
    head = mimic_head(hf)
    target = make_runner(hf, 128)
    budget = 24
    for prompt in ([1, 5, 7, 9], [3, 8], [11, 2, 4, 6, 8, 10]):
        ref = generate(target, prompt, max_new_tokens=40).tokens  # the held-out reference, longer than the budget
        tokens = torch.tensor(prompt + ref)
        with torch.no_grad():
            out = hf(input_ids=tokens[None], output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i][0] for i in head.config.aux_layers], dim=-1)
        row = {"tokens": tokens, "features": feats, "next": out.logits[0].argmax(-1), "prompt_len": len(prompt)}
        n, rounds = round_walk(depth_records(head, [row], K, ranks=True), K, threshold, budget=budget,
                               siblings=siblings, sibling_depth=depth)
        clock = RoundClock()
        res = generate(target, prompt, draft=HeadDraft(head, 128), max_new_tokens=budget, clock=clock,
                       policy=KPolicy(k=K, confidence=threshold or None, siblings=siblings, sibling_depth=depth))
        assert res.tokens == ref[:budget] and n == budget
        assert rounds == [(r[4], r[0]) for r in clock.rounds], (prompt, K, threshold)
        assert res.stats.accepted > 0 and res.stats.mean_tau == budget / len(rounds)
    if siblings:  # sibling rounds were walked, not only chains (with children where asked)
        assert any(r[0] == depth * siblings and r[4] == depth for r in clock.rounds)


def test_depth_records_refuse_rows_without_rounds() -> None:
    from draftsmith.pairing.head_rounds import depth_records

    hf = target_hf(3, layers=4)
    head = random_head(hf, N=40, seed=4, scale=4.0)
    row = {"tokens": torch.tensor([5, 7]), "features": torch.zeros(2, 3 * hf.config.hidden_size),
           "next": torch.tensor([1, 2]), "prompt_len": 1}
    with pytest.raises(ValueError, match="continuation"):
        depth_records(head, [row], 2)


def _noisy_copy(hf, seed: int, noise: float):
    """A draft that agrees with `hf` often, not always: its weights with relative Gaussian noise."""
    import copy

    draft = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(noise * w.abs().mean() * torch.randn(w.shape, generator=g, dtype=w.dtype))
    return draft


@pytest.mark.parametrize("K,threshold,siblings", [
    (1, 0.0, 0), (2, 0.0, 0), (4, 0.0, 0), (2, 0.5, 0), (3, 0.3, 0), (4, 0.9, 0), (1, 0.9, 2), (2, 0.7, 2),
    (3, 0.95, 3)])
def test_walking_a_standalone_drafts_records_gives_the_decoders_tokens_and_rounds(K, threshold, siblings) -> None:
    """`standalone_records`: at temperature 0 the walk yields the decoder's tokens in the decoder's number of
    rounds, each round the same kind (sibling or chain); a chain round drafts what the decoder drafts up to its
    first miss (past it only the predicted count of drafts, the cost, may differ)."""
    from draftsmith.decode.runtime.runner import make_runner
    from draftsmith.decode.speculative import KPolicy, RoundClock, generate
    from draftsmith.pairing.depth import round_walk
    from draftsmith.pairing.head_rounds import standalone_records

    hf = target_hf(5, mix=0.3)
    target, draft = make_runner(hf, 128), make_runner(_noisy_copy(hf, 1, 0.15), 128)
    budget, hit_rates, differ = 24, [], 0
    for prompt in ([1, 5, 7, 9], [3], [11, 2, 4, 6, 8, 10]):
        ref = generate(target, prompt, max_new_tokens=40).tokens  # the held-out reference, longer than the budget
        records = standalone_records(draft, [(prompt, ref)], K, vocab=61, ranks=True)
        hit_rates.append(float(records[0][0][0].mean()))
        n, rounds = round_walk(records, K, threshold, budget=budget, siblings=siblings)
        clock = RoundClock()
        res = generate(target, prompt, draft=draft, max_new_tokens=budget, clock=clock,
                       policy=KPolicy(k=K, confidence=threshold or None, siblings=siblings))
        assert res.tokens == ref[:budget] and n == budget
        assert len(rounds) == len(clock.rounds) and res.stats.mean_tau == budget / len(rounds)
        assert [s for s, _ in rounds] == [r[4] for r in clock.rounds] or K > 1  # one draft step a round at K = 1
        assert [d == siblings for _, d in rounds] == [r[0] == siblings and r[4] == 1 for r in clock.rounds] or not siblings
        differ += sum(d != r[0] for (_, d), r in zip(rounds, clock.rounds))
    assert 0.2 < sum(hit_rates) / len(hit_rates) < 0.95  # the draft is right often, not always: the walk is tested
    if K == 1 or threshold == 0.0:
        assert differ == 0  # fixed rounds and K = 1 never read a probability past a miss


@pytest.mark.parametrize("K,threshold,siblings", [(3, 0.0, 0), (3, 0.5, 0), (2, 0.7, 2)])
def test_the_walk_of_a_pruned_draft_with_context_ids_is_the_decoders(K, threshold, siblings) -> None:
    """The same for a draft pruned to ids the target mostly does not write, with context ids: the walk's one
    teacher-forced forward proposes, row by row, what the decoder's draft steps propose (the kept ids and the ones
    read so far), so it yields the decoder's tokens in the decoder's rounds."""
    from draftsmith.decode.pruned import PrunedRunner
    from draftsmith.decode.runtime.runner import make_runner
    from draftsmith.decode.speculative import KPolicy, RoundClock, generate
    from draftsmith.pairing.depth import round_walk
    from draftsmith.pairing.head_rounds import standalone_records

    hf = target_hf(5, mix=0.3)
    target = make_runner(hf, 128)
    kept = torch.arange(0, 61, 3)  # a third of the vocabulary
    budget = 24
    for prompt in ([1, 5, 7, 9], [11, 2, 4, 6, 8, 10]):
        draft = PrunedRunner(make_runner(_noisy_copy(hf, 1, 0.15), 128), kept, context=True)
        ref = generate(target, prompt, max_new_tokens=40).tokens
        records = standalone_records(draft, [(prompt, ref)], K, vocab=61, ranks=True)
        n, rounds = round_walk(records, K, threshold, budget=budget, siblings=siblings)
        clock = RoundClock()
        res = generate(target, prompt, draft=draft, max_new_tokens=budget, clock=clock,
                       policy=KPolicy(k=K, confidence=threshold or None, siblings=siblings))
        assert res.tokens == ref[:budget] and n == budget and len(rounds) == len(clock.rounds)
        assert any(t % 3 for t in ref[:budget])  # the target writes ids outside the kept ones


@pytest.mark.parametrize("K,threshold,siblings,lookup", [(1, 0.0, 0, 3), (3, 0.0, 0, 2), (3, 0.5, 0, 4),
                                                          (2, 0.1, 2, 4)])
def test_the_walk_with_lookup_tokens_is_the_decoders(K, threshold, siblings, lookup) -> None:
    """Lookup rounds (`KPolicy.lookup`) walked on `copy_table`s: the decoder's tokens in the decoder's rounds, and
    lookup tokens accepted in both."""
    from draftsmith.decode.lookup import copy_table
    from draftsmith.decode.runtime.runner import make_runner
    from draftsmith.decode.speculative import KPolicy, RoundClock, generate
    from draftsmith.pairing.depth import round_walk
    from draftsmith.pairing.head_rounds import standalone_records

    hf = target_hf(5, mix=0.3)
    target, draft = make_runner(hf, 256), make_runner(_noisy_copy(hf, 1, 0.05), 256)
    budget, accepted, walked_extra = 24, 0, 0
    for start in ([1, 5, 7, 9], [11, 2, 4, 6, 8, 10]):
        prompt = start + generate(target, start, max_new_tokens=30).tokens  # the target's text, read again
        ref = generate(target, prompt, max_new_tokens=40).tokens
        records = standalone_records(draft, [(prompt, ref)], K, vocab=61, ranks=True)
        copies = [copy_table(prompt, ref, lookup)]
        n, rounds = round_walk(records, K, threshold, budget=budget, siblings=siblings, lookup=lookup, copies=copies)
        plain = round_walk(records, K, threshold, budget=budget, siblings=siblings)
        clock = RoundClock()
        res = generate(target, prompt, draft=draft, max_new_tokens=budget, clock=clock,
                       policy=KPolicy(k=K, confidence=threshold or None, siblings=siblings, lookup=lookup))
        assert res.tokens == ref[:budget] and n == budget and len(rounds) == len(clock.rounds)
        accepted += res.stats.lookup_accepted
        walked_extra += sum(d - s for s, d in rounds)
        assert len(rounds) <= len(plain[1])
    assert accepted > 0 and walked_extra > 0  # lookup tokens were proposed in the walk and accepted in the decoder


def test_standalone_records_by_hand() -> None:
    """Depth j of the round from new token n reads the draft's row at P + n + j - 2; ranks count the ids the draft
    prefers to the target's token."""
    from draftsmith.pairing.head_rounds import standalone_records

    class Scripted:  # row i of its logits puts all weight on guesses[i], and a little on id 3
        vocab_size = 5

        def forward(self, tokens, pos, keep=0):
            rows = torch.full((len(tokens), 5), -9.0)
            rows[:, 3] = -1.0
            rows[torch.arange(len(tokens)), torch.tensor(guesses[: len(tokens)])] = 2.0
            return rows

    prompt, cont = [0, 1], [2, 4, 1]
    guesses = [9 % 5, 2, 4, 0]  # rows 0..3 guess seq[1..4] = 1?, 2, 4, 1: rows 1 and 2 are right, row 3 is not
    (hits, tops, rank), = standalone_records(Scripted(), [(prompt, cont)], 2, vocab=5, ranks=True)
    assert hits[0].tolist() == [1.0, 1.0, 0.0]  # new tokens 0, 1, 2 from rows 1, 2, 3
    assert hits[1].tolist() == [1.0, 0.0, 0.0]  # depth 2 from rows 2, 3 (none past the end)
    assert rank.tolist() == [0, 0, 2]  # row 3 prefers id 0, then id 3, to the target's 1
    assert tops[0, 0] == tops[0, 1] and 0.5 < float(tops[0, 0]) < 1 and tops[1, 2] == 0.0
