"""Text in, text out: what the `draftsmith decode` verb and the benchmark share.

    .venv/bin/draftsmith decode --target smollm2-135m-instruct --draft <draft> --prompt "Write a haiku" --k 4

Loads the pair, builds runners (lean where possible; the draft optionally int8), applies the chat template,
decodes, and returns text plus statistics.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from typing import Any

import torch

from decode.allocator import allocator_setting
from decode.errors import DraftsmithError
from decode.loading import Loaded, load
from decode.model import Runner, draft_quant as _draft_quant, make_runner
from decode.sampling import SamplingParams
from decode.speculative import KPolicy, generate


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


def eos_ids(loaded: Loaded) -> list[int]:
    """Every id that ends a reply: the tokenizer's EOS and the generation config's (chat models add one)."""
    ids: set[int] = set()
    for value in (loaded.tokenizer.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


def check_vocab(target: Loaded, draft: Loaded) -> None:
    """Token-level speculation needs one tokenizer: equal vocabularies up to padding rows."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        shared = sum(1 for t, i in dv.items() if tv.get(t) == i)
        raise DraftsmithError(
            f"draft {draft.name!r} and target {target.name!r} have different tokenizers "
            f"({len(dv)} vs {len(tv)} tokens, {shared} shared with the same id); token-level speculative "
            "decoding needs the same tokenizer (cross-tokenizer drafts are measured by `draftsmith pair`)"
        )


@dataclass
class Pair:
    target: Loaded
    draft: Loaded | None
    target_runner: Runner
    draft_runner: Runner | None


def load_pair(
    target: str, draft: str | None, *, max_seq_len: int = 2048, draft_quant: str | None = "int8",
    device: str = "cpu",
) -> Pair:
    """Load target (as is, float32 on CPU) and draft (int8 weights by default where it can: see
    `decode.model.draft_quant`), with their runners."""
    t = load(target, device=device)
    d = load(draft, device=device) if draft else None
    if d is not None:
        check_vocab(t, d)
    return Pair(
        t, d, make_runner(t.model, max_seq_len),
        make_runner(d.model, max_seq_len, quantize=_draft_quant(d.model, draft_quant)) if d is not None else None,
    )


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


def machine_info() -> dict:
    """Where a number was measured: CPU model, cores, threads, platform."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "allocator": allocator_setting(),
    }
    return info


def versions() -> dict:
    import transformers

    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("draftsmith")
    except PackageNotFoundError:
        ours = "unknown"
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "draftsmith": ours}
