"""Export a (tuned) draft to what serving engines load, and check each output by loading it back.

    .venv/bin/draftsmith export --draft runs/distill-smollm2/best --target smollm2-135m-instruct \
        --format all --gguf-type f16,q8_0 --out runs/export-smollm2 [--best-k 3] [--check-llama-cpp]

    from distill.export import export
    summary = export("runs/distill-smollm2/best", "smollm2-135m-instruct", Path("runs/export-smollm2"))

`out/` receives:
- `hf/`: the draft (LoRA merged) as a Hugging Face folder with the TARGET's tokenizer files, a generation config
  and a model card (README.md). Checked: reloaded logits equal the in-memory model's, and HF assisted generation
  with it is greedy-equal to the target alone on built-in prompts.
- `draft-<type>.gguf` for every GGUF type asked (f32, f16, q8_0): see distill.gguf_export. Checked: read back,
  and dequantised by transformers' GGUF loader, logits within the type's tolerance.
- `export.json`: everything measured, the serving command lines, warnings. A failed check is recorded there,
  then raised as a DraftsmithError naming it.
With `check_llama_cpp`, llama-server itself serves the target with the GGUF draft (distill.llama_cpp).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from decode import zoo
from decode.bench import atomic_write_json
from decode.errors import DraftsmithError
from decode.loading import Loaded, load
from decode.prompts import load_suite
from decode.textgen import eos_ids, prompt_ids, versions
from distill.checkpoint import replace_dir as _replace_dir
from distill.gguf_export import GGUF_TYPES, logits_diff, prepare_vocab, verify_gguf, write_gguf
from distill.model_card import model_card, serving_lines
from distill.train import merged_model
from pairing.derive import resolve_candidate

FORMATS = ("hf", "gguf", "all")
DEFAULT_K = 3  # bench's default, the best K measured on the 2-core CPU; used, and labelled, when none is known
HF_RELOAD_TOL = 1e-5  # the same float32 weights, read back: any difference is a bug
# Max |logit diff| relative to the largest |logit|, and minimum argmax agreement, per GGUF type. Measured
# (relative diff / top-1): distilled SmolLM2 draft, 326 positions: f32 0 / 100 %, f16 6.8e-4 / 99.7 %,
# q8_0 1.1e-2 / 98.2 %; tiny random Llama and Qwen2 (flat logits, the hard case): f16 1.1e-3 / 98.8 %,
# q8_0 3.5e-2 / 96.3 %. A missing q/k permutation measures 0.72 / 41 %, far outside every bound.
GGUF_TOL = {"f32": (1e-5, 1.0), "f16": (5e-3, 0.97), "q8_0": (6e-2, 0.90)}


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


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

        base_spec = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
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
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


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
    """(K, where it comes from): the argument, info/provenance's best_k, the K the distill run measured at, else 3."""
    if best_k is not None:
        return int(best_k), "given (--best-k)"
    if prov.get("best_k") is not None:
        return int(prov["best_k"]), "measured (pairing / info)"
    if prov.get("k_measured") is not None:
        return int(prov["k_measured"]), "the K the distill run measured its speedup at (not searched)"
    return DEFAULT_K, "not measured (default 3)"


# ---------------------------------------------------------------------------------------------
# The HF folder


def write_hf(model: Any, target: Loaded, dest: Path, k: int) -> None:
    """config.json + model.safetensors (float32) + the target's tokenizer files + generation_config.json,
    replacing `dest` atomically. The generation config asks HF assisted generation for a constant K."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        target.tokenizer.save_pretrained(tmp)
        gen = copy.deepcopy(target.model.generation_config)
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = k, "constant"
        gen.save_pretrained(tmp)
        _replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@torch.inference_mode()
def assisted_greedy(target: Loaded, draft_model: Any, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """HF `generate(assistant_model=draft)` vs `generate()` alone, greedy, per prompt."""
    eos = eos_ids(target)
    kw = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
              pad_token_id=target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0])
    assist: dict[str, Any] = {"assistant_model": draft_model}
    same_rows = draft_model.config.vocab_size == target.model.config.vocab_size
    if not same_rows:  # transformers then insists on its text-level ("universal") path, given both tokenizers
        assist.update(tokenizer=target.tokenizer, assistant_tokenizer=target.tokenizer)
    rows = []
    for ids in prompts:
        x = torch.tensor([ids])
        ref = target.model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids):].tolist()
        out = target.model.generate(x, attention_mask=torch.ones_like(x), **assist, **kw)[0, len(ids):].tolist()
        rows.append({"tokens": len(ref), "equal": out == ref})
    return {"equal": all(r["equal"] for r in rows), "prompts": len(rows), "per_prompt": rows,
            "mode": "token-level" if same_rows else "universal (vocab sizes differ)"}


# ---------------------------------------------------------------------------------------------
# The verb


def _gguf_types(gguf_type: str | list[str]) -> list[str]:
    types = [t.strip().lower() for t in (gguf_type.split(",") if isinstance(gguf_type, str) else gguf_type)]
    bad = [t for t in types if t not in GGUF_TYPES]
    if bad or not types:
        raise DraftsmithError(f"GGUF type {', '.join(bad) or '(none)'}: expected {', '.join(GGUF_TYPES)}")
    return types


def _export_hf(model: Any, tgt: Loaded, hf_dir: Path, k: int, prompts: list[list[int]], max_new_tokens: int,
               failed: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    write_hf(model, tgt, hf_dir, k)
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    checks = {"reload": logits_diff(model, reloaded, prompts),
              "assisted_greedy": assisted_greedy(tgt, reloaded, prompts, max_new_tokens)}
    if checks["reload"]["max_abs_diff"] > HF_RELOAD_TOL:
        failed.append(f"HF reload: max |logit diff| {checks['reload']['max_abs_diff']:.3g} > {HF_RELOAD_TOL}")
    if not checks["assisted_greedy"]["equal"]:
        failed.append("HF assisted generation is not greedy-equal to the target")
    return {"path": str(hf_dir), "files": sorted(p.name for p in hf_dir.iterdir()), "checks": checks}


def _export_gguf(model: Any, draft: Loaded, path: Path, t: str, target_gguf: Path, prepared: tuple, name: str,
                 prompts: list[list[int]], failed: list[str]) -> dict:
    g = write_gguf(model, draft.tokenizer, path, target_gguf=target_gguf, gguf_type=t, name=name, prepared=prepared)
    g["checks"] = verify_gguf(path, model, prompts, g.pop("expected"))
    lg, (rel_tol, top1_tol) = g["checks"]["logits"], GGUF_TOL[t]
    g["tolerance"] = {"rel_max_abs_diff": rel_tol, "top1_agreement": top1_tol}
    if not g["checks"]["read_back"]["ok"]:
        failed.append(f"GGUF {t} read back: {g['checks']['read_back']['problems']}")
    if lg["rel_max_abs_diff"] > rel_tol or lg["top1_agreement"] < top1_tol:
        failed.append(f"GGUF {t} logits: relative max diff {lg['rel_max_abs_diff']:.3g} (tolerance {rel_tol}), "
                      f"top-1 {lg['top1_agreement']:.3f} (tolerance {top1_tol})")
    return g


def _check_llama_cpp(t_gguf: Path, drafts: dict[str, Path], prompts: list[list[int]], k: int,
                     failed: list[str], warnings: list[str], progress: bool) -> tuple[dict, dict]:
    """llama-server with each GGUF draft, between two runs of the target alone (before and after, so a machine
    that slows down or speeds up during the check shows): acceptance, tokens/s and the ratio to the target alone,
    and whether the greedy text equals the target's."""
    from distill.llama_cpp import check_with_llama_cpp

    def alone(when: str) -> dict:
        _say(f"llama-server: the target alone ({when})", progress)
        return check_with_llama_cpp(t_gguf, None, prompts, n_predict=64)

    before = alone("baseline")
    runs = {}
    for t, path in drafts.items():
        _say(f"llama-server: target with draft {path.name}", progress)
        runs[t] = check_with_llama_cpp(t_gguf, path, prompts, n_predict=64, draft_max=k)
    after = alone("baseline again")
    speeds = [r["tokens_per_s"] for r in (before, after) if r["tokens_per_s"]]
    base_tps = sum(speeds) / len(speeds) if speeds else None
    baseline = {"tokens_per_s": base_tps, "runs_tokens_per_s": [before["tokens_per_s"], after["tokens_per_s"]],
                "predicted_n": [before["predicted_n"], after["predicted_n"]], "contents": before["contents"],
                "prompts": before["prompts"], "command": before["command"], "server_version": before["server_version"]}
    for t, lc in runs.items():
        name = drafts[t].name
        lc["speedup_vs_target_only"] = lc["tokens_per_s"] / base_tps if lc["tokens_per_s"] and base_tps else None
        same = [a == b for a, b in zip(lc["contents"], before["contents"])]
        lc["greedy_equal"] = {"prompts": len(same), "equal": sum(same)}
        if not all(same):  # llama.cpp verifies K+1 tokens in one batch: its arithmetic can flip a near-tie
            warnings.append(f"llama.cpp's greedy text with {name} differs from the target alone on "
                            f"{len(same) - sum(same)} of {len(same)} prompts")
        if not lc["drafted"]:
            failed.append(f"llama.cpp drafted no tokens with {name} (see export.json log_tail)")
        elif not lc["accepted"]:
            warnings.append(f"llama.cpp accepted none of {lc['drafted']} tokens drafted by {name}")
    return runs, baseline


def export(
    draft: str, target: str, out: Path, fmt: str = "all", *, gguf_type: str | list[str] = "f16",
    best_k: int | None = None, info: dict | None = None, target_gguf: str | Path | None = None,
    check_llama_cpp: bool = False, n_prompts: int = 3, max_new_tokens: int = 32, progress: bool = True,
) -> dict:
    """Write and check the draft in format `fmt` ('hf', 'gguf' or 'all') under `out`; returns export.json's content.

    `gguf_type`: one type or several ('f16,q8_0'). `best_k` overrides the K of the serving lines; `info` overrides
    what the model card says (keys: best_k, speedup, speedup_detail, alpha_before, alpha_after, loss, data_source).
    `check_llama_cpp` serves the target with each GGUF draft through llama-server (distill.llama_cpp)."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"export format {fmt!r}: expected one of {', '.join(FORMATS)}")
    types = _gguf_types(gguf_type) if fmt in ("gguf", "all") else []
    if check_llama_cpp and not types:
        raise DraftsmithError("--check-llama-cpp needs a GGUF export (--format gguf or all)")
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
    warnings: list[str] = []
    failed: list[str] = []
    t_rows, d_rows = tgt.model.config.vocab_size, model.config.vocab_size
    if t_rows != d_rows:
        warnings.append(f"draft vocab_size {d_rows} != target {t_rows}: vLLM requires equal vocabulary sizes")
    summary: dict[str, Any] = {"draft": draft, "draft_path": str(d.path), "target": target,
                               "target_hf": str(tgt.path), "target_gguf": str(t_gguf) if t_gguf else None,
                               "format": fmt, "best_k": k, "best_k_source": k_src, "provenance": prov,
                               "warnings": warnings}
    prepared = prepare_vocab(model, d.tokenizer, t_gguf) if types else None  # refuse before writing anything
    hf_dir = out / "hf"
    if fmt in ("hf", "all"):
        _say(f"writing {hf_dir}, then reload and assisted-generation checks", progress)
        summary["hf"] = _export_hf(model, tgt, hf_dir, k, prompts, max_new_tokens, failed)
    summary["gguf"] = []
    for t in types:
        _say(f"writing {out / f'draft-{t}.gguf'}, then read-back and transformers logits checks", progress)
        summary["gguf"].append(_export_gguf(model, d, out / f"draft-{t}.gguf", t, t_gguf, prepared,
                                            f"draftsmith draft for {target}", prompts, failed))
    first_gguf = str(Path(summary["gguf"][0]["path"]).resolve()) if types else None
    summary["serving"] = serving_lines(str(tgt.path), str(hf_dir.resolve()) if "hf" in summary else None,
                                       str(t_gguf) if t_gguf else None, first_gguf, k)
    if check_llama_cpp:
        summary["llama_cpp"], summary["llama_cpp_target_only"] = _check_llama_cpp(
            t_gguf, {g["gguf_type"]: Path(g["path"]) for g in summary["gguf"]}, prompts, k, failed, warnings,
            progress)
    summary.update(ok=not failed, failed=failed, versions=versions(), seconds=time.perf_counter() - t0)
    card = model_card(summary)
    for folder in ([hf_dir] if "hf" in summary else []) + [out]:
        _write_text(folder / "README.md", card)
    atomic_write_json(out / "export.json", summary)
    if failed:
        raise DraftsmithError(f"export check failed ({out / 'export.json'}): {'; '.join(failed)}")
    return summary
