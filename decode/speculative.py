"""The speculative decoder (and, with no draft, the honest target-only baseline: same loop, K = 0).

One round: the draft proposes K tokens one by one; the target scores [current token, d_1..d_K] in one
forward (K+1 rows); `verify` keeps the longest accepted prefix and adds one token (corrected or bonus),
so each target forward emits tau = n_accepted + 1 tokens, 1 <= tau <= K+1. Both KV caches then roll
back to the accepted prefix, which for our runners is just a position.

Cache bookkeeping. `seq` is every token so far. The target cache always holds seq[:-1] (the last token
is fed next round). The draft cache holds seq[:d_len]; it may lag by one token after a fully accepted
round (d_K was sampled, never fed), so the next round feeds it seq[d_len:] (one or two tokens).

Temperature 0 never draws a random number: output equals the target's own greedy decode.

Sibling rounds (`KPolicy.siblings`): when the draft is unsure of its first token, the round proposes its m most
probable tokens for that one position instead, and the target scores [current token, c_1..c_m] as a tree (each
c_i sees the context and the current token, not the other candidates; `forward_tree`). The candidates are
checked in turn (`decode.sampling.verify_candidates`, exact at any temperature); an accepted c_i's KV moves next
to the current token's (`keep_path`) and its row gives the bonus token. On a CPU, where a verify of 3 rows costs
little more than one of 2, two siblings at depth 1 can beat a chain of two. With `sibling_depth` 2 (drafts that
have `forward_siblings`: heads) each candidate c_i also gets the draft's most probable next token e_i, drafted for
all of them in one more step, and the tree [current, c_1..c_m, e_1..e_m] is verified in one forward (2m + 1
rows): an accepted c_i's row checks e_i the same way (a candidate list of one), so a round emits up to 3 tokens.

Lookup tokens (`KPolicy.lookup`): a chain round may append, after its drafts, the tokens that followed the last
earlier occurrence of the sequence's last 2-4 tokens (`decode.lookup`), verified in the same forward. Each is a
proposal with all its probability on that token, so the same rule keeps the output exact; they cost a few
target rows and no draft step, and the draft reads the accepted ones next round (a feed of several tokens).

A draft head (`decode.head.HeadDraft`, `reads_target`) reads the target instead of running on its own: the
target keeps its hidden states at the head's layers, and after each target forward the accepted rows go to
the head (`observe`); the head then drafts as any draft does, feeding itself past them. The first round of a
one-token prompt drafts nothing (the target has not read a token yet).

In code, top to bottom: `generate` checks the call, `prefill`s both caches (a `DecodeState`: seq, d_len, k),
then loops `play_round` (a `chain_round`, whose draft phase is `draft_chain`, or a `sibling_round`, whose draft
phase is `draft_siblings`; each drafts, verifies, accepts and returns a `Round`) and `finish_round` (stats, the
budget and EOS cut, the next K). Each round function runs alone on a `DecodeState` and `RoundSettings`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.lookup import continuation
from draftsmith.decode.runtime.runner import HFRunner, Runner
from draftsmith.decode.sampling import (
    SamplingParams, fit_vocab, greedy_token, sample, to_probs, verify, verify_candidates, verify_candidates_greedy,
    verify_greedy,
)


def check_siblings(m: int) -> None:
    """Sibling rounds propose m = 0 (none) or m >= 2 first tokens: one is a plain round."""
    if m == 1 or m < 0:
        raise DraftsmithError(f"siblings must be 0 (never) or >= 2, got {m}")


def check_sibling_depth(depth: int, siblings: int) -> None:
    """Sibling rounds go 1 deep (the siblings) or 2 (each with the draft's next token); 2 needs siblings."""
    if depth not in (1, 2) or (depth == 2 and not siblings):
        raise DraftsmithError(f"sibling_depth must be 1, or 2 with siblings >= 2, got {depth}")


DEFAULT_K = 3  # draft tokens per round where nothing measured chooses K: the one default, everywhere
K_MAX = 16  # the decoder's ceiling for a dynamic K, and at least every fixed K


@dataclass(frozen=True)
class KPolicy:
    """How many tokens the draft proposes per round.

    Fixed `k`, or `dynamic`: grow by 2 after a fully accepted round, shrink by 1 after a rejection
    (within [k_min, k_max]). `confidence` (0..1) also stops a round early when the draft's top
    probability falls below it. `siblings` = m >= 2 (with `confidence`): a round whose first draft falls
    below it proposes the draft's m most probable tokens side by side instead, verified together as a tree
    (each reads the context, not the others; one draft step, m + 1 target rows), and at most one of them
    is accepted. It needs a target with `forward_tree` (the lean runner). `sibling_depth` = 2 gives each of
    them the draft's most probable next token too (a second draft step over the m of them, 2m + 1 target rows;
    drafts with `forward_siblings`, and rounds with room for two tokens). `lookup` = L > 0: a chain round appends
    up to L tokens after its drafts, those that followed the last earlier occurrence of the sequence's last few
    tokens (`decode.lookup.continuation`), verified in the same forward at no draft cost.
    """

    k: int = DEFAULT_K
    dynamic: bool = False
    k_min: int = 1
    k_max: int = K_MAX
    confidence: float | None = None
    siblings: int = 0
    sibling_depth: int = 1
    lookup: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k <= self.k_max:
            raise DraftsmithError(f"need 1 <= k_min <= k <= k_max, got {self.k_min}, {self.k}, {self.k_max}")
        if self.confidence is not None and not 0.0 <= self.confidence < 1.0:
            raise DraftsmithError(f"confidence must be in [0, 1), got {self.confidence}")
        check_siblings(self.siblings)
        if self.siblings and self.confidence is None:
            raise DraftsmithError(f"siblings ({self.siblings}) needs a confidence threshold to branch below")
        check_sibling_depth(self.sibling_depth, self.siblings)
        if self.lookup < 0:
            raise DraftsmithError(f"lookup must be >= 0 (tokens appended to a round), got {self.lookup}")

    @classmethod
    def fixed(cls, k: int, **kw) -> "KPolicy":
        """Rounds of `k` draft tokens, the decoder's ceiling room above (with any other setting of `kw`: confidence,
        siblings, sibling_depth, lookup; `dynamic=True` grows from `k`)."""
        return cls(k=k, k_max=max(K_MAX, k), **kw)

    def to_dict(self) -> dict:
        """The policy as result files record it: K, stop threshold, siblings and their depth, lookup tokens."""
        return {"k": self.k, "confidence": self.confidence, "siblings": self.siblings,
                "sibling_depth": self.sibling_depth, "lookup": self.lookup}

    @classmethod
    def from_dict(cls, d: dict) -> "KPolicy":
        """`to_dict`'s form back to the policy (fixed K)."""
        return cls.fixed(d["k"], confidence=d.get("confidence"), siblings=d.get("siblings", 0),
                         sibling_depth=d.get("sibling_depth", 1), lookup=d.get("lookup", 0))

    def next_k(self, k: int, n_accepted: int, proposed: int) -> int:
        if not self.dynamic:
            return k
        return min(k + 2, self.k_max) if n_accepted == proposed else max(k - 1, self.k_min)


@dataclass
class Stats:
    """Everything derives from the histogram of accepted lengths (tau counts the bonus token)."""

    tau_hist: dict[int, int] = field(default_factory=dict)  # tau -> number of target forwards
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    new_tokens: int = 0  # tokens returned (after EOS / budget truncation)
    prefill_seconds: float = 0.0
    seconds: float = 0.0  # wall time of the whole call, prefill included
    looked_up: int = 0  # of the drafted: lookup tokens appended to rounds (KPolicy.lookup)
    lookup_accepted: int = 0  # of the accepted: lookup tokens

    @property
    def target_forwards(self) -> int:
        return sum(self.tau_hist.values())

    @property
    def mean_tau(self) -> float:
        n = self.target_forwards
        return sum(t * c for t, c in self.tau_hist.items()) / n if n else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (the rate engines report); None without a draft."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def merge(self, other: "Stats") -> "Stats":
        hist = dict(self.tau_hist)
        for t, c in other.tau_hist.items():
            hist[t] = hist.get(t, 0) + c
        return Stats(
            dict(sorted(hist.items())), self.drafted + other.drafted, self.accepted + other.accepted,
            self.new_tokens + other.new_tokens, self.prefill_seconds + other.prefill_seconds,
            self.seconds + other.seconds, self.looked_up + other.looked_up,
            self.lookup_accepted + other.lookup_accepted,
        )

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "tokens_per_s": self.tokens_per_s,
            "target_forwards": self.target_forwards,
            "mean_tau": self.mean_tau,
            "tau_hist": {str(k): v for k, v in sorted(self.tau_hist.items())},
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "looked_up": self.looked_up,
            "lookup_accepted": self.lookup_accepted,
            "tau_definition": "tokens emitted per target forward, including the bonus/corrected token",
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Stats":
        """The inverse of `to_dict` (derived fields are recomputed, not read; records from before lookup rounds
        read as none looked up)."""
        return cls({int(t): int(c) for t, c in d["tau_hist"].items()}, int(d["drafted"]), int(d["accepted"]),
                   int(d["new_tokens"]), float(d["prefill_seconds"]), float(d["seconds"]),
                   int(d.get("looked_up", 0)), int(d.get("lookup_accepted", 0)))


@dataclass
class RoundClock:
    """Where a decode's time goes, round by round: hand one to `generate(..., clock=...)` (opt-in; on CUDA every
    mark synchronises the device, which costs a little). `pairing.cost.calibrate_decoder` reads it.

    rounds: (tokens drafted, draft seconds, verify seconds, round seconds, draft steps) per round; the verify
    forward is the target's over the drafted tokens + 1; the rest of a round (sampling and checking the target's
    rows, the caches' bookkeeping, a head reading the target's features) is round - draft - verify. Draft steps
    equal the tokens drafted except in sibling rounds (one step, m tokens)."""

    prefill_s: list[float] = field(default_factory=list)  # one per generate call
    rounds: list[tuple[int, float, float, float, int]] = field(default_factory=list)


@dataclass
class Result:
    tokens: list[int]  # the new tokens only
    stats: Stats


def policy_label(p: KPolicy) -> str:
    """A fixed-K policy as one line: 'K=8 stop<0.6 siblings=2 [children] [lookup=4]' (`parse_policy_label` reads
    it back)."""
    return (f"K={p.k}" + (f" stop<{p.confidence}" if p.confidence else "")
            + (f" siblings={p.siblings}" if p.siblings else "") + (" children" if p.sibling_depth == 2 else "")
            + (f" lookup={p.lookup}" if p.lookup else ""))


def parse_policy_label(label: str) -> KPolicy:
    """'K=8 stop<0.6 siblings=2 [children] [lookup=4]' (`policy_label`'s form) -> the KPolicy; a one-line
    DraftsmithError.
    (`grid --policy` and `bench --policy` take policies by these labels.)"""
    fields: dict = {}
    try:
        for part in label.split():
            if part.startswith("K="):
                fields["k"] = int(part[2:])
            elif part.startswith("stop<"):
                fields["confidence"] = float(part[5:])
            elif part.startswith("siblings="):
                fields["siblings"] = int(part[9:])
            elif part == "children":
                fields["sibling_depth"] = 2
            elif part.startswith("lookup="):
                fields["lookup"] = int(part[7:])
            else:
                raise ValueError(part)
        if "k" not in fields:
            raise ValueError("no K")
        return KPolicy.fixed(fields.pop("k"), **fields)
    except (ValueError, DraftsmithError) as e:
        raise DraftsmithError(f"policy {label!r}: expected 'K=N [stop<P] [siblings=M] [children] [lookup=L]' "
                              f"({e})") from None


def _ids(tokens: list[int], device: torch.device | str) -> Tensor:
    return torch.tensor(tokens, dtype=torch.long, device=device)


def _no_mark() -> float | None:
    return None


@dataclass
class DecodeState:
    """Where a decode stands between rounds. `seq` is every token so far; the target cache holds seq[:-1] (the
    last token is fed next round), the draft cache seq[:d_len]; `k` is the policy's K for the next round."""

    seq: list[int]
    d_len: int
    k: int = 0

    def advance(self, emitted: list[int]) -> None:
        """Append a round's tokens; the draft cache rolls back to the accepted prefix."""
        self.seq.extend(emitted)
        self.d_len = min(self.d_len, len(self.seq) - 1)


@dataclass(frozen=True)
class RoundSettings:
    """What every round of one `generate` call reads. `mark` is the clock: with a `RoundClock` it synchronises
    the device (CUDA) and returns the time; without one it does nothing and returns None."""

    sampling: SamplingParams = SamplingParams()
    policy: KPolicy = KPolicy()
    generator: torch.Generator | None = None
    device: torch.device | str = "cpu"
    mark: Callable[[], float | None] = _no_mark


@dataclass
class Round:
    """What one round did: `emitted` is the accepted drafts and the target's own next token (before the budget and
    EOS cut), `accepted` of the `drafted` tokens proposed in `steps` draft steps (`looked_up` of the drafted and
    `lookup_accepted` of the accepted are lookup tokens); `t_draft` and `t_verify` are the clock's marks after
    drafting and after the target's forward (None without a clock)."""

    emitted: list[int]
    accepted: int
    drafted: int
    steps: int
    t_draft: float | None = None
    t_verify: float | None = None
    looked_up: int = 0
    lookup_accepted: int = 0


@dataclass
class DraftStep:
    """One draft forward's last row: `logits` over the target's vocabulary, `q` the law a token is sampled from
    (None at temperature 0), `top` the draft's top probability (None when greedy and no threshold reads it)."""

    logits: Tensor
    q: Tensor | None
    top: float | None


def _head(draft: Runner | None):
    """The draft if it is a head that reads the target's features (`reads_target`), else None."""
    return draft if getattr(draft, "reads_target", False) else None


def prefill(target: Runner, draft: Runner | None, prompt_ids: list[int], device: torch.device | str) -> DecodeState:
    """Both caches take the prompt but its last token (a head reads the target's features of them instead; the
    target must already keep the head's layers)."""
    seq = list(prompt_ids)
    if len(seq) > 1:
        target.forward(_ids(seq[:-1], device), 0, keep=1)
        head = _head(draft)
        if head is not None:
            head.observe(target.last_hidden, _ids(seq[:-1], device), 0)
        elif draft is not None:
            draft.forward(_ids(seq[:-1], device), 0, keep=1)
    return DecodeState(seq, len(seq) - 1)


def draft_step(draft: Runner, feed: list[int], st: DecodeState, how: RoundSettings, vocab: int) -> DraftStep:
    """Feed the draft `feed` after its cache (seq[:d_len]) and read its next-token row."""
    logits = fit_vocab(draft.forward(_ids(feed, how.device), st.d_len, keep=1)[-1], vocab)
    st.d_len += len(feed)
    q = None if how.sampling.greedy else to_probs(logits, how.sampling)
    if q is not None:
        top = float(q.max())
    else:
        top = None if how.policy.confidence is None else float(torch.softmax(logits.float(), -1).max())
    return DraftStep(logits, q, top)


def draft_chain(
    draft: Runner, st: DecodeState, K: int, how: RoundSettings, vocab: int, first: DraftStep | None = None,
) -> tuple[list[int], list[Tensor]]:
    """The draft phase of a chain round: up to K tokens one by one (greedy, or sampled from q), stopping after the
    first one the draft gave a top probability below `policy.confidence`. `first`: the round's first draft step,
    already taken. -> (tokens, their q's; none when greedy)."""
    drafts: list[int] = []
    qs: list[Tensor] = []
    feed = st.seq[st.d_len:]
    for depth in range(K):
        step = first if depth == 0 and first is not None else draft_step(draft, feed, st, how, vocab)
        if step.q is None:
            tok = int(greedy_token(step.logits))
        else:
            qs.append(step.q)
            tok = int(sample(step.q, how.generator))
        drafts.append(tok)
        feed = [tok]
        if how.policy.confidence is not None and step.top < how.policy.confidence:
            break
    return drafts, qs


def draft_siblings(
    draft: Runner, st: DecodeState, K: int, how: RoundSettings, vocab: int, first: DraftStep | None = None,
) -> tuple[list[int], list[int]]:
    """The draft phase of a sibling round: the first draft step's m = `policy.siblings` most probable tokens and,
    with sibling_depth 2 and room for two tokens (K >= 2), the draft's greedy next token after each of them (one
    more step, `forward_siblings`). -> (siblings, children; [] at depth 1)."""
    step = first if first is not None else draft_step(draft, st.seq[st.d_len:], st, how, vocab)
    siblings = torch.topk(step.logits if step.q is None else step.q, how.policy.siblings).indices.tolist()
    children: list[int] = []
    if how.policy.sibling_depth == 2 and K >= 2:
        nxt_logits = fit_vocab(draft.forward_siblings(_ids(siblings, how.device), st.d_len), vocab)
        children = [int(greedy_token(row)) for row in nxt_logits]
    return siblings, children


def _observe(target: Runner, draft: Runner | None, fed: Tensor, pos: int, rows: slice | list[int]) -> None:
    """A head reads the target's features of the accepted rows (of the tokens `fed` at `pos`)."""
    head = _head(draft)
    if head is not None:
        head.observe(target.last_hidden[rows], fed[rows], pos)


def lookup_q(tokens: list[int], V: int, like: Tensor) -> list[Tensor]:
    """The law each lookup token was proposed from: all its probability on that token (so the target accepts it
    with probability p(token) and, rejecting it, samples p without it)."""
    q = like.new_zeros((len(tokens), V))
    q[torch.arange(len(tokens), device=q.device), torch.tensor(tokens, dtype=torch.long, device=q.device)] = 1.0
    return list(q)


def chain_round(
    target: Runner, draft: Runner | None, st: DecodeState, K: int, how: RoundSettings, first: DraftStep | None = None,
    room: int | None = None,
) -> Round:
    """One chain round: the draft proposes up to K tokens (`draft_chain`; K = 0 is a plain target step), then with
    `policy.lookup` up to that many lookup tokens follow them (`decode.lookup.continuation` of the sequence and
    the drafts; never past `room` - 1 proposed tokens), the target scores [current token, drafts] in one forward,
    and `verify` keeps the longest accepted prefix and adds one token of the target's (corrected or bonus). The
    target cache then holds the sequence up to that token; the draft reads the accepted lookup tokens next round."""
    V = target.vocab_size
    drafts, qs = draft_chain(draft, st, K, how, V, first) if K > 0 else ([], [])
    steps, looked = len(drafts), []
    if K > 0 and how.policy.lookup:
        limit = how.policy.lookup if room is None else min(how.policy.lookup, room - 1 - len(drafts))
        looked = continuation(st.seq + drafts, limit=max(limit, 0))
        if qs and looked:
            qs += lookup_q(looked, V, qs[0])
        drafts = drafts + looked
    t_draft = how.mark()
    pos = len(st.seq) - 1
    fed = _ids([st.seq[-1], *drafts], how.device)
    p_logits = target.forward(fed, pos)  # (len(drafts)+1, V)
    t_verify = how.mark()
    if how.sampling.greedy:
        n_acc, nxt = verify_greedy(p_logits, _ids(drafts, p_logits.device))
    else:
        q_stack = torch.stack(qs) if qs else p_logits.new_zeros((0, V))
        n_acc, nxt = verify(to_probs(p_logits, how.sampling), q_stack, _ids(drafts, p_logits.device), how.generator)
    _observe(target, draft, fed, pos, slice(0, n_acc + 1))
    return Round(drafts[:n_acc] + [nxt], n_acc, len(drafts), steps, t_draft, t_verify, len(looked),
                 max(0, n_acc - steps))


def _check_candidates(row: Tensor, candidates: list[int], how: RoundSettings) -> tuple[int, int]:
    """Candidates checked in turn against one target row: (index of the accepted one or -1, the token)."""
    cands = _ids(candidates, row.device)
    if how.sampling.greedy:
        return verify_candidates_greedy(row, cands)
    return verify_candidates(to_probs(row, how.sampling), cands, how.generator)


def _next_token(row: Tensor, how: RoundSettings) -> int:
    return int(greedy_token(row) if how.sampling.greedy else sample(to_probs(row, how.sampling), how.generator))


def sibling_round(
    target: Runner, draft: Runner, st: DecodeState, K: int, how: RoundSettings, first: DraftStep | None = None,
) -> Round:
    """One sibling round: the draft's m most probable first tokens (and with sibling_depth 2 a child each:
    `draft_siblings`), verified as the tree [current, c_1..c_m, e_1..e_m] in one target forward. The candidates are
    checked in turn; an accepted c_i's KV moves next to the current token's (`keep_path`), and its row checks its
    child the same way (a candidate list of one) or gives the bonus token. Emits 1 to 3 tokens."""
    siblings, children = draft_siblings(draft, st, K, how, target.vocab_size, first)
    t_draft = how.mark()
    pos, m = len(st.seq) - 1, len(siblings)
    fed = _ids([st.seq[-1], *siblings, *children], how.device)
    p_logits = target.forward_tree(fed, pos, [-1] + [0] * m + list(range(1, len(children) + 1)))
    t_verify = how.mark()
    i, nxt = _check_candidates(p_logits[0], siblings, how)
    accepted: list[int] = []
    rows: slice | list[int] = slice(0, 1)  # the target rows of the accepted path
    if i >= 0:  # sibling i stands: its row gives the next token; its KV moves next to the root's
        row, accepted, j = i + 1, [nxt], 0
        rows = [0, row]
        if children:  # its row checks its child; an accepted child's row goes on
            j, nxt = _check_candidates(p_logits[row], children[i : i + 1], how)
            if j == 0:
                row = 1 + m + i
                rows, accepted = [0, 1 + i, row], [accepted[0], nxt]
        target.keep_path(pos, rows)
        if j == 0:  # the last accepted row gives the bonus token
            nxt = _next_token(p_logits[row], how)
    _observe(target, draft, fed, pos, rows)
    return Round(accepted + [nxt], len(accepted), m + len(children), 2 if children else 1, t_draft, t_verify)


def play_round(target: Runner, draft: Runner | None, st: DecodeState, K: int, how: RoundSettings,
               room: int | None = None) -> Round:
    """One round drafting up to K tokens: a sibling round where the policy has siblings and the draft's first step
    falls below its threshold, else a chain round (going on from that first step; lookup tokens within `room`)."""
    if K > 0 and how.policy.siblings:
        first = draft_step(draft, st.seq[st.d_len:], st, how, target.vocab_size)
        if first.top < how.policy.confidence:
            return sibling_round(target, draft, st, K, how, first)
        return chain_round(target, draft, st, K, how, first, room)
    return chain_round(target, draft, st, K, how, room=room)


def finish_round(st: DecodeState, r: Round, stats: Stats, policy: KPolicy, room: int, eos: set[int]) -> bool:
    """A round's bookkeeping: its counts into `stats`; its tokens cut to the `room` left in the budget and after
    the first EOS, then appended (the draft cache rolls back to the accepted prefix); K for the next round.
    -> whether an EOS ended the decode."""
    stats.tau_hist[r.accepted + 1] = stats.tau_hist.get(r.accepted + 1, 0) + 1
    stats.drafted += r.drafted
    stats.accepted += r.accepted
    stats.looked_up += r.looked_up
    stats.lookup_accepted += r.lookup_accepted
    emitted, stop = r.emitted[:room], False
    for i, t in enumerate(emitted):
        if t in eos:
            emitted, stop = emitted[: i + 1], True
            break
    st.advance(emitted)
    if r.drafted:
        st.k = policy.next_k(st.k, r.accepted - r.lookup_accepted, r.steps)
    return stop


def _round_size(st: DecodeState, room: int, head) -> int:
    """Never draft past the budget; a head needs the target's features of one token."""
    return 0 if head is not None and len(st.seq) < 2 else min(st.k, room - 1)


def _check_call(target: Runner, draft: Runner | None, prompt_ids: list[int], max_new_tokens: int,
                sampling: SamplingParams, policy: KPolicy, generator: torch.Generator | None) -> None:
    if not prompt_ids:
        raise DraftsmithError("the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    need = len(prompt_ids) + max_new_tokens  # the last position ever fed is below this
    for name, m in (("target", target), ("draft", draft)):
        if m is not None and m.max_seq_len < need:
            raise DraftsmithError(f"{name} cache holds {m.max_seq_len} positions, this call needs {need}")
    if not sampling.greedy and generator is None:
        raise DraftsmithError("sampling at temperature > 0 needs an explicit torch.Generator")
    if draft is not None and policy.siblings and not hasattr(target, "forward_tree"):
        if isinstance(target, HFRunner):
            raise DraftsmithError(
                f"sibling rounds need the lean runner (it verifies trees: forward_tree); this target "
                f"({target.model.config.model_type}) is served by the generic runner (HFRunner), so use siblings 0")
        raise DraftsmithError(f"sibling rounds need a target runner that verifies trees (forward_tree): "
                              f"{type(target).__name__} does not")
    if draft is not None and policy.sibling_depth == 2 and not hasattr(draft, "forward_siblings"):
        raise DraftsmithError(f"sibling_depth 2 needs a draft that drafts after several candidates at once "
                              f"(forward_siblings): {type(draft).__name__} does not")


def _clock_mark(clock: RoundClock | None, device: torch.device) -> Callable[[], float | None]:
    if clock is None:
        return _no_mark
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def mark() -> float:
        sync()
        return time.perf_counter()

    return mark


@torch.inference_mode()
def generate(
    target: Runner,
    prompt_ids: list[int],
    *,
    draft: Runner | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingParams = SamplingParams(),
    policy: KPolicy = KPolicy(),
    eos_ids: tuple[int, ...] | list[int] = (),
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    clock: RoundClock | None = None,
) -> Result:
    """Decode up to `max_new_tokens` after `prompt_ids`; speculative when `draft` is given. `clock` (a
    `RoundClock`) records what each round's parts cost."""
    _check_call(target, draft, prompt_ids, max_new_tokens, sampling, policy, generator)
    device = torch.device(device)
    how = RoundSettings(sampling, policy, generator, device, _clock_mark(clock, device))
    eos, stats, t0 = set(eos_ids), Stats(), time.perf_counter()
    head = _head(draft)
    if head is not None:  # the target keeps the features the head reads
        captured, target.capture_layers = getattr(target, "capture_layers", ()), head.capture_layers
    st = prefill(target, draft, prompt_ids, device)
    st.k = policy.k if draft is not None else 0
    how.mark()  # with a clock on CUDA: the prefill is done
    stats.prefill_seconds = time.perf_counter() - t0
    if clock is not None:
        clock.prefill_s.append(stats.prefill_seconds)
    while (room := max_new_tokens - (len(st.seq) - len(prompt_ids))) > 0:
        t_round = time.perf_counter()
        r = play_round(target, draft, st, _round_size(st, room, head), how, room)
        stop = finish_round(st, r, stats, policy, room, eos)
        if clock is not None:
            end = how.mark()
            clock.rounds.append((r.drafted, r.t_draft - t_round, r.t_verify - r.t_draft, end - t_round, r.steps))
        if stop:
            break
    if head is not None:
        target.capture_layers = captured
    stats.tau_hist = dict(sorted(stats.tau_hist.items()))
    stats.new_tokens = len(st.seq) - len(prompt_ids)
    stats.seconds = time.perf_counter() - t0
    return Result(st.seq[len(prompt_ids) :], stats)
