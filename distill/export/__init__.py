"""Export a (tuned) draft to what serving engines load, and check each output by loading it back.

    .venv/bin/draftsmith export --draft runs/distill-smollm2/best --target smollm2-135m-instruct \
        --format all --gguf-type f16,q8_0 --out runs/export-smollm2 [--best-k 3] [--check-llama-cpp]

    from draftsmith.distill.export import export
    summary = export("runs/distill-smollm2/best", "smollm2-135m-instruct", Path("runs/export-smollm2"))

`out/` receives:
- `hf/`: the draft (LoRA merged) as a Hugging Face folder with the TARGET's tokenizer files, a generation config
  and a model card (README.md). Checked: reloaded logits equal the in-memory model's, and HF assisted generation
  with it is greedy-equal to the target alone on built-in prompts.
- `draft-<type>.gguf` for every GGUF type asked (f32, f16, q8_0): see distill.export.gguf. Checked: read back,
  and dequantised by transformers' GGUF loader, logits within the type's tolerance.
- `export.json`: everything measured, the serving command lines, warnings. A failed check is recorded there,
  then raised as a DraftsmithError naming it.
With `check_llama_cpp`, llama-server itself serves the target with the GGUF draft (distill.export.llama_cpp).

A vocabulary-pruned standalone draft (`prune:MODEL:vocab=FILE`, `pairing.prune`) is refused, with the reason
(`PRUNED_NOT_EXPORTED`): no engine takes one. llama.cpp's draft-simple runs a draft over the whole vocabulary (its
draft rule wants vocabularies within 128 ids of the target's: a head of N kept rows is not one), and vLLM's and
SGLang's standalone draft models want the target's whole vocabulary too (vLLM: equal vocabulary sizes, as the
warning below says); only draft heads carry a draft vocabulary (d2t/t2d) there. Export MODEL whole instead: the
engines then serve it unpruned, exact, without the pruned head's saving; the kept-ids file is for draftsmith's own
decoder.

The package: `hf` (the HF folder and its checks), `gguf` (the GGUF writer and its checks; GGUF_TYPES),
`llama_cpp` (llama-server, the real engine check), `model_card` (serving lines and README.md). From the rest
of distill it needs only `distill.train.merged_model`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, atomic_write_text, read_json
from draftsmith.decode.runtime.loading import Loaded, load
from draftsmith.decode.runtime.machine import versions
from draftsmith.decode.prompts import load_suite
from draftsmith.decode.spec import DraftSpec
from draftsmith.decode.textgen import prompt_ids
from draftsmith.distill.export.gguf import GGUF_TOL, GGUF_TYPES, export_gguf, prepare_vocab
from draftsmith.distill.export.hf import export_hf
from draftsmith.distill.export.model_card import model_card, serving_lines
from draftsmith.distill.export.results import DraftExport
from draftsmith.distill.train import merged_model
from draftsmith.pairing.derive import resolve_candidate
from draftsmith.pairing.policy import known_k

EXPORT_FORMATS = ("hf", "gguf")
PRUNED_NOT_EXPORTED = (
    "a vocabulary-pruned standalone draft has no engine form: llama.cpp's draft-simple and vLLM's and SGLang's "
    "standalone drafts run over the target's whole vocabulary; export its MODEL whole (served unpruned, still "
    "exact) and keep the pruned draft for draftsmith's decoder")


def refuse_pruned(*specs: str | None) -> None:
    """A one-line DraftsmithError for a vocabulary-pruned draft spec (`PRUNED_NOT_EXPORTED`); nothing otherwise."""
    for spec in specs:
        if spec is not None and DraftSpec.parse(spec).kind == "prune":
            raise DraftsmithError(f"{spec}: {PRUNED_NOT_EXPORTED}")


@dataclass
class ExportConfig:
    """The export stage's settings: HF folder and/or GGUF for llama.cpp, plus the vLLM / SGLang lines."""

    formats: list[str] = field(default_factory=lambda: ["hf", "gguf"])  # hf, gguf or both
    gguf_types: list[str] = field(default_factory=lambda: ["f16"])  # one GGUF per type: f32, f16, q8_0
    target_gguf: str | None = None  # the target's GGUF (default: the zoo's, for a zoo target)
    best_k: int = 0  # K in the serving lines; 0 = the validate stage's (or 3)
    check_llama_cpp: bool = False  # serve the GGUF as llama-server's draft and measure it (builds llama.cpp once)
    llama_cpp_search: bool = False  # with check_llama_cpp: search K x p-min x threads for the fastest llama.cpp setup
    llama_cpp_ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6])  # K predicted and served by the check
    llama_cpp_p_mins: list[float] = field(default_factory=lambda: [0.0, 0.6])  # --spec-draft-p-min tried
    llama_cpp_threads: list[int] = field(default_factory=lambda: [1, 2])  # -t tried (the target alone too)

    def __post_init__(self) -> None:
        bad = [f for f in self.formats if f not in EXPORT_FORMATS]
        if bad or not self.formats:
            raise ValueError(f"formats must be a non-empty list of {', '.join(EXPORT_FORMATS)}, got {self.formats}")
        bad = [t for t in self.gguf_types if t not in GGUF_TYPES]
        if bad or not self.gguf_types:
            raise ValueError(f"GGUF type {', '.join(bad) or '(none)'}: expected {', '.join(GGUF_TYPES)}")
        if self.best_k < 0:
            raise ValueError(f"best_k must be >= 0 (0 = from the run), got {self.best_k}")
        if self.llama_cpp_search and not self.check_llama_cpp:
            raise ValueError("llama_cpp_search needs check_llama_cpp")
        if (not self.llama_cpp_ks or min(self.llama_cpp_ks) < 1 or not self.llama_cpp_threads
                or min(self.llama_cpp_threads) < 1 or any(not 0 <= p < 1 for p in self.llama_cpp_p_mins)
                or not self.llama_cpp_p_mins):
            raise ValueError("llama_cpp_ks and llama_cpp_threads must be >= 1, llama_cpp_p_mins in [0, 1), none empty")

    @property
    def fmt(self) -> str:
        """The `export(fmt=...)` form: 'hf', 'gguf' or 'all'."""
        return "all" if set(self.formats) == {"hf", "gguf"} else self.formats[0]


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"draftsmith: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Inputs


def load_draft(spec: str) -> tuple[Loaded, Any]:
    """(loaded draft, plain HF model to export): zoo name, HF folder, .gguf, derive spec, or a PEFT adapter folder
    (merged into its base model)."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from peft import PeftModel

        base_spec = read_json(path / "adapter_config.json", what="adapter config")["base_model_name_or_path"]
        base = load(base_spec)
        merged = merged_model(PeftModel.from_pretrained(base.model, str(path))).eval()
        return Loaded(model=merged, tokenizer=base.tokenizer, path=path, name=path.name), merged
    loaded = load(resolve_candidate(spec))
    return loaded, merged_model(loaded.model).eval()


def target_gguf_for(target: str, given: str | Path | None) -> Path | None:
    """The target's GGUF file: given, the spec itself when it is one, or the zoo's cached copy."""
    if given is not None:
        return Path(given).expanduser()
    if target.lower().endswith(".gguf") and Path(target).expanduser().is_file():
        return Path(target).expanduser()
    if target in zoo.MODELS:
        return zoo.gguf_path(target)
    return None


def _read_json(path: Path) -> dict:
    """The JSON object in `path`; {} when it is absent or unreadable (provenance is best effort)."""
    try:
        found = read_json(path, missing_ok=True)
    except DraftsmithError:
        return {}
    return found if isinstance(found, dict) else {}


def provenance(draft_dir: Path, info: dict | None) -> dict:
    """What the model card states about training: `info` first, else the distill run's distill.json (the draft
    being its `best/` folder), else the draft's own draftsmith_distill.json marker."""
    found = {}
    runs = [draft_dir / "distill.json"] + ([draft_dir.parent / "distill.json"] if draft_dir.name == "best" else [])
    for candidate in runs:  # a distill run writes its draft to <run>/best/ and its result to <run>/distill.json
        if candidate.is_file():
            run = _read_json(candidate)
            speed = run.get("speed") or {}
            found = {"source": str(candidate), "target": run.get("target"), "draft_source": run.get("draft"),
                     "data_source": run.get("data_source"), "loss": (run.get("config") or {}).get("loss"),
                     "alpha_before": run.get("alpha_before"), "alpha_after": run.get("alpha_after"),
                     "train_prompts": run.get("train_prompts"), "held_out_prompts": run.get("held_out_prompts"),
                     "k_measured": speed.get("k")}
            if "draft_after" in speed.get("speedup_vs_target_only", {}):
                tps = speed["tok_per_s"]
                found["speedup"] = speed["speedup_vs_target_only"]["draft_after"]
                found["speedup_detail"] = (
                    f"draftsmith's CPU decoder, K={speed.get('k')}, {speed.get('prompts')} held-out prompts: "
                    f"{tps['draft_after']:.2f} tok/s with the draft vs {tps['target_only']:.2f} target alone")
            break
    else:
        marker = _read_json(draft_dir / "draftsmith_distill.json")
        if marker:
            found = {"source": str(draft_dir / "draftsmith_distill.json"), "alpha_after": marker.get("alpha"),
                     "loss": (marker.get("config") or {}).get("loss")}
    return {**found, **(info or {})}


def choose_k(best_k: int | None, prov: dict) -> tuple[int, str]:
    """(K, where it comes from): the argument, info/provenance's best_k, the K the distill run measured at, else the
    default (`pairing.policy.known_k`)."""
    return known_k((best_k, "given (--best-k)"), (prov.get("best_k"), "measured (pairing / info)"),
                   (prov.get("k_measured"), "the K the distill run measured its speedup at (not searched)"))


# ---------------------------------------------------------------------------------------------
# The verb


def _check_llama_cpp(t_gguf: Path, drafts: dict[str, Path], prompts: list[list[int]], k: int,
                     failed: list[str], warnings: list[str], progress: bool) -> tuple[dict, dict]:
    """llama-server with each GGUF draft, between two runs of the target alone (before and after, so a machine
    that slows down or speeds up during the check shows): acceptance, tokens/s and the ratio to the target alone,
    and whether the greedy text equals the target's."""
    from draftsmith.distill.export.llama_cpp import beside_target_alone

    runs, baseline = beside_target_alone(t_gguf, {t: {"draft_gguf": path, "draft_max": k} for t, path in drafts.items()},
                                         prompts, 64, say=lambda m: _say(m, progress))
    for t, lc in runs.items():
        name = drafts[t].name
        same = lc["greedy_equal"]  # llama.cpp verifies K+1 tokens in one batch: its arithmetic can flip a near-tie
        if same["equal"] < same["prompts"]:
            warnings.append(f"llama.cpp's greedy text with {name} differs from the target alone on "
                            f"{same['prompts'] - same['equal']} of {same['prompts']} prompts")
        if not lc["drafted"]:
            failed.append(f"llama.cpp drafted no tokens with {name} (see export.json log_tail)")
        elif not lc["accepted"]:
            warnings.append(f"llama.cpp accepted none of {lc['drafted']} tokens drafted by {name}")
    return runs, baseline


def predict_llama_cpp(tgt: Loaded, draft: Any, t_gguf: Path, draft_gguf: Path, ks: list[int], n_prompts: int,
                      warnings: list[str], progress: bool, *, spec_type: str = "draft-simple") -> dict:
    """llama-server's speedup at each K predicted from llama.cpp's own costs and our acceptance by depth, beside
    the measured one, and accepted / drafted in both engines (distill.export.llama_predict), on the first prompt
    of each domain (calibration: the second). `draft`: a Loaded standalone draft or an Eagle3Head."""
    from draftsmith.distill.export.llama_predict import check, ours

    suites = [load_suite(s) for s in ("code", "chat", "json", "summarize")][:n_prompts]
    _say(f"our acceptance by depth and our decoder's accepted / drafted at K = {list(ks)}", progress)
    mine = ours(tgt, draft, [s[0] for s in suites], list(ks), progress=progress)
    calibration = [prompt_ids(tgt.tokenizer, s[1].prompt) for s in suites]
    result = check(t_gguf, draft_gguf, mine["prompt_ids"], calibration, mine["taus"], mine["decoder"],
                   mine["expected"], spec_type=spec_type, say=lambda m: _say(m, progress))
    result["decoder_greedy_equal"] = mine["greedy_equal"]
    if result["parity_flagged"]:
        warnings.append(f"llama.cpp's accepted / drafted differs from our decoder's by more than the parity gap at "
                        f"K = {result['parity_flagged']}: the export may have changed the draft")
    eq = mine["greedy_equal"]
    if eq["equal"] < eq["decodes"]:
        warnings.append(f"our decoder's greedy text differs from the target's on {eq['decodes'] - eq['equal']} of "
                        f"{eq['decodes']} decodes")
    return result


def before_gguf(before: str, out: Path, gguf_type: str, t_gguf: Path, prompts: list[list[int]],
                failed: list[str]) -> tuple[Path, str]:
    """(GGUF, where it comes from) of the un-distilled draft `before`, to serve beside the distilled one: the
    file itself when it is a .gguf, else written here as `before-<type>.gguf`, the type of the distilled draft's
    first GGUF (so that only training differs between the two)."""
    if before.lower().endswith(".gguf") and Path(before).expanduser().is_file():
        return Path(before).expanduser(), "given"
    loaded, model = load_draft(before)
    path = out / f"before-{gguf_type}.gguf"
    export_gguf(model, loaded.tokenizer, path, gguf_type, t_gguf, prepare_vocab(model, loaded.tokenizer, t_gguf),
                f"un-distilled draft for comparison: {before}", prompts, failed)
    return path, f"written here ({gguf_type})"


def export(draft: str, target: str, out: Path, cfg: ExportConfig | None = None, *, info: dict | None = None,
           n_prompts: int = 3, max_new_tokens: int = 32, before: str | None = None, progress: bool = True) -> dict:
    """Write and check the draft in `cfg.formats` under `out`; returns export.json's content.

    `cfg.best_k` (> 0) overrides the K of the serving lines; `info` overrides what the model card says (keys:
    best_k, speedup, speedup_detail, alpha_before, alpha_after, loss, data_source). `cfg.check_llama_cpp` serves
    the target with each GGUF draft through llama-server (distill.export.llama_cpp); with `before` (the draft
    before distillation: a spec) the same check serves it too, at the same K, for the side-by-side report
    (`llama_cpp_before`)."""
    refuse_pruned(draft, before)
    cfg = cfg or ExportConfig()
    fmt, best_k, target_gguf, check_llama_cpp = cfg.fmt, cfg.best_k or None, cfg.target_gguf, cfg.check_llama_cpp
    types = list(cfg.gguf_types) if "gguf" in cfg.formats else []
    if check_llama_cpp and not types:
        raise DraftsmithError("--check-llama-cpp needs a GGUF export (--formats gguf or hf,gguf)")
    out, t0 = Path(out), time.perf_counter()
    tgt = load(target)
    t_gguf = target_gguf_for(target, target_gguf) if types else None
    if types and t_gguf is None:
        raise DraftsmithError(f"GGUF export needs the target's GGUF for its tokenizer: {target!r} is an HF folder; "
                              "pass the target as a zoo name or .gguf file, or give target_gguf")
    d, model = load_draft(draft)
    prov = provenance(Path(d.path), info)
    k, k_src = choose_k(best_k, prov)
    prompts = [prompt_ids(tgt.tokenizer, load_suite(s)[0].prompt) for s in ("code", "chat", "json", "summarize")]
    prompts = prompts[:n_prompts]
    warnings, failed = [], []  # one-line messages
    t_rows, d_rows = tgt.model.config.vocab_size, model.config.vocab_size
    if t_rows != d_rows:
        warnings.append(f"draft vocab_size {d_rows} != target {t_rows}: vLLM requires equal vocabulary sizes")
    summary: dict[str, Any] = {"draft": draft, "draft_path": str(d.path), "target": target,
                               "target_hf": str(tgt.path), "target_gguf": str(t_gguf) if t_gguf else None,
                               "format": fmt, "best_k": k, "best_k_source": k_src, "provenance": prov,
                               "warnings": warnings, "version": DraftExport.VERSION}  # distill.export.results
    prepared = prepare_vocab(model, d.tokenizer, t_gguf) if types else None  # refuse before writing anything
    hf_dir = out / "hf"
    if fmt in ("hf", "all"):
        _say(f"writing {hf_dir}, then reload and assisted-generation checks", progress)
        summary["hf"] = export_hf(model, tgt, hf_dir, k, prompts, max_new_tokens, failed)
    summary["gguf"] = []
    for t in types:
        _say(f"writing {out / f'draft-{t}.gguf'}, then read-back and transformers logits checks", progress)
        summary["gguf"].append(export_gguf(model, d.tokenizer, out / f"draft-{t}.gguf", t, t_gguf, prepared,
                                           f"draftsmith draft for {target}", prompts, failed))
    first_gguf = str(Path(summary["gguf"][0]["path"]).resolve()) if types else None
    summary["serving"] = serving_lines(str(tgt.path), str(hf_dir.resolve()) if "hf" in summary else None,
                                       str(t_gguf) if t_gguf else None, first_gguf, k)
    if check_llama_cpp:
        served = {g["gguf_type"]: Path(g["path"]) for g in summary["gguf"]}
        if before:
            _say(f"the un-distilled draft {before} for the side-by-side check", progress)
            served["before"], source = before_gguf(before, out, types[0], t_gguf, prompts, failed)
        summary["llama_cpp"], summary["llama_cpp_target_only"] = _check_llama_cpp(
            t_gguf, served, prompts, k, failed, warnings, progress)
        if before:
            summary["llama_cpp_before"] = {**summary["llama_cpp"].pop("before"), "draft": before,
                                           "gguf": str(served["before"]), "gguf_source": source}
        summary["llama_cpp_prediction"] = predict_llama_cpp(tgt, d, t_gguf, served[types[0]], cfg.llama_cpp_ks,
                                                            n_prompts, warnings, progress)
        if cfg.llama_cpp_search:
            from draftsmith.distill.export.llama_cpp import search_llama_cpp

            # the drafts the check served (the un-distilled one searched the same way), and for a zoo draft the
            # zoo's own (quantized) file, as users download it
            drafts = {(f"before {path.name}" if t == "before" else f"draftsmith {t}"): path for t, path in served.items()}
            if draft in zoo.MODELS:
                drafts[f"zoo {zoo.gguf_path(draft).name}"] = zoo.gguf_path(draft)
            _say(f"llama.cpp search: {len(drafts)} draft(s) x K {cfg.llama_cpp_ks} x p-min {cfg.llama_cpp_p_mins} "
                 f"x threads {cfg.llama_cpp_threads}", progress)
            summary["llama_cpp_search"] = search_llama_cpp(
                t_gguf, drafts, prompts, ks=cfg.llama_cpp_ks, p_mins=cfg.llama_cpp_p_mins,
                threads=cfg.llama_cpp_threads, progress=progress)
    summary.update(ok=not failed, failed=failed, versions=versions(), seconds=time.perf_counter() - t0)
    card = model_card(summary)
    for folder in ([hf_dir] if "hf" in summary else []) + [out]:
        atomic_write_text(folder / "README.md", card)
    atomic_write_json(out / "export.json", summary)
    if failed:
        raise DraftsmithError(f"export check failed ({out / 'export.json'}): {'; '.join(failed)}")
    return summary


__all__ = ["EXPORT_FORMATS", "PRUNED_NOT_EXPORTED", "ExportConfig", "GGUF_TOL", "GGUF_TYPES",
           "before_gguf", "choose_k", "export", "load_draft", "predict_llama_cpp", "provenance", "refuse_pruned",
           "target_gguf_for"]
