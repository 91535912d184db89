"""Sampling math for speculative decoding: small pure functions, no model in sight.

Names follow the papers: `p` is the target distribution, `q` the draft's, both after the *same*
temperature / top-k / top-p transform (`to_probs`). The rule (Leviathan et al. 2023, Chen et al. 2023):
accept draft token x with probability min(1, p(x)/q(x)); on rejection sample from norm(max(0, p - q));
when all K drafts are accepted, sample a bonus token from p_{K+1}. The emitted tokens are distributed
exactly as if sampled from p one by one. Temperature 0 is the exact greedy special case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. temperature == 0 means greedy (argmax, ties -> lowest id)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def fit_vocab(logits: Tensor, V: int) -> Tensor:
    """Logits (..., Vd) -> (..., V): extra columns cut, missing ones padded with -inf (impossible tokens).

    How a draft's logits meet its target's vocabulary (one tokenizer family pads its embedding table to
    different sizes): any proposal distribution keeps speculative decoding exact, as long as sampling and
    the acceptance ratio use the same q.
    """
    Vd = logits.shape[-1]
    if Vd > V:
        return logits[..., :V]
    if Vd < V:
        pad = logits.new_full((*logits.shape[:-1], V - Vd), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


def greedy_token(logits: Tensor) -> Tensor:
    """argmax over the last dim; torch.argmax returns the first (lowest id) maximum, as the contract asks."""
    return torch.argmax(logits, dim=-1)


def to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Logits (..., V) -> probabilities (..., V) after temperature, top-k and top-p; computed in float32+.

    At temperature 0 this is the one-hot of the argmax, so the same acceptance formulas cover greedy.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_token(logits), logits.shape[-1]).to(dtype)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row of probs (..., V) -> (...,) token ids, randomness from `generator` only."""
    flat = probs.reshape(-1, probs.shape[-1])
    # inverse CDF: the first token whose cumulative probability exceeds u * total, u ~ U[0, 1) (float64 sums,
    # so a token of probability 0 is never drawn). One uniform per row: ~20x cheaper than torch.multinomial,
    # which draws an exponential per vocabulary entry (0.76 ms a row at 49k tokens on 2 cores).
    cdf = flat.to(torch.float64).cumsum(-1)
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
    out = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=flat.shape[-1] - 1).squeeze(-1)
    return out.reshape(probs.shape[:-1])


def accept_probability(p_x: Tensor, q_x: Tensor) -> Tensor:
    """min(1, p(x)/q(x)) for a drafted token x (q(x) > 0 since the draft sampled x)."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)): the distribution to resample from after a rejection.

    If p <= q everywhere (only possible up to rounding, since a rejection has probability
    sum max(0, q - p) = sum max(0, p - q)), fall back to p, which is then equal to q.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def verify(
    p: Tensor, q: Tensor, draft_tokens: Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """The speculative accept/reject step for one sequence.

    p: (K+1, V) target probabilities at the K drafted positions and the bonus position.
    q: (K, V) draft probabilities the K draft tokens were sampled from.
    draft_tokens: (K,) the drafted ids.
    Returns (n_accepted, next_token): the first n_accepted drafts are kept, then next_token
    (the corrected token after a rejection, or the bonus token when all K were accepted).
    """
    K = draft_tokens.shape[0]
    if K:
        idx = torch.arange(K, device=p.device)
        ratio = accept_probability(p[idx, draft_tokens], q[idx, draft_tokens])
        u = torch.rand(K, generator=generator, dtype=ratio.dtype, device=ratio.device)
        rejected = (u >= ratio).nonzero()
        if rejected.numel():
            n = int(rejected[0, 0])
            return n, int(sample(residual(p[n], q[n]), generator))
    return K, int(sample(p[K], generator))


def verify_greedy(target_logits: Tensor, draft_tokens: Tensor) -> tuple[int, int]:
    """Temperature-0 verify: keep drafts while they equal the target's argmax; then emit the target's argmax.

    target_logits: (K+1, V); draft_tokens: (K,). The emitted tokens are exactly the target's greedy tokens.
    """
    best = greedy_token(target_logits)  # (K+1,)
    K = draft_tokens.shape[0]
    mismatch = (best[:K] != draft_tokens).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else K
    return n, int(best[n])


# -- sibling candidates: several tokens proposed for one position, each checked against the target in turn --


def candidate_acceptance(p: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """Sequential checking of distinct candidate tokens c_1..c_m for one position against the target's p (V,):
    c_i is accepted with probability r_i(c_i) / sum(r_i), where r_1 = p and r_{i+1} is r_i with c_i set to 0;
    after m rejections the token is sampled from r_{m+1}, normalised. Returns (the m conditional acceptance
    probabilities, r_{m+1} normalised; p itself where it has no mass left, a case reached with probability 0).

    Sampling from p through these steps: P(c_i) = prod_{j<i}(1 - a_j) a_i = p(c_i), and any other token x comes
    from the residual with probability prod(1 - a_j) r(x) / sum(r) = p(x). It holds for any candidates chosen
    without looking at the target (a draft's most probable tokens, here), so the output law stays the target's."""
    if candidates.dim() != 1 or torch.unique(candidates).numel() != candidates.numel():
        raise ValueError("candidates must be distinct token ids (m,)")
    r = p.to(torch.float64 if p.dtype == torch.float64 else torch.float32).clone()
    accept = torch.zeros(candidates.numel(), dtype=r.dtype, device=r.device)
    for i, c in enumerate(candidates.tolist()):
        mass = r.sum()
        accept[i] = r[c] / mass if mass > 0 else 0.0
        r[c] = 0.0
    total = r.sum()
    return accept, (r / total if total > 0 else p)


def verify_candidates(p: Tensor, candidates: Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """Temperature > 0: check the candidates (m,) in order against p (V,) (`candidate_acceptance`). Returns (i, c_i)
    for the accepted one, or (-1, x) with x drawn from what is left of p after all were rejected."""
    accept, rest = candidate_acceptance(p, candidates)
    u = torch.rand(candidates.numel(), generator=generator, dtype=accept.dtype, device=accept.device)
    hit = (u < accept).nonzero()
    if hit.numel():
        i = int(hit[0, 0])
        return i, int(candidates[i])
    return -1, int(sample(rest, generator))


def verify_candidates_greedy(target_logits: Tensor, candidates: Tensor) -> tuple[int, int]:
    """Temperature 0: (i, c_i) for the candidate equal to the target's argmax over `target_logits` (V,), else
    (-1, that argmax)."""
    best = int(greedy_token(target_logits))
    hit = (candidates == best).nonzero()
    return (int(hit[0, 0]), best) if hit.numel() else (-1, best)
