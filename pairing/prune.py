"""Vocabulary-pruned standalone drafts as candidates: the `prune:MODEL:vocab=FILE` spec and its kept-ids file.

    .venv/bin/draftsmith vocab --target qwen2.5-coder-1.5b-instruct --prompts code,chat --coverage 0.99 --out kept.json
    .venv/bin/draftsmith pair --target qwen2.5-coder-1.5b-instruct \
        --candidates qwen2.5-coder-0.5b-instruct,prune:qwen2.5-coder-0.5b-instruct:vocab=kept.json --out runs/pair
    .venv/bin/draftsmith decode --target qwen2.5-coder-1.5b-instruct \
        --draft prune:qwen2.5-coder-0.5b-instruct:vocab=kept.json --prompt "..."

MODEL is any standalone draft spec (zoo name, HF folder, .gguf, derive:...) that shares the target's tokenizer;
FILE holds the kept target ids (`build_vocab` writes it, `read_vocab` checks it against the target). The draft
runs as `decode.pruned.PrunedRunner`: its LM head cut to the kept rows, q = 0 elsewhere, decoding exact.

Every place that turns a standalone draft spec into a model and a runner goes through `load_model_draft` and
`draft_runner` (the pair leaderboard, validate and grid through `pairing.validate.open_draft`, `draftsmith
decode`), so a pruned spec is accepted wherever a model spec is, and refused (one line, `resolve_candidate`)
where only a whole model will do: distillation and export (no engine takes a pruned standalone draft).

The file (JSON): {"format": "draftsmith-kept-vocab", "version": 1, "vocab_size": V, "n": N, "ids": [...],
"coverage": the share asked for (null when N was given), "covered": the share of the counted target tokens the
ids hold, "counted_tokens", "source": where the counts came from, "context_ids": whether the draft also proposes
the ids it has read in the sequence (`decode.pruned`; false when absent, as files before it)}.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, read_json
from draftsmith.decode.runtime.loading import Loaded, load
from draftsmith.decode.runtime.pair import check_vocab
from draftsmith.decode.pruned import Proposes, PrunedRunner, coverage_size, vocab_ids
from draftsmith.decode.runtime.quant import Calibration, draft_quant, read_calib
from draftsmith.decode.runtime.runner import Runner, make_runner
from draftsmith.decode.spec import DraftSpec
from draftsmith.pairing.derive import resolve_candidate

FORMAT = "draftsmith-kept-vocab"
VERSION = 1


def parse_prune_spec(spec: str) -> tuple[str, Path] | None:
    """'prune:MODEL:vocab=FILE' -> (MODEL, FILE); None when `spec` is not a prune spec; a malformed one is a
    DraftsmithError (`decode.spec.DraftSpec`)."""
    d = DraftSpec.parse(spec, sniff=False)
    return (d.inner.text, d.vocab) if d.kind == "prune" else None


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


def build_vocab(counts: Tensor, out: str | Path, *, coverage: float | None = 0.99, size: int | None = None,
                source: dict | None = None, context_ids: bool = True) -> KeptVocab:
    """Keep the `size` target ids counted most often, or the fewest that hold `coverage` of the counts
    (`decode.pruned.coverage_size`); write them to `out` (JSON, atomically) and return them. `counts` (V,) over
    the target's vocabulary, e.g. `distill.vocab.count_tokens` of text the target wrote. `context_ids`: the draft
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


def load_model_draft(spec: str, target: Loaded, device: str = "cpu",
                     shared: dict[tuple[str, str], Loaded] | None = None) -> tuple[Loaded, KeptVocab | None]:
    """A standalone draft spec -> (the model, loaded; the kept ids for `prune:MODEL:vocab=FILE`, else None).
    A pruned draft proposes target ids, so it must share the target's tokenizer; its file is checked first.
    `shared` (a dict the caller keeps) loads each model once for the specs that name it: a ranking of MODEL beside
    its pruned variants holds one copy of MODEL's weights, not one a variant (the decoder never changes them)."""
    d = DraftSpec.parse(spec, sniff=False)

    def model() -> Loaded:
        key = (resolve_candidate(d.weights), device)  # int4:MODEL loads MODEL (`draft_runner` packs it)
        if shared is None:
            return replace(load(key[0], device=device), name=spec)
        if key not in shared:
            shared[key] = load(key[0], device=device)
        return replace(shared[key], name=spec)

    spec_calib(spec)  # a bad calibration file fails before a model is loaded
    if d.kind != "prune":
        return model(), None
    kept = read_vocab(d.vocab, target_rows(target))  # a bad file fails before a model is loaded
    loaded = model()
    check_vocab(target, loaded)
    rows = loaded.model.get_output_embeddings().weight.shape[0]
    if int(kept.ids.max()) >= rows:
        raise DraftsmithError(f"{spec}: keeps id {int(kept.ids.max())}, the draft's head has {rows} rows")
    return loaded, kept


def spec_quant(spec: str) -> str | None:
    """The quantisation a draft spec asks for itself: "int4" for `int4:MODEL` and `prune:int4:MODEL:vocab=FILE`;
    None for any other, or for no spec ("")."""
    return DraftSpec.parse(spec, sniff=False).quant if spec else None


def spec_calib(spec: str) -> Calibration | None:
    """The calibration a draft spec names (`int4:MODEL:calib=FILE`, pruned or not; `read_calib`), else None."""
    path = DraftSpec.parse(spec, sniff=False).calibration if spec else None
    return None if path is None else read_calib(path)


def is_model_draft_spec(spec: str | None) -> bool:
    """Whether `spec` names a standalone draft that `load_model_draft` must open (pruned or int4), not a plain model."""
    return spec is not None and DraftSpec.parse(spec, sniff=False).decoder_only


def runner_quant(model, quant: str | None, spec: str = "") -> str | None:
    """The quantisation a standalone draft decodes with: what its spec asks for (`int4:MODEL`), else `quant`, where
    the model can take it (`decode.runtime.quant.draft_quant`), else None."""
    return draft_quant(model, spec_quant(spec) or quant)


def runner_calib(quant: str | None, spec: str) -> Calibration | None:
    """The calibration a standalone draft's runner is built with: its spec's (`spec_calib`) where it decodes int4
    (`runner_quant`'s answer `quant`), else None (an int8 fallback rounds as ever)."""
    return spec_calib(spec) if quant == "int4" else None


def draft_runner(model, kept: KeptVocab | None, max_seq_len: int, quant: str | None,
                 spec: str = "") -> tuple[Runner, str | None]:
    """A standalone draft as the decoder runs it: int8 Linear weights where `quant` asks and the model can take
    them (`decode.runtime.quant.draft_quant`), int4 where its `spec` asks (`int4:MODEL`, GPTQ-rounded on FILE's text with
    `int4:MODEL:calib=FILE`; int8 where this CPU has no int4 kernel), its head cut to the kept ids when pruned.
    -> (runner, the quantisation)."""
    q = runner_quant(model, quant, spec)
    runner = make_runner(model, max_seq_len, quantize=q, calib=runner_calib(q, spec))
    return (PrunedRunner(runner, kept.ids, context=kept.context) if kept is not None else runner), q


__all__ = ["FORMAT", "KeptVocab", "build_vocab", "draft_runner", "is_model_draft_spec",
           "load_model_draft", "parse_prune_spec", "read_vocab", "runner_calib", "runner_quant", "spec_calib",
           "spec_quant", "target_rows"]
