"""Lookup tokens: what followed the last time the sequence's last few tokens occurred (prompt lookup).

    from draftsmith.decode.lookup import continuation
    continuation([5, 6, 7, 1, 5, 6], limit=3)     # -> [7, 1, 5]: after the earlier "5 6" came 7, 1, 5

Code and structured answers repeat what they have read (names, signatures, whole lines), so the tokens that
followed an earlier occurrence of the sequence's last n tokens are often the next ones. A chain round appends
them after its drafts at no draft cost (`KPolicy(lookup=L)`, decode.speculative): each is a proposal with all its
probability on one token, verified by the same rule as the drafts, so the output stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 4  # the longest suffix looked for
MIN_NGRAM = 2  # the shortest: one token repeats too often to predict what follows


def continuation(seq: Sequence[int], *, limit: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> list[int]:
    """Up to `limit` tokens that followed the most recent earlier occurrence of the longest suffix of `seq` of
    n = max_n .. min_n tokens; [] when no such suffix occurred before (or `limit` is 0). An occurrence may overlap
    the suffix itself (a repeating pattern goes on)."""
    if limit < 0 or not 1 <= min_n <= max_n:
        raise ValueError(f"need limit >= 0 and 1 <= min_n <= max_n, got {limit}, {min_n}, {max_n}")
    L = len(seq)
    if not limit:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        key = list(seq[L - n :])
        for start in range(L - n - 1, -1, -1):  # occurrences ending before the suffix's end, latest first
            if seq[start] == key[0] and list(seq[start : start + n]) == key:
                return list(seq[start + n : start + n + limit])
    return []


def copy_table(prompt: Sequence[int], cont: Sequence[int], limit: int) -> tuple[list[int], list[int]]:
    """For a reference (prompt ids, the target's continuation), at every new-token position i = 0..len(cont):
    how many tokens `continuation(prompt + cont[:i])` proposes (up to `limit`) and how many of them lead cont[i:]
    (the tokens the target accepts there at temperature 0). A round whose drafts were all the target's tokens
    reads these at the position after its drafts (`pairing.depth.round_walk`)."""
    seq = list(prompt) + list(cont)
    P, proposed, matched = len(prompt), [], []
    for i in range(len(cont) + 1):
        prop = continuation(seq[: P + i], limit=limit)
        m = 0
        while m < len(prop) and i + m < len(cont) and prop[m] == cont[i + m]:
            m += 1
        proposed.append(len(prop))
        matched.append(m)
    return proposed, matched
