"""A head's teacher-forced rounds (`pairing.head_rounds.depth_records`): walked as the decoder walks them, they
give the decoder's own count at temperature 0."""

from __future__ import annotations

import pytest
import torch

from decode.head import HeadDraft
from tests.decode.test_head import random_head, target_hf


@pytest.mark.parametrize("K,threshold,siblings,depth", [
    (1, 0.0, 0, 1), (2, 0.0, 0, 1), (3, 0.0, 0, 1), (2, 0.5, 0, 1), (3, 0.3, 0, 1), (4, 0.9, 0, 1), (1, 0.9, 2, 1),
    (2, 0.7, 2, 1), (3, 0.95, 3, 1), (2, 0.7, 2, 2), (3, 0.95, 3, 2), (2, 0.9999, 3, 2)])
def test_walking_depth_records_gives_the_decoders_own_rounds(K, threshold, siblings, depth) -> None:
    """At temperature 0 the walk over the head's teacher-forced records is the decoder's count: the same number
    of tokens, the same drafts and draft steps in every round (stopping early, sibling rounds and their children
    included), the same tau."""
    from decode.runner import make_runner
    from decode.speculative import KPolicy, RoundClock, generate
    from pairing.head_rounds import depth_records
    from pairing.depth import round_walk
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
    from pairing.head_rounds import depth_records

    hf = target_hf(3, layers=4)
    head = random_head(hf, N=40, seed=4, scale=4.0)
    row = {"tokens": torch.tensor([5, 7]), "features": torch.zeros(2, 3 * hf.config.hidden_size),
           "next": torch.tensor([1, 2]), "prompt_len": 1}
    with pytest.raises(ValueError, match="continuation"):
        depth_records(head, [row], 2)
