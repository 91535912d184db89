"""Plain (non-speculative) decoding of several prompts at once, each row getting exactly the tokens that
decoding it alone gives.

    from decode.batch import generate_batch
    rows = generate_batch(loaded.model, [ids_a, ids_b], max_new_tokens=48, sampling=SamplingParams(1.0),
                          eos_ids=eos_ids(loaded), generators=[gen_a, gen_b])

Used where one model decodes many prompts on its own (distillation data from the draft, or from the target
without a proposer): left-padded, one Hugging Face forward per token for the whole batch, finished rows
dropped. `TargetVocab` fits a model's logits to another model's vocabulary (`decode.sampling.fit_vocab`: cut,
or padded with -inf), so a draft never samples a token its target cannot score.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decode.model import Runner
from decode.sampling import SamplingParams, fit_vocab, greedy_token, sample, to_probs


class TargetVocab:
    """A runner whose logits are cut or padded (-inf) to the target's vocabulary, so that every token the
    draft samples on its own is one the target can score (drafts may carry a few padding rows more or less)."""

    def __init__(self, runner: Runner, vocab_size: int) -> None:
        self.runner, self.vocab_size, self.max_seq_len = runner, vocab_size, runner.max_seq_len

    def forward(self, tokens: Tensor, pos: int, keep: int = 0) -> Tensor:
        return fit_vocab(self.runner.forward(tokens, pos, keep), self.vocab_size)


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_ids: list[int] | tuple[int, ...] = (),
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int | None = None,
) -> list[list[int]]:
    """Plain decoding of several prompts at once with a Hugging Face causal LM -> each row's new tokens.

    Left padding (attention mask and position ids skip the pads), one KV cache for the batch, rows that hit
    EOS leave the batch. Row b samples from `generators[b]` (needed at temperature > 0) with the very step
    `decode.speculative.generate` takes without a draft, so a row's tokens are the ones that decoding it
    alone gives. `vocab_size` cuts or pads (-inf) the logits to another model's vocabulary.
    """
    from transformers import DynamicCache

    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B = len(prompts)
    generators = list(generators) if generators is not None else [None] * B
    if not sampling.greedy and any(g is None for g in generators):
        raise ValueError("sampling at temperature > 0 needs an explicit torch.Generator per prompt")
    device = next(model.parameters()).device
    stop = set(eos_ids)
    P = max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    attn = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        attn[b, P - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, P): a row's first real token is at position 0
    cache = DynamicCache(config=model.config)
    out: list[list[int]] = [[] for _ in range(B)]
    live = list(range(B))  # batch row j decodes prompt live[j]
    feed = ids
    for step in range(max_new_tokens):
        logits = model(input_ids=feed, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]  # (len(live), V)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if vocab_size is not None:
            logits = fit_vocab(logits, vocab_size)
        keep, nxt = [], []
        for j, b in enumerate(live):
            if sampling.greedy:
                tok = int(greedy_token(logits[j]))
            else:
                tok = int(sample(to_probs(logits[j], sampling), generators[b]))
            out[b].append(tok)
            if tok not in stop:
                keep.append(j)
                nxt.append(tok)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(live):  # finished rows leave the batch (and the cache)
            rows = torch.tensor(keep, device=device)
            cache.batch_select_indices(rows)
            attn, pos = attn[rows], pos[rows]
            live = [live[j] for j in keep]
        feed = torch.tensor(nxt, device=device)[:, None]
        attn = torch.cat([attn, attn.new_ones(len(live), 1)], dim=1)
        pos = pos[:, -1:] + 1
    return out


__all__ = ["TargetVocab", "generate_batch"]
