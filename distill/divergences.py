"""Distillation divergences between the target (teacher) p and the draft (student) q: pure tensor functions.

Names follow docs/design.md: `p` is the target distribution, `q` the draft's, both `softmax(logits / T)` at the
same temperature T. Every divergence is named by its direction and returns its TRUE value (never a
cross-entropy that differs from it by the teacher's entropy), so a logged 0 means the draft matches.

    forward_kl  KL(p || q) = sum_x p (log p - log q)        mass-covering: q must cover everything p can say
    reverse_kl  KL(q || p) = sum_x q (log q - log p)        mode-seeking: q is punished for mass where p has none
    jsd         beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q
    tvd         TV(p, q) = 1/2 sum_x |p - q| = 1 - sum_x min(p, q) = 1 - beta_t

TVD is the speculative-decoding objective itself: the per-position acceptance is beta_t = 1 - TV(p_t, q_t),
so the token mean of `tvd` over target-generated positions is exactly 1 - alpha (at that temperature).
(docs/design.md's acceptance beta_t is unrelated to `jsd`'s mixture weight `beta`, which follows TRL's GKD.)

Every function returns (total, n_tokens): the SUM over positions where `mask` is true and how many there are.
Divide the summed totals of all micro-batches by their GLOBAL token count (`token_mean`) and gradient
accumulation equals one big batch exactly; an all-masked batch gives 0 and zero gradients, never NaN.
No Hinton T^2 factor is applied: callers who want it multiply the loss, the logged value stays the divergence.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.sampling import fit_vocab

# log-probabilities on the side being divided by are floored here, so a draft holding mass where the target
# has none (reverse KL against a top-k teacher: -inf outside the top k) costs a large finite penalty and a
# finite gradient instead of inf / NaN. exp(-100) ~ 4e-44 is below anything float32 can matter for.
LOG_FLOOR = -100.0
# llama.cpp's rule (docs/design.md, Compatibility): vocabularies of one tokenizer family may differ by padding rows.
MAX_PADDING_ROWS = 128

Divergence = Callable[..., tuple[Tensor, Tensor]]


class VocabMismatchError(DraftsmithError, ValueError):
    """Student and teacher vocabularies differ: a ValueError, and a DraftsmithError so the CLI prints one line."""


# -- helpers ----------------------------------------------------------------------------------------------


def align_vocab(student_logits: Tensor, teacher_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Truncate both (..., V) logits to the smaller V when they differ only by padding rows (<= 128).

    One tokenizer family pads its embedding table to different sizes (Qwen2.5: 151936 vs 152064); the extra
    rows are never real tokens, so dropping them (the softmax renormalises over the shared ids) is the
    faithful comparison. A larger difference means different tokenizers, which token-level distillation
    cannot handle: that raises VocabMismatchError.
    """
    Vs, Vt = student_logits.shape[-1], teacher_logits.shape[-1]
    if abs(Vs - Vt) > MAX_PADDING_ROWS:
        raise VocabMismatchError(
            f"student vocab {Vs} vs teacher {Vt} differ by {abs(Vs - Vt)} rows, more than the "
            f"{MAX_PADDING_ROWS} padding rows one tokenizer family may differ by: these are different "
            "tokenizers; token-level distillation needs a draft from the target's family"
        )
    V = min(Vs, Vt)
    return fit_vocab(student_logits, V), fit_vocab(teacher_logits, V)


def topk_teacher_logits(values: Tensor, indices: Tensor, vocab_size: int) -> Tensor:
    """Rebuild full-vocabulary teacher logits (..., V) from a cached top-k: log-probs `values` (..., k) at
    token ids `indices` (..., k), -inf everywhere else.

    softmax of the result is the teacher renormalised over its top k (exactly the teacher when k = V), and
    softmax(result / T) equals the top-k restriction of softmax(logits / T) for any temperature T, since
    log-probs differ from logits by a per-position constant. Every divergence here consumes it unchanged.
    """
    if values.shape != indices.shape:
        raise ValueError(f"top-k values {tuple(values.shape)} and indices {tuple(indices.shape)} must match")
    k = values.shape[-1]
    if not 0 < k <= vocab_size:
        raise ValueError(f"top-k cache has k={k}, needs 0 < k <= vocab_size={vocab_size}")
    full = values.new_full((*values.shape[:-1], vocab_size), float("-inf"))
    return full.scatter(-1, indices.long(), values)


def token_mean(total: Tensor, count: Tensor | int) -> Tensor:
    """total / max(count, 1): the per-token divergence, 0 (not NaN) when no position counted."""
    count = torch.as_tensor(count, device=total.device)
    return total / count.clamp(min=1).to(total.dtype)


def _log_probs(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Checks shapes, keeps the masked-in positions, returns (log q, log p) as (N, V) in float32+ and N."""
    Vs, Vt = student_logits.shape[-1], teacher_logits.shape[-1]
    if Vs != Vt:
        raise VocabMismatchError(
            f"student vocab {Vs} vs teacher {Vt}: distillation needs the same tokenizer; if the two differ "
            f"only by padding rows (<= {MAX_PADDING_ROWS}, e.g. Qwen2.5 151936 vs 152064) call "
            "align_vocab(student_logits, teacher_logits) first, otherwise pick a draft from the target's family"
        )
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} vs teacher {tuple(teacher_logits.shape)}")
    positions = tuple(student_logits.shape[:-1])
    if tuple(mask.shape) != positions:
        raise ValueError(f"mask {tuple(mask.shape)} must be the logits' shape less vocab: {positions}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.float64 if torch.float64 in (student_logits.dtype, teacher_logits.dtype) else torch.float32
    keep = mask.to(device=student_logits.device, dtype=torch.bool)
    # select first: padding positions never enter the math, so garbage (even NaN) there cannot leak
    s = student_logits[keep].to(dtype) / temperature  # (N, V)
    t = teacher_logits[keep].to(dtype) / temperature  # (N, V)
    return torch.log_softmax(s, dim=-1), torch.log_softmax(t, dim=-1), keep.sum()


def _kl_rows(log_a: Tensor, log_b: Tensor, floor: float | None) -> Tensor:
    """sum_x a (log a - log b) per row, with 0 log 0 = 0 and log b floored (when floor is given).

    torch.where guards both the value and the gradient: where a = 0 the difference may be -inf - -inf = NaN,
    and a plain 0 * NaN would poison the backward pass.
    """
    if floor is not None:
        log_b = log_b.clamp(min=floor)
    diff = torch.where(torch.isneginf(log_a), 0.0, log_a - log_b)
    return (log_a.exp() * diff).sum(dim=-1)


# -- the divergences ----------------------------------------------------------------------------------------


def forward_kl(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """KL(p || q) = sum_x p (log p - log q), summed over masked-in positions -> (total, n_tokens).

    Logits (..., V), mask (...) bool or 0/1. log q is floored at LOG_FLOOR (finite even if q = 0 where p > 0).
    """
    log_q, log_p, n = _log_probs(student_logits, teacher_logits, mask, temperature)
    return _kl_rows(log_p, log_q, LOG_FLOOR).sum(), n


def reverse_kl(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """KL(q || p) = sum_x q (log q - log p), summed over masked-in positions -> (total, n_tokens).

    log p is floored at LOG_FLOOR: against a top-k teacher (p = 0 outside the top k) the true value is
    infinite; the floor turns it into a large finite penalty whose gradient moves q's mass into the top k.
    """
    log_q, log_p, n = _log_probs(student_logits, teacher_logits, mask, temperature)
    return _kl_rows(log_q, log_p, LOG_FLOOR).sum(), n


def jsd(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, *, beta: float = 0.5, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized JSD: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q -> (total, n_tokens).

    beta = 0.5 is the symmetric Jensen-Shannon divergence (bounded by log 2). beta must lie in (0, 1): at
    either endpoint m equals one side and the JSD is identically 0. Near them it behaves as the KLs scaled
    down: JSD_beta / beta -> KL(p || q) as beta -> 0 and JSD_beta / (1 - beta) -> KL(q || p) as beta -> 1
    (TRL's GKD returns those KLs at the endpoints); train with "fkl" / "rkl" for those limits.
    m > 0 wherever p or q is, so no floor is needed.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(
            f"jsd beta must be in (0, 1), got {beta}: at 0 or 1 the JSD vanishes; "
            "use 'fkl' (the beta -> 0 limit, scaled) or 'rkl' (beta -> 1) instead"
        )
    log_q, log_p, n = _log_probs(student_logits, teacher_logits, mask, temperature)
    # where both are 0, m is 0 too; fill 0 there so logaddexp's backward never sees -inf - -inf (its term is 0)
    both_zero = torch.isneginf(log_p) & torch.isneginf(log_q)
    log_m = torch.logaddexp(
        log_p.masked_fill(both_zero, 0.0) + math.log(beta), log_q.masked_fill(both_zero, 0.0) + math.log1p(-beta)
    )
    rows = beta * _kl_rows(log_p, log_m, None) + (1.0 - beta) * _kl_rows(log_q, log_m, None)
    return rows.sum(), n


def tvd(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """TV(p, q) = 1/2 sum_x |p - q| = 1 - beta_t, summed over masked-in positions -> (total, n_tokens).

    In [0, 1] per position; token_mean of it over target-generated positions is 1 - alpha, so minimising
    TVD trains the acceptance rate directly.
    """
    log_q, log_p, n = _log_probs(student_logits, teacher_logits, mask, temperature)
    return (0.5 * (log_p.exp() - log_q.exp()).abs().sum(dim=-1)).sum(), n


DIVERGENCES: dict[str, Divergence] = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": tvd}


def divergence_sum(
    name: str, student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, **kw: float
) -> tuple[Tensor, Tensor]:
    """The divergence called `name` ("fkl", "rkl", "jsd", "tvd") -> (total over masked-in positions, n_tokens).

    kw: temperature, and beta for "jsd". Loss for one optimizer step = sum of totals / global n_tokens.
    """
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")
    return DIVERGENCES[name](student_logits, teacher_logits, mask, **kw)
