"""The kept vocabulary of a pruned draft (`pairing.prune`): the target ids the target writes most often, counted on
text it wrote.

    .venv/bin/draftsmith vocab --target qwen2.5-coder-1.5b-instruct --data runs/x/data/rows --coverage 0.99 \
        --out kept.json
    .venv/bin/draftsmith vocab --target qwen2.5-coder-1.5b-instruct --prompts code,chat --size 32768 --out kept.json

    from draftsmith.distill.vocab import make_vocab
    kept = make_vocab("qwen2.5-coder-1.5b-instruct", Path("kept.json"), prompts="code,chat", coverage=0.99)

The target's text comes from one of:
- `data`: a folder of training data: `draftsmith gen-data`'s (its rows with source "target" only: on-policy rows
  are the draft's), any `datasets` folder with continuation_ids (a reference cache), or a draft head's data folder
  (`distill.heads.data`: each row's tokens after its prompt);
- `prompts`: suite names or a prompt file: the target's greedy continuations, `max_new_tokens` each
  (`pairing.reference.reference_continuations`, cached).
Only continuation tokens count (what a draft has to propose), never the prompts. `pairing.prune.count_tokens` is the
one count of target ids in draftsmith: draft heads choose their vocabulary with it too.

Count on prompts the draft is trained or chosen on, not on the test prompts it is timed on: a vocabulary chosen on
the text it is measured on covers that text better than new text.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import Loaded, load
from draftsmith.decode.prompts import Prompt, load_prompts
from draftsmith.distill.data import load_data_folder
from draftsmith.distill.heads.data import head_data_texts
from draftsmith.pairing.prune import KeptVocab, build_vocab, count_tokens, target_rows
from draftsmith.pairing.reference import reference_continuations


def data_texts(folder: str | Path, target: Loaded) -> list[list[int]]:
    """The continuations the target wrote in a data folder (see the module docstring)."""
    folder = Path(folder)
    if any(folder.glob("shard-*.safetensors")):
        return head_data_texts(folder)
    ds = load_data_folder(folder, target)
    sources = ds["source"] if "source" in ds.column_names else ["target"] * len(ds)
    texts = [list(c) for c, src in zip(ds["continuation_ids"], sources) if src == "target" and len(c)]
    if not texts:
        raise DraftsmithError(f"{folder}: no text the target wrote (no row with source 'target' and a continuation)")
    return texts


def continuation_texts(target: Loaded, prompts: list[Prompt], max_new_tokens: int, *, draft: Loaded | None = None,
                       progress: bool = True) -> list[list[int]]:
    """The target's greedy continuations of `prompts` (`pairing.reference.reference_continuations`, cached);
    `draft` (same tokenizer) only makes them come faster: the text is the target's own."""
    refs = reference_continuations(target, prompts, max_new_tokens=max_new_tokens, draft=draft, progress=progress)
    return [list(c) for c in refs["continuation_ids"]]


def make_vocab(target: str, out: str | Path, *, data: str | Path | None = None, prompts: str | None = None,
               coverage: float | None = 0.99, size: int | None = None, max_new_tokens: int = 128,
               limit_per_domain: int | None = None, device: str = "cpu", progress: bool = True,
               context_ids: bool = True) -> KeptVocab:
    """Count the target ids in text the target wrote (`data` or `prompts`) and keep the `size` most frequent, or
    the fewest that hold `coverage` of them; written to `out` (`pairing.prune.build_vocab`; `context_ids`: the
    draft also proposes the ids it has read)."""
    if (data is None) == (prompts is None):
        raise DraftsmithError("vocab: give one of data (a folder of text the target wrote) or prompts")
    t = load(target, device=device)
    if data is not None:
        texts = data_texts(data, t)
        source = {"data": str(Path(data).expanduser().resolve())}
    else:
        suite = load_prompts(prompts, limit_per_domain=limit_per_domain)
        texts = continuation_texts(t, suite, max_new_tokens, progress=progress)
        source = {"prompts": prompts, "prompt_ids": [p.id for p in suite], "max_new_tokens": max_new_tokens,
                  "temperature": 0.0}
    source.update(target=target, rows=len(texts))
    counts = count_tokens(texts, target_rows(t))
    return build_vocab(counts, out, coverage=None if size is not None else coverage, size=size, source=source,
                       context_ids=context_ids)


__all__ = ["continuation_texts", "count_tokens", "data_texts", "make_vocab"]
