"""Text in, text out: a user message as prompt ids (through the chat template) and `decode_text`, what the
`draftsmith decode` verb runs on a pair from `decode.runtime.pair.load_pair`.

    .venv/bin/draftsmith decode --target smollm2-135m-instruct --draft <draft> --prompt "Write a haiku" --k 4

Applies the chat template, decodes, and returns text plus statistics.
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import eos_ids
from draftsmith.decode.runtime.pair import Pair
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.speculative import KPolicy, generate


def prompt_ids(tokenizer: Any, text: str, *, chat: bool = True) -> list[int]:
    """Token ids for a user message: through the chat template when the tokenizer has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]


def decode_text(
    pair: Pair, text: str, *, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
    policy: KPolicy = KPolicy(), seed: int = 0, chat: bool = True,
) -> dict:
    """Decode one prompt; returns {"text", "tokens", "stats"}."""
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = prompt_ids(pair.target.tokenizer, text, chat=chat)
    gen = torch.Generator().manual_seed(seed)
    result = generate(
        pair.target_runner, ids, draft=pair.draft_runner, max_new_tokens=max_new_tokens, sampling=sampling,
        policy=policy, eos_ids=eos_ids(pair.target), generator=gen,
    )
    text_out = pair.target.tokenizer.decode(result.tokens, skip_special_tokens=True)
    return {"text": text_out, "tokens": result.tokens, "prompt_tokens": len(ids), "stats": result.stats.to_dict()}
