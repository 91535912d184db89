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

`PrunedRunner` takes over the runner it wraps and cuts its head in place: the lean runner's (`decode.lean.LeanLM`,
float or int8: `decode.quant`) or the generic runner's (`decode.runner.HFRunner`, on a shallow copy of the Hugging
Face model whose head is the cut one; the model itself is left whole). The cut head is a copy of N rows; the rest
stays shared.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from decode.errors import DraftsmithError
from decode.head import vocab_map
from decode.lean import LeanLM
from decode.runner import HFRunner, Runner


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


def restrict_logits(logits: Tensor, ids: Tensor) -> Tensor:
    """Logits (..., V) -> the same with -inf outside `ids` (q = 0 there): a pruned draft's logits computed whole."""
    out = torch.full_like(logits, float("-inf"))
    ids = ids.to(logits.device)
    out[..., ids] = logits[..., ids]
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


def with_head(hf_model, head: nn.Module):
    """A shallow copy of a Hugging Face causal LM whose LM head is `head`: every other module shared, the model
    itself untouched, its own forward (and whatever it does after the head: Gemma's soft-capping) unchanged."""
    twin = copy.copy(hf_model)
    object.__setattr__(twin, "_modules", dict(hf_model._modules))  # its own module table; the modules are shared
    twin.set_output_embeddings(head)
    return twin


class PrunedRunner:
    """A runner whose draft proposes only target ids `ids` (N,): the wrapped runner's LM head cut to those rows (in
    place: the wrapper owns it), its logits scattered back over the whole vocabulary, -inf elsewhere."""

    def __init__(self, inner: Runner, ids: Tensor) -> None:
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
        if isinstance(inner, LeanLM):
            inner.lm_head = head_rows(inner.lm_head, self.ids)
            if inner.head_t is not None:  # the one-row layout of the lean runner's float head, over N rows
                inner.head_t = inner.lm_head.weight.detach().t().contiguous()
        elif isinstance(inner, HFRunner):
            inner.model = with_head(inner.model, head_rows(inner.model.get_output_embeddings(), self.ids))
        else:
            raise DraftsmithError(f"cannot prune the vocabulary of a {type(inner).__name__} draft (lean or generic "
                                  "runner only)")
        inner.vocab_size = len(self.ids)  # its forward now gives (T, N)

    @property
    def head(self) -> nn.Module:
        """The cut LM head the draft step runs: N output rows."""
        return self.inner.lm_head if isinstance(self.inner, LeanLM) else self.inner.model.get_output_embeddings()

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
        kept = self.inner.forward(tokens, pos, keep)  # (T, N)
        if self.ids.device != kept.device:
            self.ids = self.ids.to(kept.device)
        full = kept.new_full((kept.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.ids, kept)
