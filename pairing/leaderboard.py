"""Rank candidate drafts for a target: acceptance per domain, measured cost, predicted (and measured) speedup.

    .venv/bin/draftsmith pair --target qwen2.5-coder-1.5b-instruct \
        --candidates qwen2.5-coder-0.5b-instruct,smollm2-135m-instruct,derive:qwen2.5-coder-1.5b-instruct:keep=8 \
        --prompts code,chat --validate 1 --out runs/pair-qwen

Steps: compatibility check per candidate -> the target's reference continuations (generated once, cached)
-> teacher-forced acceptance of every candidate in one pass over the target -> measured cost c and v(K)
-> predicted speedup E[tau] / (K c + v(K)) and best K (overall and per domain) -> optionally, the built-in
decoder on the top N candidates at their best K for the measured speedup. Writes leaderboard.json, .md,
.csv and .html (with PNG plots) into --out.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


from decode.bench import validate_drafts
from decode.errors import DraftsmithError
from decode.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from decode.loading import Loaded, load
from decode.model import draft_quant, make_runner
from decode.prompts import Prompt, load_prompts
from decode.sampling import SamplingParams
from decode.textgen import eos_ids, machine_info, versions
from pairing.acceptance import measure_acceptance
from pairing.compat import check_pair
from pairing.cost import COST_CONTEXT, CostModel, best_k, measure_cost, speedup_curve
from pairing.derive import parse_derive_spec, resolve_candidate
from pairing.reference import reference_continuations

MAX_K = 16


@dataclass
class PairConfig:
    """The pair stage's settings (a recipe's `pair:` section and the options of `draftsmith pair`)."""

    candidates: list[str] = field(default_factory=list)  # drafts: zoo names, HF folders, .gguf, derive:MODEL:keep=N
    prompts_per_domain: int = 8  # prompts per domain for the acceptance measurement (0 = all)
    max_new_tokens: int = 64  # length of the target's reference continuations
    temperature: float = 0.0  # 0 = greedy acceptance (argmax agreement); > 0 = sum_x min(p, q) at that temperature
    validate: int = 0  # also decode with the top N candidates for a measured speedup
    validate_prompts: int = 4  # prompts per domain for the measured speedup
    draft_quant: str | None = "int8"  # int8 | null: draft weights on CPU (exactness is unaffected)
    batch_size: int = 4  # reference continuations scored together
    seed: int = 0  # sampling seed of the reference continuations (temperature > 0)

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("candidates: name at least one draft (zoo name, HF folder, derive:MODEL:keep=N)")
        for name in ("max_new_tokens", "validate_prompts", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompts_per_domain < 0:
            raise ValueError(f"prompts_per_domain must be >= 0 (0 = all), got {self.prompts_per_domain}")
        if self.validate < 0:
            raise ValueError(f"validate must be >= 0, got {self.validate}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.draft_quant not in (None, "int8"):
            raise ValueError(f"draft_quant must be int8 or null, got {self.draft_quant!r}")


@dataclass
class Candidate:
    spec: str
    loaded: Loaded
    compat: object
    row: dict = field(default_factory=dict)


def _params_million(model) -> float:
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 1)


def _validate(target: Loaded, t_run, cand: Candidate, prompts: list[Prompt], refs, k: int, cfg: PairConfig,
              device: str) -> dict:
    """Measured speedup of one candidate (decode.bench.validate_drafts), with the per-round view of the breakdown."""
    by_id = {r["id"]: r for r in refs}
    d_run = make_runner(cand.loaded.model, t_run.max_seq_len, quantize=draft_quant(cand.loaded.model, cfg.draft_quant))
    val = validate_drafts(t_run, {"speculative": d_run}, [by_id[p.id]["prompt_ids"] for p in prompts], k=k,
                          max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids(target), names=[p.id for p in prompts],
                          greedy=cfg.temperature == 0, desc=f"validate {cand.spec}", device=device)
    base, spec = val.stats["target_only"], val.stats["speculative"]
    rounds = spec.target_forwards
    return {
        "k": k, "prompts": len(prompts), "target_only_tok_per_s": base.tokens_per_s,
        "speculative_tok_per_s": spec.tokens_per_s, "target_only_seconds": base.seconds,
        "speculative_seconds": spec.seconds, "tokens": spec.new_tokens,
        "measured_speedup": val.speedup("speculative"),
        "greedy_equal": val.greedy_equal["speculative"] is not False,
        "mean_tau": spec.mean_tau,
        "rounds": rounds,
        "spec_tokens_per_round": spec.new_tokens / rounds,
        "measured_round_s": spec.seconds / rounds,
        "measured_target_step_s": base.seconds / base.new_tokens,
    }


def _breakdown(row: dict, val: dict) -> dict:
    """Where predicted and measured speedup part ways: tokens per round (acceptance) or time per round (cost)."""
    K, t = val["k"], row["timings"]
    modeled_round = K * t["draft_step_s"] + t["verify_s"][str(K)]
    return {
        "expected_tau": row["expected_tau"][str(K)], "measured_tau": val["spec_tokens_per_round"],
        "modeled_round_s": modeled_round, "measured_round_s": val["measured_round_s"],
        "modeled_target_step_s": t["target_step_s"], "measured_target_step_s": val["measured_target_step_s"],
    }


def run_pair(target_spec: str, out: Path, cfg: PairConfig, *, prompts: str = "code,chat",
             limit_per_domain: int | None = None, device: str = "cpu", progress: bool = True) -> dict:
    """The whole leaderboard run; returns the leaderboard dict (also written to `out`).

    `prompts`: suite names or a file; `limit_per_domain` caps the prompts per domain before the pair's own
    `prompts_per_domain` does (a recipe's shared limit)."""
    candidate_specs = cfg.candidates
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source = prompts
    limits = [n for n in (cfg.prompts_per_domain, limit_per_domain) if n]
    prompts = load_prompts(source, limit_per_domain=min(limits) if limits else None)
    params = SamplingParams(cfg.temperature)

    target = load(target_spec, device=device)
    cands: list[Candidate] = []
    for spec in candidate_specs:
        loaded = load(resolve_candidate(spec), device=device)
        loaded.name = spec
        cands.append(Candidate(spec, loaded, check_pair(target, loaded)))

    # a same-tokenizer candidate speeds up the references (exactly); derived drafts start near alpha 0 and would
    # slow them down, so they never help
    helper = next((c.loaded for c in cands if c.compat.compatible and parse_derive_spec(c.spec) is None), None)
    refs = reference_continuations(target, prompts, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature, seed=cfg.seed, draft=helper,
                                   progress=progress)
    accs = measure_acceptance(target, [c.loaded for c in cands], refs, params=params,
                              batch_size=cfg.batch_size, progress=progress)

    max_len = max(len(r) for r in refs["prompt_ids"]) + cfg.max_new_tokens + MAX_K + 2
    t_runner = make_runner(target.model, max(max_len, COST_CONTEXT + MAX_K + 2))
    v_ratios: dict[int, float] | None = None
    for cand, acc in zip(cands, accs):
        d_runner = make_runner(cand.loaded.model, t_runner.max_seq_len,
                               quantize=draft_quant(cand.loaded.model, cfg.draft_quant))
        if v_ratios is None:  # v(K) is the target's alone: measure the whole curve once
            cost = measure_cost(t_runner, d_runner, ks=range(1, MAX_K + 1), repeats=3, warmup=1,
                                device=device)
            v_ratios = cost.v
        else:  # c side by side with the target step; v(K) reused as ratios to that step
            quick = measure_cost(t_runner, d_runner, ks=[1], repeats=5, warmup=1, device=device)
            cost = CostModel(quick.target_step_s, quick.draft_step_s,
                             {K: v * quick.target_step_s for K, v in v_ratios.items()}, quick.context, quick.repeats)
        del d_runner
        k, pred = best_k(acc.alpha, cost.c, cost.v)
        cand.row = {
            "draft": cand.spec,
            "params": _params_million(cand.loaded.model),
            "params_unit": "million",
            "compatible": cand.compat.compatible,
            "kind": cand.compat.kind,
            "compat_notes": cand.compat.notes,
            "llama_cpp_compatible": cand.compat.llama_cpp,
            "llama_cpp_notes": cand.compat.llama_cpp_notes,
            "alpha": acc.alpha,
            "alpha_by_domain": acc.alpha_by_domain,
            "positions": acc.positions,
            "positions_by_domain": acc.positions_by_domain,
            "acceptance_method": acc.method,
            "alpha_by_position": acc.by_position,
            "expected_tau": {str(K): t for K, t in acc.expected_tau.items()},
            "cost_ratio": cost.c,
            "verify_cost": {str(K): v for K, v in cost.v.items()},
            "timings": cost.to_dict(),
            "best_k": k,
            "predicted_speedup": pred,
            "predicted_speedup_by_k": {str(K): s for K, s in speedup_curve(acc.alpha, cost.c, cost.v).items()},
            "best_k_by_domain": {d: best_k(a, cost.c, cost.v)[0] for d, a in acc.alpha_by_domain.items()},
            "predicted_speedup_by_domain": {d: best_k(a, cost.c, cost.v)[1] for d, a in acc.alpha_by_domain.items()},
            "measured_speedup": None,
            "validation": None,
        }
    cands.sort(key=lambda c: c.row["predicted_speedup"], reverse=True)

    if cfg.validate:
        chosen = [c for c in cands if c.compat.compatible][: cfg.validate]
        val_prompts = load_prompts(source, limit_per_domain=cfg.validate_prompts)
        val_prompts = [p for p in val_prompts if p.id in set(refs["id"])]
        for cand in chosen:
            val = _validate(target, t_runner, cand, val_prompts, refs, cand.row["best_k"], cfg, device)
            cand.row["validation"] = val
            cand.row["measured_speedup"] = val["measured_speedup"]
            gap = abs(val["measured_speedup"] - cand.row["predicted_speedup"]) / val["measured_speedup"]
            cand.row["prediction_error"] = gap
            cand.row["prediction_breakdown"] = _breakdown(cand.row, val)
        for cand in cands:
            if not cand.compat.compatible and cand.row["measured_speedup"] is None:
                cand.row["validation_note"] = "cross-tokenizer: the token-level decoder cannot run it; not validated"

    board = {
        "target": target_spec,
        "machine": machine_info(),
        "versions": versions(),
        "settings": {**asdict(cfg), "prompts": source, "limit_per_domain": limit_per_domain, "device": device,
                     "n_prompts": len(prompts),
                     "domains": sorted({p.domain for p in prompts})},
        "definitions": {
            "alpha": "mean over positions of beta_t = sum_x min(p_t(x), q_t(x)), teacher-forced on the target's continuations",
            "tau": "tokens emitted per target forward, including the bonus/corrected token",
            "cost_ratio": "one-token draft forward / one-token target forward (cached), measured here",
            "verify_cost": "target forward over K+1 tokens / over 1 token, measured here",
            "predicted_speedup": "E[tau] / (K * cost_ratio + verify_cost(K))",
        },
        "seconds": time.perf_counter() - t0,
        "candidates": [c.row for c in cands],
    }
    write_leaderboard(board, out)
    return board


# --- outputs ----------------------------------------------------------------------------------


def _fmt(v, nd: int = 2) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def table_rows(board: dict) -> tuple[list[str], list[list[str]]]:
    domains = board["settings"]["domains"]
    head = ["draft", "kind", "params (M)", "alpha", *[f"alpha {d}" for d in domains], "c", "v(best K)",
            "best K", "predicted", "measured", "llama.cpp"]
    rows = []
    for c in board["candidates"]:
        rows.append([
            c["draft"], c["kind"], _fmt(c["params"], 1), _fmt(c["alpha"], 3),
            *[_fmt(c["alpha_by_domain"].get(d), 3) for d in domains],
            _fmt(c["cost_ratio"], 3), _fmt(c["verify_cost"][str(c["best_k"])]), str(c["best_k"]),
            _fmt(c["predicted_speedup"]) + "x", (_fmt(c["measured_speedup"]) + "x") if c["measured_speedup"] else "-",
            {True: "pass", False: "fail", None: "-"}[c["llama_cpp_compatible"]],
        ])
    return head, rows


def markdown(board: dict) -> str:
    head, rows = table_rows(board)
    lines = [f"# Draft leaderboard for `{board['target']}`", "",
             f"{board['settings']['n_prompts']} prompts ({board['settings']['prompts']}), "
             f"{board['settings']['max_new_tokens']} reference tokens each, temperature {board['settings']['temperature']}; "
             f"machine: {board['machine']['cpu']} ({board['machine']['cpu_count']} cores).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "alpha: teacher-forced mean of sum min(p, q); c: draft step / target step; v(K): target over K+1 "
              "tokens / over 1; predicted speedup = E[tau] / (K c + v(K)); tau counts the bonus token."]
    for c in board["candidates"]:
        v = c.get("validation")
        if v:
            lines.append(f"\nValidated `{c['draft']}` at K={v['k']} on {v['prompts']} prompts: target-only "
                         f"{v['target_only_tok_per_s']:.2f} tok/s, speculative {v['speculative_tok_per_s']:.2f} tok/s, "
                         f"measured {v['measured_speedup']:.2f}x vs predicted {c['predicted_speedup']:.2f}x "
                         f"(error {100 * c['prediction_error']:.0f}%), greedy equal: {v['greedy_equal']}.")
            b = c.get("prediction_breakdown")
            if b and c["prediction_error"] > 0.15:
                lines.append(
                    f"Why they differ: tokens per round {b['measured_tau']:.2f} measured vs {b['expected_tau']:.2f} "
                    f"expected from alpha (i.i.d. assumption); seconds per round {b['measured_round_s']:.3f} measured "
                    f"vs {b['modeled_round_s']:.3f} modeled (K draft steps + one verify, timed in isolation); target "
                    f"step {b['measured_target_step_s']:.3f} s in the decoder vs {b['modeled_target_step_s']:.3f} s "
                    "timed in isolation.")
        if c.get("validation_note"):
            lines.append(f"\n`{c['draft']}`: {c['validation_note']}.")
        for note in c["compat_notes"]:
            lines.append(f"- `{c['draft']}`: {note}")
    return "\n".join(lines) + "\n"


def _plots(board: dict) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs = {}
    cands, domains = board["candidates"], board["settings"]["domains"]

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(1, len(cands))
    for i, c in enumerate(cands):
        xs = [j + i * width for j in range(len(domains))]
        ax.bar(xs, [c["alpha_by_domain"].get(d, 0) for d in domains], width, label=c["draft"])
    ax.set_xticks([j + width * (len(cands) - 1) / 2 for j in range(len(domains))], domains)
    ax.set_ylabel("alpha"), ax.set_ylim(0, 1), ax.set_title("acceptance by domain"), ax.legend(fontsize=7)
    pngs["alpha_by_domain.png"] = png_bytes(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for c in cands:
        ks = sorted(int(k) for k in c["predicted_speedup_by_k"])
        ax.plot(ks, [c["predicted_speedup_by_k"][str(k)] for k in ks], marker="o", ms=3, label=c["draft"])
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("K (draft tokens per step)"), ax.set_ylabel("predicted speedup"), ax.legend(fontsize=7)
    ax.set_title("predicted speedup vs K (measured c and v(K))")
    pngs["speedup_vs_k.png"] = png_bytes(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for c in cands:
        ax.plot(range(len(c["alpha_by_position"])), c["alpha_by_position"], label=c["draft"])
    ax.set_xlabel("position in continuation"), ax.set_ylabel("mean beta"), ax.set_ylim(0, 1.02)
    ax.set_title("acceptance by position"), ax.legend(fontsize=7)
    pngs["alpha_by_position.png"] = png_bytes(fig)
    plt.close("all")
    return pngs


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def html_page(board: dict, pngs: dict[str, bytes]) -> str:
    head, rows = table_rows(board)
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>" for r in rows)
    imgs = "".join(f'<figure><img alt="{html.escape(n)}" src="data:image/png;base64,{base64.b64encode(b).decode()}">'
                   f"</figure>" for n, b in pngs.items())
    return (f"<!doctype html><meta charset=utf-8><title>draftsmith leaderboard: {html.escape(board['target'])}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:4px 8px;text-align:right}td:first-child{text-align:left}</style>"
            f"<h1>Draft leaderboard for {html.escape(board['target'])}</h1><table><tr>{cells}</tr>{body}</table>"
            f"<pre>{html.escape(markdown(board).split(chr(10) + chr(10), 3)[-1])}</pre>{imgs}")


def write_leaderboard(board: dict, out: Path) -> None:
    """leaderboard.json, .md, .csv, .html and the plots (PNG) into `out`, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "leaderboard.json", board)
    pngs = _plots(board)
    texts = {"leaderboard.md": markdown(board), "leaderboard.html": html_page(board, pngs)}
    head, rows = table_rows(board)
    buf = io.StringIO()
    csv.writer(buf).writerows([head, *rows])
    texts["leaderboard.csv"] = buf.getvalue()
    for name, text in texts.items():
        atomic_write_text(out / name, text)
    for name, data in pngs.items():
        atomic_write_bytes(out / name, data)


def split_candidates(text: str) -> list[str]:
    """Split 'a,b,derive:m:layers=0,1,2,c' on commas, keeping the layer list of a derive spec together."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if out and out[-1].startswith("derive:") and "layers=" in out[-1] and part.replace("-", "").isdigit():
            out[-1] += "," + part
        else:
            out.append(part)
    return out

