"""Every draft spec opened one way: `load_draft` (the weights, a pruned draft's kept ids, a head) then `run_draft`
(the runner the decoder drafts with); `open_draft` is both.

    d = load_draft("prune:int4:qwen2.5-coder-0.5b-instruct:vocab=kept.json", target)   # d.loaded, d.kept
    opened = run_draft(d, max_len=512, quant="int8")     # opened.runner: int4, its LM head cut to the kept ids
    opened = open_draft("int4:m:lora=runs/x/distill/best-adapter", target, 512, None)  # int4 + LoRA, unmerged
    opened = open_draft("head:runs/h/head/best", target, 512, None)                     # a HeadDraft

The pair leaderboard loads every candidate first (acceptance is measured on the loaded models) and runs them
later; validate, grid and `draftsmith decode` open a spec in one call. Specs are read by `decode.spec.DraftSpec`;
what each kind needs to be opened is `LOADERS` (by `DraftSpec.kind`: a head, a pruned model; any other kind is a
model, int4 and derived ones included) — a new kind registers its loader there. A standalone draft's runner is
`spec_runner`'s: its quantisation, calibration and LoRA adapter (`int4:MODEL:lora=FOLDER`, added unmerged:
`decode.runtime.lora`), as every caller that reads a spec's q should build it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from draftsmith.decode.head import Eagle3Head, HeadDraft, head_quant, load_head
from draftsmith.decode.pruned import PrunedRunner
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import Loaded, load
from draftsmith.decode.runtime.lora import Adapter, check_adapter_config, read_adapter, with_lora
from draftsmith.decode.runtime.pair import check_vocab
from draftsmith.decode.runtime.quant import Calibration, draft_quant, read_calib
from draftsmith.decode.runtime.runner import Runner, make_runner
from draftsmith.decode.spec import DraftSpec
from draftsmith.pairing.derive import resolve_candidate
from draftsmith.pairing.prune import KeptVocab, read_vocab, target_rows


@dataclass
class Draft:
    """A draft spec, loaded: the model (None for a head), a pruned draft's kept ids, or the head."""

    spec: str
    loaded: Loaded | None = None
    kept: KeptVocab | None = None
    head: Eagle3Head | None = None


@dataclass
class Opened:
    """A draft as the decoder runs it."""

    runner: object
    quant: str | None
    head: object | None = None  # the float head a HeadDraft runs (its rounds are walked on held-out rows)


def _model(d: DraftSpec, spec: str, device: str, shared: dict | None) -> Loaded:
    """The weights `d` names (int4:MODEL loads MODEL: `run_draft` packs it), loaded once per `shared` dict."""
    key = (resolve_candidate(d.weights), device)
    if shared is None:
        return replace(load(key[0], device=device), name=spec)
    if key not in shared:
        shared[key] = load(key[0], device=device)
    return replace(shared[key], name=spec)


def _load_head(d: DraftSpec, spec: str, target: Loaded, device: str, shared: dict | None) -> Draft:
    """`head:PATH` -> the head in PATH on the target's embedding, checked against the target (vocabulary, hidden
    size, aux layers); a one-line error otherwise."""
    d.check()  # the folder holds a head's two files
    try:
        head = load_head(d.folder, target.model.get_input_embeddings())
    except DraftsmithError:  # an unreadable config.json says so itself (a ValueError too, not a misfit)
        raise
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise DraftsmithError(f"{spec}: this head does not fit {target.name}: {str(e).splitlines()[0]}") from None
    n_layers = target.model.config.num_hidden_layers
    if max(head.config.aux_layers) >= n_layers:
        raise DraftsmithError(f"{spec}: the head reads layers {list(head.config.aux_layers)}, {target.name} has "
                              f"{n_layers}")
    return Draft(spec, head=head.eval())


def _load_pruned(d: DraftSpec, spec: str, target: Loaded, device: str, shared: dict | None) -> Draft:
    """`prune:MODEL:vocab=FILE`: MODEL, and the kept ids (checked first: a bad file fails before a model loads). A
    pruned draft proposes target ids, so it must share the target's tokenizer."""
    kept = read_vocab(d.vocab, target_rows(target))
    loaded = _model(d, spec, device, shared)
    check_vocab(target, loaded)
    rows = loaded.model.get_output_embeddings().weight.shape[0]
    if int(kept.ids.max()) >= rows:
        raise DraftsmithError(f"{spec}: keeps id {int(kept.ids.max())}, the draft's head has {rows} rows")
    return Draft(spec, loaded, kept)


def _load_model(d: DraftSpec, spec: str, target: Loaded, device: str, shared: dict | None) -> Draft:
    return Draft(spec, _model(d, spec, device, shared))


LOADERS: dict[str, Callable[..., Draft]] = {"head": _load_head, "prune": _load_pruned}  # by DraftSpec.kind


def load_draft(spec: str, target: Loaded, device: str = "cpu", shared: dict | None = None) -> Draft:
    """Any draft spec, loaded for `target`. `shared` (a dict the caller keeps) loads each model once for the specs
    that name it: a ranking of MODEL beside its pruned variants holds one copy of MODEL's weights."""
    d = DraftSpec.parse(spec)
    calibration(spec)  # a bad calibration file or adapter folder fails before a model is loaded
    if d.adapter is not None:
        check_adapter_config(d.adapter)
    return LOADERS.get(d.kind, _load_model)(d, spec, target, device, shared)


def calibration(spec: str) -> Calibration | None:
    """The calibration a draft spec names (`int4:MODEL:calib=FILE`, pruned or not; `read_calib`), else None."""
    path = DraftSpec.parse(spec, sniff=False).calibration if spec else None
    return None if path is None else read_calib(path)


def adapter(spec: str) -> Adapter | None:
    """The LoRA adapter a draft spec names (`int4:MODEL[:calib=FILE]:lora=FOLDER`, pruned or not; `read_adapter`),
    else None."""
    folder = DraftSpec.parse(spec, sniff=False).adapter if spec else None
    return None if folder is None else read_adapter(folder)


def runner_quant(model, quant: str | None, spec: str = "") -> str | None:
    """The quantisation a standalone draft decodes with: what its spec asks for (`int4:MODEL`), else `quant`, where
    the model can take it (`decode.runtime.quant.draft_quant`), else None."""
    asked = DraftSpec.parse(spec, sniff=False).quant if spec else None
    return draft_quant(model, asked or quant)


def runner_calib(quant: str | None, spec: str) -> Calibration | None:
    """The calibration a standalone draft's runner is built with: its spec's where it decodes int4 (`quant`,
    `runner_quant`'s answer), else None (an int8 fallback rounds as ever)."""
    return calibration(spec) if quant == "int4" else None


def spec_runner(model, max_seq_len: int, q: str | None, spec: str = "") -> Runner:
    """A standalone draft's runner, unpruned, with the quantisation `q` (`runner_quant`'s answer), its spec's
    calibration where that is int4 (`runner_calib`), and its spec's LoRA adapter added unmerged (`adapter`: on
    whatever base `q` gave: int4, or int8 where this CPU has no int4 kernel)."""
    runner = make_runner(model, max_seq_len, quantize=q, calib=runner_calib(q, spec))
    lora = adapter(spec)
    return runner if lora is None else with_lora(runner, lora)


def standalone_runner(spec: str, target: Loaded, max_seq_len: int, quant: str | None, device: str = "cpu", *,
                      what: str = "this") -> tuple[Draft, str | None, Runner]:
    """A standalone draft spec loaded for `target` and its runner unpruned (`spec_runner`; a pruned draft's kept ids
    stay on the Draft, to restrict what it proposes): -> (draft, its quantisation, runner). A head is refused in one
    line naming `what` needs a standalone draft."""
    d = load_draft(spec, target, device)
    if d.loaded is None:
        raise DraftsmithError(f"{spec}: {what} measures standalone drafts, not heads")
    q = runner_quant(d.loaded.model, quant, spec)
    return d, q, spec_runner(d.loaded.model, max_seq_len, q, spec)


def model_runner(model, kept: KeptVocab | None, max_seq_len: int, quant: str | None,
                 spec: str = "") -> tuple[Runner, str | None]:
    """A standalone draft as the decoder runs it: int8 Linear weights where `quant` asks and the model can take
    them, int4 where its `spec` asks (`int4:MODEL`, GPTQ-rounded on FILE's text with `int4:MODEL:calib=FILE`; int8
    where this CPU has no int4 kernel), a LoRA adapter on top with `int4:MODEL:lora=FOLDER` (`spec_runner`), its
    head cut to the kept ids when pruned. -> (runner, the quantisation)."""
    q = runner_quant(model, quant, spec)
    runner = spec_runner(model, max_seq_len, q, spec)
    return (PrunedRunner(runner, kept.ids, context=kept.context) if kept is not None else runner), q


def run_draft(d: Draft, max_len: int, quant: str | None) -> Opened:
    """A loaded draft as the decoder runs it: a HeadDraft (int8 where `quant` asks and the head takes it) or a
    model runner (`model_runner`)."""
    if d.head is not None:
        q = head_quant(d.head, quant)
        return Opened(HeadDraft(d.head, max_len, quantize=q), q, d.head)
    runner, q = model_runner(d.loaded.model, d.kept, max_len, quant, d.spec)
    return Opened(runner, q)


def open_draft(spec: str, target: Loaded, max_len: int, quant: str | None, device: str = "cpu") -> Opened:
    """Any draft spec as the decoder runs it: `load_draft` then `run_draft`."""
    return run_draft(load_draft(spec, target, device), max_len, quant)
