"""Vocabulary-pruned standalone drafts (FR-Spec): a whole small LM that proposes only the N target ids the target
writes most often, its LM head cut to those N rows.

    ids = vocab_ids(token_counts, coverage_size(token_counts, 0.99))   # the kept target ids (N,), ascending
    draft = PrunedRunner(make_runner(draft_hf, max_seq_len, quantize="int8"), ids)
    out = generate(target, prompt, draft=draft, policy=KPolicy(k=4))   # exact: the target verifies

The saving is the head's rows outside the kept set S: the draft step computes h @ W[S].T (N rows) instead of the
whole vocabulary's (Qwen2.5-Coder-0.5B's 151,936-row head is about a quarter of its weights). `forward` still
returns logits over the whole vocabulary, -inf outside S, so the decoder and its sampling run unchanged: q is 0
outside S, a valid proposal law (the target's mass there comes back through the residual max(0, p - q) after a
rejection; at temperature 0 the target's argmax decides). What pruning costs is acceptance: p's mass outside S.

`PrunedRunner` takes over the runner it wraps and cuts its head in place: the lean runner's (`decode.runtime.lean.LeanLM`,
float or int8: `decode.runtime.quant`) or the generic runner's (`decode.runtime.runner.HFRunner`, on a shallow copy of the Hugging
Face model whose head is the cut one; the model itself is left whole). The cut head is a copy of N rows; the rest
stays shared.

**Context ids** (`PrunedRunner(..., context=True)`): the draft also proposes any id it has already read in this
sequence (the prompt and the text so far), from the position where it first appears: the words a prompt is about
("palindrome", "lighthouse") are rare in any count but likely in its answer. Row t of a forward may propose the
kept ids and the ids of tokens[: its position + 1]; those extra logits come from the whole head's own rows (an int8
head's rows dequantised), a few hundred at most. Still q = 0 outside a set fixed by what the draft has read, so
still exact; on Qwen2.5-Coder-1.5B's greedy answers it took the 0.5B pruned to 16,384 ids from alpha 0.745 to 0.779
(docs/results/pruned.md). `seen_ids` and `restrict_logits(..., context=, at=)` are the rule in pure form.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import Tensor, nn

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.head import vocab_map
from draftsmith.decode.runtime.kernels import int8_rows
from draftsmith.decode.runtime.lean import LeanLM
from draftsmith.decode.runtime.runner import HFRunner, Runner


def coverage_size(counts: Tensor, coverage: float) -> int:
    """The smallest N whose N most frequent ids hold at least `coverage` (0 < coverage <= 1) of the counted mass:
    sum(top-N counts) / sum(counts) >= coverage, in float64."""
    if not 0.0 < coverage <= 1.0:
        raise DraftsmithError(f"coverage must be in (0, 1], got {coverage}")
    counts = counts.double()
    total = float(counts.sum())
    if counts.dim() != 1 or total <= 0 or bool((counts < 0).any()):
        raise DraftsmithError("coverage needs token counts (V,): non-negative, not all zero")
    covered = torch.sort(counts, descending=True).values.cumsum(0) / total  # (V,) share of the top-n, n = 1..V
    return min(int((covered < coverage).sum()) + 1, counts.shape[0])


def vocab_ids(counts: Tensor, N: int) -> Tensor:
    """The N most frequent ids (ties -> lower id), ascending (N,) int64: `decode.head.vocab_map`'s draft ids."""
    d2t, _ = vocab_map(counts, N)
    return d2t + torch.arange(N)


class Proposes(NamedTuple):
    """What a pruned draft may propose: the kept target ids (N,), and with `context` the ids it has read."""

    ids: Tensor
    context: bool = False


def seen_ids(tokens: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct ids of `tokens` (L,) that are not among the kept `ids`, ascending, with the position of each
    one's first occurrence -> (extra (E,), first (E,)), both int64."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten().cpu()
    out = ~torch.isin(tokens, ids.cpu())
    extra, which = torch.unique(tokens[out], return_inverse=True)  # ascending
    first = torch.full((extra.numel(),), tokens.numel(), dtype=torch.long)
    return extra, first.scatter_reduce_(0, which, out.nonzero().flatten(), "amin")


def restrict_logits(logits: Tensor, ids: Tensor, *, context: Tensor | None = None, at: Tensor | None = None) -> Tensor:
    """Logits (..., V) -> the same with -inf outside `ids` (q = 0 there): a pruned draft's logits computed whole.
    With `context` (L,), the tokens read so far, and `at` (T,) the position in it of the last token row t has
    read (logits (T, V)): row t also keeps the ids of context[: at[t] + 1] (a draft with context ids)."""
    out = torch.full_like(logits, float("-inf"))
    ids = ids.to(logits.device)
    out[..., ids] = logits[..., ids]
    if context is not None:
        extra, first = seen_ids(context, ids)
        if extra.numel():
            extra, first = extra.to(logits.device), first.to(logits.device)
            read = first[None, :] <= torch.as_tensor(at, device=logits.device)[:, None]  # (T, E)
            out[:, extra] = torch.where(read, logits[:, extra], out[:, extra])
    return out


def head_rows(head: nn.Module, ids: Tensor) -> nn.Module:
    """A new LM head holding rows `ids` (N,) of `head`: an nn.Linear, or the int8 draft's dynamic quantised Linear
    (its int8 rows with their own per-channel scales, so each kept logit is what the whole head gives)."""
    if type(head) is nn.Linear:
        w = head.weight
        cut = torch.nn.utils.skip_init(nn.Linear, head.in_features, len(ids), bias=head.bias is not None,
                                       device=w.device, dtype=w.dtype)
        with torch.no_grad():
            cut.weight.copy_(w[ids.to(w.device)])
            if head.bias is not None:
                cut.bias.copy_(head.bias[ids.to(w.device)])
        return cut.requires_grad_(False).eval()
    from draftsmith.decode.runtime.quant import Int4Linear

    if isinstance(head, Int4Linear):
        return Int4Linear.rows_of(head, ids.to(head.packed.device))
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    if isinstance(head, dynamic):
        w, b = head.weight(), head.bias()
        rows = w.int_repr()[ids]
        if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            w_cut = torch._make_per_channel_quantized_tensor(
                rows, w.q_per_channel_scales()[ids], w.q_per_channel_zero_points()[ids], 0)
        else:
            w_cut = torch._make_per_tensor_quantized_tensor(rows, w.q_scale(), w.q_zero_point())
        cut = dynamic(head.in_features, len(ids), bias_=b is not None, dtype=w.dtype)
        cut.set_weight_bias(w_cut, None if b is None else b[ids])
        return cut
    raise DraftsmithError(f"cannot cut a {type(head).__name__} LM head to a pruned vocabulary")


def head_source(head: nn.Module) -> tuple[Tensor, Tensor, Tensor | None]:
    """What a context id's logit is computed from: the whole head's weight as (rows (V, d), row scales (V,), bias)
    -- float rows with scales 1, or an int8 head's integer rows with their per-row scales (zero points 0)."""
    if isinstance(head, nn.Linear):
        w = head.weight.detach()
        return w, torch.ones(w.shape[0], dtype=w.dtype, device=w.device), \
            None if head.bias is None else head.bias.detach()
    if isinstance(head, torch.ao.nn.quantized.dynamic.Linear):
        rows = int8_rows(head)
        if rows is None:
            raise DraftsmithError("context ids need an int8 head with zero points 0 (symmetric)")
        return rows
    from draftsmith.decode.runtime.quant import Int4Linear

    if isinstance(head, Int4Linear) and head.many is not None:  # the int8 copy's rows: a quarter of float's
        return head_source(head.many)
    if isinstance(head, Int4Linear):  # its rows as the float weights they stand for
        w = head.weight_float()
        return w, torch.ones(w.shape[0], dtype=w.dtype), head.bias
    raise DraftsmithError(f"cannot read the rows of a {type(head).__name__} LM head")


class ContextHead(nn.Module):
    """The cut head followed by `extra` rows (E, d) of the whole head: (..., d) -> (..., N + E) logits."""

    def __init__(self, cut: nn.Module) -> None:
        super().__init__()
        self.cut = cut
        self.extra: Tensor | None = None  # (E, d), set before each forward
        self.extra_bias: Tensor | None = None

    def forward(self, h: Tensor) -> Tensor:
        from draftsmith.decode.runtime.kernels import linear

        out = linear(h, self.cut) if h.dim() == 2 else self.cut(h)
        if self.extra is None or self.extra.shape[0] == 0:
            return out
        more = h.to(self.extra.dtype) @ self.extra.t()
        if self.extra_bias is not None:
            more = more + self.extra_bias
        return torch.cat([out, more.to(out.dtype)], dim=-1)


def with_head(hf_model, head: nn.Module):
    """A shallow copy of a Hugging Face causal LM whose LM head is `head`: every other module shared, the model
    itself untouched, its own forward (and whatever it does after the head: Gemma's soft-capping) unchanged."""
    twin = copy.copy(hf_model)
    object.__setattr__(twin, "_modules", dict(hf_model._modules))  # its own module table; the modules are shared
    twin.set_output_embeddings(head)
    return twin


class PrunedRunner:
    """A runner whose draft proposes only target ids `ids` (N,): the wrapped runner's LM head cut to those rows (in
    place: the wrapper owns it), its logits scattered back over the whole vocabulary, -inf elsewhere. With
    `context`, also the ids it has read in this sequence (the module docstring)."""

    def __init__(self, inner: Runner, ids: Tensor, *, context: bool = False) -> None:
        V = inner.vocab_size
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
        if ids.numel() == 0:
            raise DraftsmithError("a pruned draft needs at least one kept id, got none")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise DraftsmithError(f"kept ids must lie in [0, {V}) (the draft's vocabulary), got "
                                  f"{int(ids.min())}..{int(ids.max())}")
        if torch.unique(ids).numel() != ids.numel():
            raise DraftsmithError("kept ids must be distinct")
        self.inner, self.vocab_size = inner, V
        self.ids = torch.sort(ids).values
        if not isinstance(inner, (LeanLM, HFRunner)):
            raise DraftsmithError(f"cannot prune the vocabulary of a {type(inner).__name__} draft (lean or generic "
                                  "runner only)")
        whole = inner.lm_head if isinstance(inner, LeanLM) else inner.model.get_output_embeddings()
        cut = head_rows(whole, self.ids)
        self.context = context
        self._source = head_source(whole) if context else None  # the whole head's rows, for context ids
        self._rows: dict[int, Tensor] = {}  # context id -> its float row, computed once
        self._extra: Tensor | None = None  # the context ids the head's extra rows hold now
        self._tokens = torch.zeros(inner.max_seq_len, dtype=torch.long)  # what the draft has read, by position
        self._kept = set(self.ids.tolist())
        self._first: dict[int, int] = {}  # each id read outside the kept ones -> its first position in _tokens[:_end]
        self._end = 0  # the positions _first covers
        head = ContextHead(cut) if context else cut
        if isinstance(inner, LeanLM):
            inner.lm_head = head
            if inner.head_t is not None:  # the one-row layout of the lean runner's float head, over N rows
                inner.head_t = cut.weight.detach().t().contiguous() if not context else None
        else:
            inner.model = with_head(inner.model, head)
        inner.vocab_size = len(self.ids)  # its forward now gives (T, N) (and E more columns with context ids)

    @property
    def head(self) -> nn.Module:
        """The cut LM head the draft step runs: N output rows."""
        head = self.inner.lm_head if isinstance(self.inner, LeanLM) else self.inner.model.get_output_embeddings()
        return head.cut if isinstance(head, ContextHead) else head

    @property
    def max_seq_len(self) -> int:
        return self.inner.max_seq_len

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.inner.capture_layers

    @capture_layers.setter
    def capture_layers(self, layers: tuple[int, ...]) -> None:
        self.inner.capture_layers = layers

    @property
    def last_hidden(self) -> Tensor | None:
        return self.inner.last_hidden

    def forward(self, tokens: Tensor, pos: int, keep: int = 0) -> Tensor:
        """As any runner's: tokens (T,) at [pos, pos+T) -> logits (T, V) (or the last `keep` rows), -inf outside
        the kept ids."""
        extra = first = None
        if self.context:
            end = pos + tokens.shape[0]
            if end > self._tokens.numel():
                raise ValueError(f"sequence of {end} tokens exceeds the cache ({self._tokens.numel()})")
            self._tokens[pos:end] = tokens.cpu()
            extra, first = self._seen(pos, end)
            self._set_extra(extra)
        kept = self.inner.forward(tokens, pos, keep)  # (T, N [+ E])
        if self.ids.device != kept.device:
            self.ids = self.ids.to(kept.device)
        N = self.ids.numel()
        full = kept.new_full((kept.shape[0], self.vocab_size), float("-inf"))
        full.index_copy_(1, self.ids, kept[:, :N])
        if extra is not None and extra.numel():
            at = torch.arange(end - kept.shape[0], end)  # the position each returned row has read up to
            read = (first[None, :] <= at[:, None]).to(kept.device)  # (T, E): row t proposes what it has read
            more = torch.where(read, kept[:, N:], kept.new_tensor(float("-inf")))
            full.index_copy_(1, extra.to(kept.device), more)
        return full

    def _seen(self, pos: int, end: int) -> tuple[Tensor, Tensor]:
        """`seen_ids(self._tokens[:end], self.ids)`, kept up to date from the last forward instead of recomputed: a
        forward at `pos` rewrites positions pos.. (a rejected draft's among them), so the ids first read there are
        forgotten and the tokens from there on read again (a step reads one token, not the whole sequence)."""
        start = min(pos, self._end)
        self._first = {i: at for i, at in self._first.items() if at < start}
        for at, i in enumerate(self._tokens[start:end].tolist(), start):
            if i not in self._kept and i not in self._first:
                self._first[i] = at
        self._end = end
        extra = sorted(self._first)
        return (torch.tensor(extra, dtype=torch.long),
                torch.tensor([self._first[i] for i in extra], dtype=torch.long))

    def _set_extra(self, extra: Tensor) -> None:
        """The context head's extra rows: the whole head's rows `extra` (E,), dequantised once per id."""
        if self._extra is not None and torch.equal(extra, self._extra):
            return  # the same ids as the last forward: the rows are in place
        self._extra = extra
        w, scales, bias = self._source
        for i in extra.tolist():
            if i not in self._rows:
                self._rows[i] = w[i].to(torch.float64 if w.dtype == torch.float64 else torch.float32) * scales[i]
        head = self.inner.lm_head if isinstance(self.inner, LeanLM) else self.inner.model.get_output_embeddings()
        ids = extra.tolist()
        head.extra = torch.stack([self._rows[i] for i in ids]) if ids else None
        head.extra_bias = None if bias is None or not ids else bias[extra.to(bias.device)].to(head.extra.dtype)
