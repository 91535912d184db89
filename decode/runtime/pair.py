"""A target and its draft, loaded together with their runners (`load_pair`), after the one-tokenizer check
(`check_vocab`) that token-level speculation needs."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import Loaded, load
from draftsmith.decode.runtime.quant import draft_quant as _draft_quant
from draftsmith.decode.runtime.runner import Runner, make_runner


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
    `decode.runtime.quant.draft_quant`), with their runners."""
    t = load(target, device=device)
    d = load(draft, device=device) if draft else None
    if d is not None:
        check_vocab(t, d)
    return Pair(
        t, d, make_runner(t.model, max_seq_len),
        make_runner(d.model, max_seq_len, quantize=_draft_quant(d.model, draft_quant)) if d is not None else None,
    )
