"""A draft's teacher-forced rounds on held-out references: what validation walks to choose its round policy.

    from draftsmith.pairing.head_rounds import depth_records, standalone_records
    records = depth_records(head, held_rows, max_k, ranks=True)   # -> pairing.policy.choose_policy(records=...)
    records = standalone_records(runner, [(prompt_ids, reference_ids)], max_k, vocab=V, ranks=True)

The head is unrolled on its own outputs (`decode.head.ttt_hidden`, the forward training unrolls too), so depth j
of a round reads what decoding feeds it. Rows are the head data format (`distill.heads.data`): prompt_len,
tokens, features (the target's hidden states at the head's layers) and next (the target's greedy token).
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.decode.head import Eagle3Head, ttt_hidden
from draftsmith.decode.sampling import fit_vocab, greedy_token

def depth_records(head: Eagle3Head, rows: list[dict], depth: int, *, ranks: bool = False) -> list[tuple[Tensor, ...]]:
    """Per row, the head's teacher-forced rounds from every new token, for `pairing.depth.gated_walk`: hits
    (depth, T) 1 where the token the head drafts at depth j of the round whose first draft is new token n equals
    the target's greedy one, tops (depth, T) the head's probability of it (softmax over its vocabulary, as the
    decoder's confidence check reads it); 0 where that token lies past the row. Depth j of that round is entry
    prompt_len - 2 + n + j - 1 at unroll depth j (`ttt_hidden`). Rows with a one-token prompt give none (the
    decoder drafts nothing before the target has read a token). `ranks` adds a third entry for sibling rounds
    (`pairing.depth.round_walk`): (T,) how many draft tokens the head ranks above the target's at depth 1 (N,
    the draft vocabulary's size, where the target's token lies outside it)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    N = head.config.draft_vocab_size
    draft_id = torch.full((head.config.vocab_size,), N, dtype=torch.long)  # N: outside the draft vocabulary
    draft_id[head.draft_ids.cpu()] = torch.arange(N)
    out = []
    with torch.no_grad():
        for row in rows:
            P, T = row["prompt_len"], len(row["tokens"]) - row["prompt_len"]
            if P < 2 or T < 1:
                continue
            hits, tops = torch.zeros(depth, T, dtype=torch.float64), torch.zeros(depth, T, dtype=torch.float64)
            rank = torch.zeros(T, dtype=torch.long)
            for j, h in enumerate(ttt_hidden(head, row["features"], row["tokens"], depth), start=1):
                n = torch.arange(0, T - j + 1)  # the depth-j token is new token n + j - 1 < T
                e = P - 2 + n + j - 1
                probs = torch.softmax(head.lm_head(head.norm(h[e])).float(), dim=-1)
                top, idx = probs.max(-1)
                want = row["next"][e + 1].long()
                hits[j - 1, n] = (head.draft_ids[idx] == want).double()
                tops[j - 1, n] = top.double()
                if j == 1 and ranks:
                    d = draft_id[want]
                    above = (probs > probs.gather(1, d.clamp(max=N - 1)[:, None])).sum(-1)
                    rank[n] = torch.where(d < N, above, torch.full_like(above, N))
            out.append((hits, tops, rank) if ranks else (hits, tops))
    if not out:
        raise ValueError("no row has a prompt of >= 2 tokens and a continuation to take rounds from")
    return out


@torch.no_grad()
def standalone_records(runner, refs: list[tuple[list[int], list[int]]], depth: int, *, vocab: int,
                       ranks: bool = False) -> list[tuple[Tensor, ...]]:
    """`depth_records` for a standalone draft, from references (prompt ids, the target's greedy continuation):
    one forward of the draft over prompt + continuation, as the decoder runs it (`runner`: int8, pruned; its
    logits fitted to the target's `vocab`), its greedy token and that token's probability at every position.
    Depth j of the round whose first draft is new token n reads position P + n + j - 2. While a round's earlier
    drafts were the target's tokens that is the very context the decoder's draft sees, so the tokens each round
    accepts, where it stops early before its first miss and the sibling ranks are the decoder's (at temperature
    0 the walk's tokens and rounds are its count); past a miss the probabilities are the teacher-forced ones,
    which changes only how many more tokens such a round is predicted to draft (its cost), not what it yields."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    out = []
    for prompt, cont in refs:
        P, T = len(prompt), len(cont)
        if P < 1 or T < 1:
            continue
        seq = torch.tensor(list(prompt) + list(cont))
        logits = fit_vocab(runner.forward(seq[:-1], 0).float(), vocab)  # row i: the draft's guess at seq[i + 1]
        probs = torch.softmax(logits, dim=-1)
        idx = greedy_token(logits)
        top = probs.gather(1, idx[:, None])[:, 0]
        hits, tops = torch.zeros(depth, T, dtype=torch.float64), torch.zeros(depth, T, dtype=torch.float64)
        for j in range(1, min(depth, T) + 1):
            n = torch.arange(0, T - j + 1)  # the depth-j token is new token n + j - 1 < T
            e = P + n + j - 2
            hits[j - 1, n] = (idx[e] == seq[e + 1]).double()
            tops[j - 1, n] = top[e].double()
        if ranks:
            e = torch.arange(P - 1, P + T - 1)
            rank = (probs[e] > probs[e, seq[e + 1]][:, None]).sum(-1)
            out.append((hits, tops, rank))
        else:
            out.append((hits, tops))
    if not out:
        raise ValueError("no reference has a prompt and a continuation to take rounds from")
    return out
