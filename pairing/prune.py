"""Vocabulary-pruned standalone drafts as candidates: the `prune:MODEL:vocab=FILE` spec and its kept-ids file.

    .venv/bin/draftsmith vocab --target qwen2.5-coder-1.5b-instruct --prompts code,chat --coverage 0.99 --out kept.json
    .venv/bin/draftsmith pair --target qwen2.5-coder-1.5b-instruct \
        --candidates qwen2.5-coder-0.5b-instruct,prune:qwen2.5-coder-0.5b-instruct:vocab=kept.json --out runs/pair
    .venv/bin/draftsmith decode --target qwen2.5-coder-1.5b-instruct \
        --draft prune:qwen2.5-coder-0.5b-instruct:vocab=kept.json --prompt "..."

MODEL is any standalone draft spec (zoo name, HF folder, .gguf, derive:...) that shares the target's tokenizer;
FILE holds the kept target ids (`build_vocab` writes it, `read_vocab` checks it against the target). The draft
runs as `decode.pruned.PrunedRunner`: its LM head cut to the kept rows, q = 0 elsewhere, decoding exact.

Every place that opens a draft goes through `pairing.drafts` (the pair leaderboard, validate, grid, `draftsmith
decode`), so a pruned spec is accepted wherever a model spec is, and refused (one line, `resolve_candidate`)
where only a whole model will do: distillation and export (no engine takes a pruned standalone draft).

The file (JSON): {"format": "draftsmith-kept-vocab", "version": 1, "vocab_size": V, "n": N, "ids": [...],
"coverage": the share asked for (null when N was given), "covered": the share of the counted target tokens the
ids hold, "counted_tokens", "source": where the counts came from, "context_ids": whether the draft also proposes
the ids it has read in the sequence (`decode.pruned`; false when absent, as files before it)}.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, read_json
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.decode.pruned import Proposes, coverage_size, vocab_ids

FORMAT = "draftsmith-kept-vocab"
VERSION = 1




@dataclass(frozen=True)
class KeptVocab:
    """The target ids a pruned draft proposes, with where they came from."""

    ids: Tensor  # (N,) int64 target ids, ascending
    vocab_size: int  # the target vocabulary they index (its logit rows)
    covered: float  # the share of the counted target tokens these ids hold
    coverage: float | None = None  # the share asked for; None when N was given
    counted_tokens: int = 0
    source: dict = field(default_factory=dict)
    context: bool = False  # the draft also proposes the ids it has read in the sequence

    @property
    def n(self) -> int:
        return int(self.ids.numel())

    @property
    def proposes(self) -> Proposes:
        return Proposes(self.ids, self.context)

    def describe(self) -> str:
        more = " and any id it has read in the sequence" if self.context else ""
        return (f"vocabulary-pruned: proposes {self.n} of {self.vocab_size} target ids{more} (they hold "
                f"{100 * self.covered:.1f}% of {self.counted_tokens} target-written tokens counted); LM head cut to "
                f"{self.n} rows")


def count_tokens(seqs: Iterable[Tensor | Sequence[int]], vocab_size: int) -> Tensor:
    """How often each id occurs in the token id sequences `seqs` -> counts (vocab_size,) int64. An id outside
    [0, vocab_size) is an error (text from another tokenizer)."""
    parts = [torch.as_tensor(s, dtype=torch.long).flatten() for s in seqs]
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise DraftsmithError(f"token ids {int(ids.min())}..{int(ids.max())} do not fit a vocabulary of {vocab_size}: "
                              "text from another tokenizer?")
    return torch.bincount(ids.cpu(), minlength=vocab_size)


def build_vocab(counts: Tensor, out: str | Path, *, coverage: float | None = 0.99, size: int | None = None,
                source: dict | None = None, context_ids: bool = True) -> KeptVocab:
    """Keep the `size` target ids counted most often, or the fewest that hold `coverage` of the counts
    (`decode.pruned.coverage_size`); write them to `out` (JSON, atomically) and return them. `counts` (V,) over
    the target's vocabulary, e.g. `count_tokens` of text the target wrote. `context_ids`: the draft
    also proposes the ids it has read in the sequence (`decode.pruned`)."""
    if (coverage is None) == (size is None):
        raise DraftsmithError("give one of coverage (a share of the counted tokens) or size (a number of ids)")
    counts = torch.as_tensor(counts).flatten()
    V = counts.numel()
    n = coverage_size(counts, coverage) if size is None else int(size)
    if not 1 <= n <= V:
        raise DraftsmithError(f"a pruned vocabulary keeps 1..{V} ids (the target's vocabulary), got {n}")
    ids = vocab_ids(counts, n)
    total = float(counts.double().sum())
    kept = KeptVocab(ids, V, float(counts.double()[ids].sum()) / total if total > 0 else 0.0, coverage,
                     int(round(total)), dict(source or {}), bool(context_ids))
    atomic_write_json(out, {"format": FORMAT, "version": VERSION, "vocab_size": V, "n": n, "coverage": coverage,
                            "covered": kept.covered, "counted_tokens": kept.counted_tokens, "source": kept.source,
                            "context_ids": kept.context, "ids": ids.tolist()})
    return kept


def read_vocab(path: str | Path, vocab_size: int) -> KeptVocab:
    """The kept ids in `path`, checked against a target vocabulary of `vocab_size` ids; a one-line
    DraftsmithError for a missing or corrupt file, no ids, repeated ids, ids outside the vocabulary, or a file
    built for a vocabulary of another size."""
    d = read_json(path, what="kept-vocabulary file (draftsmith vocab writes it)")
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise DraftsmithError(f"{path}: not a kept-vocabulary file (draftsmith vocab writes one)")
    ids, V = d.get("ids"), d.get("vocab_size")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) \
            or not isinstance(V, int) or d.get("n") != len(ids):
        raise DraftsmithError(f"{path}: corrupt kept-vocabulary file (ids, n and vocab_size disagree or are missing)")
    if not ids:
        raise DraftsmithError(f"{path}: keeps no ids (N = 0): a draft must be able to propose something")
    if V != vocab_size:
        raise DraftsmithError(f"{path}: built for a vocabulary of {V} ids, the target has {vocab_size}; "
                              "build it again for this target (draftsmith vocab)")
    t = torch.tensor(ids, dtype=torch.long)
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        raise DraftsmithError(f"{path}: ids outside the target's vocabulary [0, {vocab_size}): "
                              f"{int(t.min())}..{int(t.max())}")
    if torch.unique(t).numel() != t.numel():
        raise DraftsmithError(f"{path}: an id is kept more than once")
    covered, coverage, context = d.get("covered"), d.get("coverage"), d.get("context_ids", False)
    if not isinstance(context, bool):
        raise DraftsmithError(f"{path}: context_ids must be true or false, got {context!r}")
    return KeptVocab(torch.sort(t).values, V, float(covered) if isinstance(covered, (int, float)) else float("nan"),
                     float(coverage) if isinstance(coverage, (int, float)) else None,
                     int(d.get("counted_tokens") or 0), d.get("source") if isinstance(d.get("source"), dict) else {},
                     context)


def target_rows(target: Loaded) -> int:
    """The target's vocabulary as its logits see it: the rows of its LM head."""
    return target.model.get_output_embeddings().weight.shape[0]
















__all__ = ["FORMAT", "KeptVocab", "build_vocab", "read_vocab", "target_rows"]
