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

A draft head (`decode.head.HeadDraft`, `reads_target`) reads the target instead of running on its own: the
target keeps its hidden states at the head's layers, and after each target forward the accepted rows go to
the head (`observe`); the head then drafts as any draft does, feeding itself past them. The first round of a
one-token prompt drafts nothing (the target has not read a token yet).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decode.runner import Runner
from decode.sampling import (
    SamplingParams, fit_vocab, greedy_token, sample, to_probs, verify, verify_candidates, verify_candidates_greedy,
    verify_greedy,
)


def check_siblings(m: int) -> None:
    """Sibling rounds propose m = 0 (none) or m >= 2 first tokens: one is a plain round."""
    if m == 1 or m < 0:
        raise ValueError(f"siblings must be 0 (never) or >= 2, got {m}")


def check_sibling_depth(depth: int, siblings: int) -> None:
    """Sibling rounds go 1 deep (the siblings) or 2 (each with the draft's next token); 2 needs siblings."""
    if depth not in (1, 2) or (depth == 2 and not siblings):
        raise ValueError(f"sibling_depth must be 1, or 2 with siblings >= 2, got {depth}")


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
    drafts with `forward_siblings`, and rounds with room for two tokens).
    """

    k: int = 4
    dynamic: bool = False
    k_min: int = 1
    k_max: int = 16
    confidence: float | None = None
    siblings: int = 0
    sibling_depth: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k <= k_max, got {self.k_min}, {self.k}, {self.k_max}")
        if self.confidence is not None and not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0, 1), got {self.confidence}")
        check_siblings(self.siblings)
        if self.siblings and self.confidence is None:
            raise ValueError(f"siblings ({self.siblings}) needs a confidence threshold to branch below")
        check_sibling_depth(self.sibling_depth, self.siblings)

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
            self.seconds + other.seconds,
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
            "tau_definition": "tokens emitted per target forward, including the bonus/corrected token",
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Stats":
        """The inverse of `to_dict` (derived fields are recomputed, not read)."""
        return cls({int(t): int(c) for t, c in d["tau_hist"].items()}, int(d["drafted"]), int(d["accepted"]),
                   int(d["new_tokens"]), float(d["prefill_seconds"]), float(d["seconds"]))


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


def _ids(tokens: list[int], device: torch.device) -> Tensor:
    return torch.tensor(tokens, dtype=torch.long, device=device)


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
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = torch.device(device)
    sync = torch.cuda.synchronize if clock is not None and device.type == "cuda" else (lambda: None)
    need = len(prompt_ids) + max_new_tokens  # the last position ever fed is below this
    for name, m in (("target", target), ("draft", draft)):
        if m is not None and m.max_seq_len < need:
            raise ValueError(f"{name} cache holds {m.max_seq_len} positions, this call needs {need}")
    if not sampling.greedy and generator is None:
        raise ValueError("sampling at temperature > 0 needs an explicit torch.Generator")
    if draft is not None and policy.siblings and not hasattr(target, "forward_tree"):
        raise ValueError(f"sibling rounds need a target runner that verifies trees (forward_tree): "
                         f"{type(target).__name__} does not")
    if draft is not None and policy.sibling_depth == 2 and not hasattr(draft, "forward_siblings"):
        raise ValueError(f"sibling_depth 2 needs a draft that drafts after several candidates at once "
                         f"(forward_siblings): {type(draft).__name__} does not")
    V = target.vocab_size
    eos = set(eos_ids)
    stats = Stats()
    t0 = time.perf_counter()

    head = draft if getattr(draft, "reads_target", False) else None  # a draft head: it reads the target
    if head is not None:
        captured, target.capture_layers = getattr(target, "capture_layers", ()), head.capture_layers
    seq = list(prompt_ids)
    if len(seq) > 1:  # prefill: both caches take seq[:-1]
        target.forward(_ids(seq[:-1], device), 0, keep=1)
        if head is not None:
            head.observe(target.last_hidden, _ids(seq[:-1], device), 0)
        elif draft is not None:
            draft.forward(_ids(seq[:-1], device), 0, keep=1)
    d_len = len(seq) - 1
    sync()
    stats.prefill_seconds = time.perf_counter() - t0
    if clock is not None:
        clock.prefill_s.append(stats.prefill_seconds)

    k = policy.k if draft is not None else 0
    n_new = 0
    while n_new < max_new_tokens:
        t_round = time.perf_counter()
        K = min(k, max_new_tokens - n_new - 1)  # never draft past the budget
        if head is not None and len(seq) < 2:
            K = 0  # a head needs the target's features of one token
        # -- draft phase: propose up to K tokens (or, in a sibling round, the first draft's top m) --
        drafts: list[int] = []
        qs: list[Tensor] = []
        siblings: list[int] = []
        children: list[int] = []  # sibling_depth 2: the draft's next token after each sibling
        if K > 0:
            feed = seq[d_len:]
            for depth in range(K):
                logits = fit_vocab(draft.forward(_ids(feed, device), d_len, keep=1)[-1], V)
                d_len += len(feed)
                q = None if sampling.greedy else to_probs(logits, sampling)
                if q is not None:
                    top = float(q.max())
                else:
                    top = None if policy.confidence is None else float(torch.softmax(logits.float(), -1).max())
                if depth == 0 and policy.siblings and top < policy.confidence:
                    siblings = torch.topk(logits if q is None else q, policy.siblings).indices.tolist()
                    if policy.sibling_depth == 2 and K >= 2:
                        nxt_logits = fit_vocab(draft.forward_siblings(_ids(siblings, device), d_len), V)
                        children = [int(greedy_token(row)) for row in nxt_logits]
                    break
                if q is None:
                    tok = int(greedy_token(logits))
                else:
                    qs.append(q)
                    tok = int(sample(q, generator))
                drafts.append(tok)
                feed = [tok]
                if policy.confidence is not None and top < policy.confidence:
                    break
        # -- verify phase: one target forward over [current token, drafts] (or the tree [current, siblings]) --
        if clock is not None:
            sync()
            t_draft = time.perf_counter()
        pos = len(seq) - 1
        m = len(siblings)
        if siblings:
            fed = _ids([seq[-1], *siblings, *children], device)
            p_logits = target.forward_tree(fed, pos, [-1] + [0] * m + list(range(1, len(children) + 1)))
        else:
            fed = _ids([seq[-1], *drafts], device)
            p_logits = target.forward(fed, pos)  # (len(drafts)+1, V)
        if clock is not None:
            sync()
            t_verify = time.perf_counter()
        steps = (2 if children else 1) if siblings else len(drafts)  # draft steps this round
        rows = None  # the target rows of the accepted path, where it is not rows 0..n_acc
        if siblings:
            cands = _ids(siblings, p_logits.device)
            if sampling.greedy:
                i, tok = verify_candidates_greedy(p_logits[0], cands)
            else:
                i, tok = verify_candidates(to_probs(p_logits[0], sampling), cands, generator)
            n_acc, nxt = 0, tok
            if i >= 0:  # sibling i stands: its row gives the next token; its KV moves next to the root's
                row = i + 1
                rows, n_acc, drafts = [0, row], 1, [tok]
                j = 0
                if children:  # its row checks its child (a candidate list of one); an accepted child's row goes on
                    child = _ids(children[i : i + 1], p_logits.device)
                    j, nxt = (verify_candidates_greedy(p_logits[row], child) if sampling.greedy
                              else verify_candidates(to_probs(p_logits[row], sampling), child, generator))
                    if j == 0:
                        row = 1 + m + i
                        rows, n_acc, drafts = [0, 1 + i, row], 2, [tok, nxt]
                target.keep_path(pos, rows)
                if j == 0:  # the last accepted row gives the bonus token
                    nxt = int(greedy_token(p_logits[row]) if sampling.greedy
                              else sample(to_probs(p_logits[row], sampling), generator))
        elif sampling.greedy:
            n_acc, nxt = verify_greedy(p_logits, _ids(drafts, p_logits.device))
        else:
            q_stack = torch.stack(qs) if qs else p_logits.new_zeros((0, V))
            n_acc, nxt = verify(to_probs(p_logits, sampling), q_stack, _ids(drafts, p_logits.device), generator)
        if head is not None:  # the accepted rows' features go to the head
            if rows is None:
                head.observe(target.last_hidden[: n_acc + 1], fed[: n_acc + 1], pos)
            else:
                head.observe(target.last_hidden[rows], fed[rows], pos)
        stats.tau_hist[n_acc + 1] = stats.tau_hist.get(n_acc + 1, 0) + 1
        proposed = m + len(children) or len(drafts)
        stats.drafted += proposed
        stats.accepted += n_acc
        emitted = drafts[:n_acc] + [nxt]
        emitted = emitted[: max_new_tokens - n_new]
        stop = False
        for i, t in enumerate(emitted):
            if t in eos:
                emitted, stop = emitted[: i + 1], True
                break
        seq.extend(emitted)
        n_new += len(emitted)
        d_len = min(d_len, len(seq) - 1)  # draft cache: roll back to the accepted prefix
        if proposed:
            k = policy.next_k(k, n_acc, steps)
        if clock is not None:
            sync()
            end = time.perf_counter()
            clock.rounds.append((proposed, t_draft - t_round, t_verify - t_draft, end - t_round, steps))
        if stop:
            break

    if head is not None:
        target.capture_layers = captured
    stats.tau_hist = dict(sorted(stats.tau_hist.items()))
    stats.new_tokens = n_new
    stats.seconds = time.perf_counter() - t0
    return Result(seq[len(prompt_ids) :], stats)
