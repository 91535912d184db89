"""The run folder's report: report.md and report.html (plots as PNG), rebuilt from whatever stages have finished.

    from draftsmith.recipes.report import write_report; write_report(Path("runs/quickstart"))

Sections: stages (status, time), the pairing leaderboard, training curves (loss and alpha vs step), alpha by
domain before and after distillation, tokens/s of target alone / un-distilled / distilled draft with ratios
and the chosen K, and the export paths with the vLLM / SGLang / llama.cpp lines.

It only renders: each stage's result is read through its type (`pairing.leaderboard.PairLeaderboard`,
`distill.results`, `pairing.validate.BenchResult`, `distill.export.results`; `read_results`), and the verdict
above everything is the validate stage's (`pairing.validate.verdict`).
"""

from __future__ import annotations

import base64
import html
import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.decode.runtime.io import atomic_write_bytes, atomic_write_text, png_bytes, read_json
from draftsmith.distill.export.model_card import PREDICTION_HEADERS, llama_cpp_result, prediction_lines, prediction_rows
from draftsmith.distill.export.results import DraftExport, HeadExport, read_export
from draftsmith.distill.results import (DataCap, DistillResult, HeadData, HeadResult, HeadSettings, PromptStats,
                                        RowStats, TrainLog, read_log)
from draftsmith.pairing.ladder import waterfall
from draftsmith.pairing.leaderboard import PairLeaderboard, table_rows
from draftsmith.pairing.race import PICK, RaceResult
from draftsmith.pairing.validate import RACED, BenchResult, verdict

_STYLE = ("<style>body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}"
          "pre{background:#f4f4f4;padding:.6em;white-space:pre-wrap}"
          ".verdict{border:2px solid #2a7;background:#effaf3;padding:.6em 1em;font-size:1.1em;margin:1em 0}"
          ".verdict.no{border-color:#c33;background:#fdf0f0}.table{overflow-x:auto}img{max-width:100%}</style>")


def fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


@dataclass
class Doc:
    """A tiny document model rendered both to Markdown (images as files) and to self-contained HTML."""

    title: str
    blocks: list[tuple] = field(default_factory=list)
    images: dict[str, bytes] = field(default_factory=dict)

    def h(self, text: str) -> None:
        self.blocks.append(("h", text))

    def verdict(self, text: str, pays: bool) -> None:
        """The run's answer in one paragraph, above everything else."""
        self.blocks.append(("verdict", text, pays))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def code(self, text: str) -> None:
        self.blocks.append(("code", text))

    def table(self, head: list[str], rows: list[list[Any]]) -> None:
        self.blocks.append(("table", head, [[fmt(c) if not isinstance(c, str) else c for c in r] for r in rows]))

    def image(self, name: str, png: bytes) -> None:
        self.images[name] = png
        self.blocks.append(("img", name))

    def markdown(self, image_dir: str) -> str:
        out = [f"# {self.title}", ""]
        for b in self.blocks:
            if b[0] == "h":
                out += [f"## {b[1]}", ""]
            elif b[0] == "p":
                out += [b[1], ""]
            elif b[0] == "verdict":
                out += [f"**Verdict: {b[1]}**", ""]
            elif b[0] == "code":
                out += ["```", b[1], "```", ""]
            elif b[0] == "table":
                out += ["| " + " | ".join(b[1]) + " |", "|" + "---|" * len(b[1])]
                out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in b[2]] + [""]
            else:
                out += [f"![{b[1]}]({image_dir}/{b[1]})", ""]
        return "\n".join(out)

    def html(self) -> str:
        e = html.escape
        out = [f"<!doctype html><meta charset=utf-8><title>{e(self.title)}</title>",
               _STYLE, f"<h1>{e(self.title)}</h1>"]
        for b in self.blocks:
            if b[0] == "h":
                out.append(f"<h2>{e(b[1])}</h2>")
            elif b[0] == "p":
                out.append(f"<p>{e(b[1])}</p>")
            elif b[0] == "verdict":
                out.append(f'<div class="verdict{"" if b[2] else " no"}"><b>Verdict:</b> {e(b[1])}</div>')
            elif b[0] == "code":
                out.append(f"<pre>{e(b[1])}</pre>")
            elif b[0] == "table":
                head = "".join(f"<th>{e(h)}</th>" for h in b[1])
                rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in b[2])
                out.append(f'<div class="table"><table><tr>{head}</tr>{rows}</table></div>')
            else:
                data = base64.b64encode(self.images[b[1]]).decode()
                out.append(f'<figure><img alt="{e(b[1])}" src="data:image/png;base64,{data}"></figure>')
        return "\n".join(out) + "\n"

    def write(self, folder: Path, stem: str) -> None:
        """<stem>.md, <stem>.html and <stem>/*.png, each written atomically."""
        img_dir = folder / stem
        if self.images:
            img_dir.mkdir(parents=True, exist_ok=True)
        for name, data in self.images.items():
            atomic_write_bytes(img_dir / name, data)
        atomic_write_text(folder / f"{stem}.md", self.markdown(stem))
        atomic_write_text(folder / f"{stem}.html", self.html())


@dataclass
class RunResults:
    """Every result a run folder holds, each read through its stage's type (None: not written yet)."""

    stages: dict[str, dict]  # state.json's: stage -> {status, seconds, finished, ...}
    board: PairLeaderboard | None = None
    prompts: PromptStats | None = None
    rows: RowStats | None = None
    head: HeadResult | None = None
    race: RaceResult | None = None
    distill: DistillResult | None = None
    log: TrainLog = field(default_factory=lambda: TrainLog([], []))
    bench: BenchResult | None = None
    export: HeadExport | DraftExport | None = None


_RESULTS: dict[str, tuple[str, str, Callable]] = {  # field -> (file, what it is, its type's reader)
    "board": ("pairing/leaderboard.json", "leaderboard", PairLeaderboard.from_dict),
    "prompts": ("data/prompts/stats.json", "prompt statistics", PromptStats.from_dict),
    "rows": ("data/rows/stats.json", "data stats", RowStats.from_dict),
    "head": ("distill/head.json", "head result", HeadResult.from_dict),
    "race": (f"race/{PICK}", "race result", RaceResult.from_dict),
    "distill": ("distill/distill.json", "distill result", DistillResult.from_dict),
    "bench": ("validate/bench.json", "bench result", BenchResult.from_dict),
    "export": ("export/export.json", "export result", read_export),
}


def read_results(run: Path) -> RunResults:
    """The run folder's results, typed; a corrupt or unreadable one is a one-line DraftsmithError naming its
    file (an empty JSON object reads as not written)."""
    state = {"stages": {}, **(read_json(run / "state.json", missing_ok=True, what="run state") or {})}
    found = {}
    for name, (rel, what, read) in _RESULTS.items():
        d = read_json(run / rel, missing_ok=True, what=what)
        found[name] = read(d, str(run / rel)) if d else None
    if found["race"] is None:  # a run from before the race stage: its distill stage ranked and raced
        d = read_json(run / "distill" / "fastest.json", missing_ok=True, what="race result")
        found["race"] = RaceResult.from_dict(d, str(run / "distill" / "fastest.json")) if d else None
    return RunResults(state["stages"], log=read_log(run / "distill" / "log.jsonl"), **found)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --- sections ------------------------------------------------------------------------------------------


def _stages(doc: Doc, state: dict) -> None:
    rows = [[s, e["status"], f"{e['seconds']:.0f}", e["finished"]]
            for s, e in ((s, {"status": "-", "seconds": 0, "finished": "-", **e}) for s, e in state.items())]
    if rows:
        doc.table(["stage", "status", "seconds", "finished (UTC)"], rows)


def _pairing(doc: Doc, board: PairLeaderboard | None) -> None:
    if board is None:
        return
    doc.h("Pairing leaderboard")
    s = board.settings
    doc.p(f"Target `{board.target}`; {s['n_prompts']} prompts ({s['prompts']}), {s['max_new_tokens']} reference "
          "tokens each. alpha is teacher-forced; predicted speedup: tokens per round walked on the teacher-forced rows "
          "as the decoder walks them, over the round cost timed in the decoder (docs/design.md); tau counts the bonus "
          "token. Full page: pairing/leaderboard.html.")
    head, rows = table_rows(board.to_dict())
    doc.table(head, rows)


def _data(doc: Doc, p: PromptStats | None, r: RowStats | None) -> None:
    """The data stage: how many requests the target wrote and kept, and how fast it answered them."""
    if p is None and r is None:
        return
    doc.h("Data the target wrote")
    if p is not None:
        doc.p(f"{p.kept} requests kept ({', '.join(f'{d} {n}' for d, n in p.kept_by_domain.items())}); unique "
              f"fraction {p.unique_fraction:.3f}; rejected: "
              f"{', '.join(f'{k} {v}' for k, v in p.rejected.items())}.")
    if r is not None:
        doc.p(f"{r.rows} answers, {r.new_tokens} new tokens in {r.seconds:.0f} s: {r.tokens_per_s:.1f} "
              f"tokens/s at batch {r.batch_size}" + (f" on {r.processes} processes" if r.processes else "") + ".")


def _written(w: HeadData | None, cfg: HeadSettings) -> str:
    """The rows the target wrote for prompts of its own (`w`: head.json's written_data), if any."""
    if not w:
        return ""
    prompts = w.rows // max(1, cfg.written_samples)
    return (f", and {w.rows} rows ({w.tokens} tokens, {w.new_tokens} generated at "
            f"{w.generate_tokens_per_s:.0f} tokens/s) answering {prompts} prompts the target wrote itself")


def _data_cap(cap: DataCap | None) -> str:
    """What the data's share of the time budget cut, if anything."""
    if not cap or not cap.cut():
        return ""
    what = [f"{cap.cut_shards} batches of answers cut short"] if cap.cut_shards else []
    what += [f"{cap.skipped_shards} batches not written"] if cap.skipped_shards else []
    what += [f"{' and '.join(cap.left_out)} left out"] if cap.left_out else []
    return (f" (the data stopped at its share of the budget, {cap.seconds / 60:.1f} min: {', '.join(what)}; "
            "a faster CPU writes it whole)")


def _dtypes(cfg: HeadSettings) -> str:
    """Where bfloat16 wrote the data or ran training's matmuls."""
    parts = [what for dtype, what in ((cfg.gen_dtype, "data written"), (cfg.train_dtype, "training's matmuls"))
             if dtype == "bfloat16"]
    return f" ({' and '.join(parts)} in bfloat16)" if parts else ""


def _head(doc: Doc, h: HeadResult) -> None:
    """A head run's distill stage: data, training, held-out agreement by depth against tokens seen."""
    cfg, ts, d = h.config, h.train_summary, h.data
    doc.h("Draft head (EAGLE-3 style)")
    doc.p(f"A head for `{h.target}` reading layers {h.aux_layers}: {d.rows} training rows "
          f"({d.tokens} tokens, {d.new_tokens} generated at {d.generate_tokens_per_s:.0f} tokens/s; "
          f"{fmt(cfg.samples)} samples per prompt at temperature {cfg.temperature}) from {h.train_prompts} "
          f"prompts{_written(h.written_data, cfg)}; {ts.steps} steps of {cfg.rows_per_step} rows ({ts.tokens_seen} tokens "
          f"seen) in {ts.seconds / 60:.1f} min{_dtypes(cfg)}; draft vocabulary {cfg.draft_vocab_size} ids "
          f"({100 * ts.draft_vocab_coverage:.1f}% of the target's predictions). Agreement with the target's "
          f"greedy token on {h.held_out_prompts} held-out prompts (teacher-forced; depths >= 2 fed by the head):"
          f"{_data_cap(h.data_cap)}")
    depths = len(h.agreement_after)
    doc.table(["tokens seen", *[f"depth {j + 1}" for j in range(depths)]],
              [[c["tokens"], *c["agreement_by_depth"]] for c in h.curve])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for j in range(depths):
        ax.plot([c["tokens"] for c in h.curve], [c["agreement_by_depth"][j] or 0 for c in h.curve],
                marker="o", label=f"depth {j + 1}")
    ax.set_xlabel("training tokens seen"), ax.set_ylabel("held-out agreement"), ax.set_ylim(0, 1), ax.legend()
    doc.image("head_agreement.png", png_bytes(fig))


def _weights(b: BenchResult) -> str:
    """'draft weights int8', or each draft's where they differ (an int4 draft beside the int8 stock one)."""
    by = b.quant_by_draft or {}
    if b.kind != "head" and len(set(by.values())) > 1:
        return "draft weights " + ", ".join(f"{q or 'float32'} ({b.label(n)})" for n, q in by.items())
    return f"draft weights {b.draft_quant or 'float32'}"


def _race(doc: Doc, made: RaceResult | None) -> None:
    if made is None:
        return
    doc.h("Race: the stock draft beside its variants (int4, vocabulary-pruned, trained)")
    counted = (f"Kept ids counted on the target's greedy answers to {len(made.counted_prompts)} dev prompts the "
               "ranking does not read; r" if made.counted_prompts else "R")
    lines = ("the trained draft's spec and its untrained equivalent's, one a line" if made.trained else
             "`draftsmith pair --candidates \"$(cat draft.txt)\"` ranks it again")
    doc.p(f"{counted}anked and raced on dev prompts, each draft at the policy walked for it. Winner: `{made.draft}` "
          f"(draft.txt: {lines}).")
    worst = any(r.worst_over_reference is not None for r in made.ranking)
    doc.table(["draft", "alpha", "best K", "predicted speedup", "measured speedup (dev)"]
              + (["worst domain over the base at its walked policy (dev)"] if worst else []),
              [[r.draft, r.alpha, r.best_k, r.predicted_speedup, r.measured_speedup]
               + ([r.worst_over_reference] if worst else []) for r in made.ranking])
    doc.p(f"Chosen by: {made.chosen_by}.")


def _trained_how(cfg) -> str:
    """What trained: LoRA, the int4 draft's own group pairs (`distill.groups`), or every weight."""
    if cfg.lora_r:
        return f"LoRA r={cfg.lora_r}"
    if cfg.base_quant:
        return f"the {cfg.base_quant} draft's own group pairs (scale, minimum; nibbles frozen), biases and norms"
    return "full fine-tuning"


def _distill(doc: Doc, res: RunResults) -> None:
    if res.head is not None:
        _head(doc, res.head)
        return
    log, result = res.log, res.distill
    if not log and result is None:
        return
    doc.h("Distillation")
    if result is not None:
        cfg = result.config
        doc.p(f"Draft `{result.draft}` distilled toward `{result.target}`: loss {cfg.loss}, data "
              f"{result.data_source} ({result.data_rows} rows from {result.train_prompts} prompts), "
              f"{cfg.steps} steps x batch {cfg.batch_size}, lr {cfg.lr}, "
              f"{_trained_how(cfg)}. alpha on "
              f"{result.held_out_prompts} held-out prompts (never trained on): {fmt(result.alpha_before)} -> "
              f"{fmt(result.alpha_after)} (gain {fmt(result.alpha_gain)}).")
        if result.skipped_note:
            doc.p(f"Warning: {result.skipped_note}.")
        if result.served:
            forms = result.served["forms"]
            doc.p(f"Trained over its int4 weights ({'LoRA' if cfg.lora_r else 'its group pairs'}); the forms it "
                  "can serve in, measured on the held-out "
                  f"references: it serves `{result.served_spec}` ({result.served['pick']}: the faster of those within "
                  f"{result.served['tie']} agreement of the best).")
            doc.table(["form", "spec", "agreement (held out)", "draft step (ms)"],
                      [[n, f["spec"], f["agreement"], f["step_ms"]] for n, f in forms.items()])
    _training(doc, log, result.train_summary.best_step if result is not None else None)
    if result is not None and result.curve and len(result.curve.get("points", [])) > 1:
        _curve(doc, result.curve)


def _curve(doc: Doc, curve: dict) -> None:
    """alpha against the tokens trained on (held out), the fitted curve and what it predicts."""
    pts, fit = curve["points"], curve.get("fit")
    doc.h("alpha against the tokens trained on")
    need = curve.get("tokens_for_gain")
    if fit:
        doc.p(f"Held-out alpha at each evaluation against the training tokens seen so far; fitted alpha = "
              f"{fit['a']:.4f} + {fit['b']:.4f} ln(tokens) on {fit['points']} points after training began. "
              + (f"It predicts {need:,.0f} tokens for +{curve['gain']} alpha over the untrained draft "
                 f"({need / max(curve['tokens_seen'], 1):.1f}x the {curve['tokens_seen']:,} seen here): an "
                 "extrapolation, what a longer run would have to budget." if need else
                 f"The fit does not rise: it predicts no token count for +{curve['gain']} alpha."))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([max(p["tokens"], 1) for p in pts], [p["alpha"] for p in pts], "o", label="measured (held out)")
    if fit:
        hi = max(need or 0, pts[-1]["tokens"]) * 1.2
        lo = min(p["tokens"] for p in pts if p["tokens"] > 0)
        xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]
        ax.plot(xs, [fit["a"] + fit["b"] * math.log(x) for x in xs], "-", lw=1, label="fit: a + b ln(tokens)")
    ax.set_xscale("log"), ax.set_xlabel("tokens trained on"), ax.set_ylabel("alpha (held out)"), ax.legend(fontsize=7)
    ax.set_title("learning curve", fontsize=9)
    doc.image("learning_curve.png", png_bytes(fig))


def _training(doc: Doc, log: TrainLog, best_step: int | None) -> None:
    """alpha by domain before and after (the checkpoint kept: `best_step`), and the training curves."""
    evals, train = log.evals, log.steps
    if evals:
        first, best = evals[0], log.best_eval(best_step)
        domains = sorted(first.alpha_by_domain)
        doc.table(["domain", "alpha before", f"alpha after (step {best.step})", "gain"],
                  [[d, first.alpha_by_domain[d], best.alpha_in(d), best.alpha_in(d, 0) - first.alpha_by_domain[d]]
                   for d in domains] + [["all", first.alpha, best.alpha, best.alpha - first.alpha]])
        plt = _plt()
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.bar([i - 0.2 for i in range(len(domains))], [first.alpha_by_domain[d] for d in domains], 0.4,
               label="before")
        ax.bar([i + 0.2 for i in range(len(domains))], [best.alpha_in(d, 0) for d in domains], 0.4, label="after")
        ax.set_xticks(range(len(domains)), domains)
        ax.set_ylabel("alpha (held out)"), ax.set_ylim(0, 1), ax.legend(), ax.set_title("alpha by domain")
        doc.image("alpha_by_domain.png", png_bytes(fig))
    if train or evals:
        plt = _plt()
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
        if train:
            a1.plot([r.step for r in train], [r.loss for r in train], lw=1)
        a1.set_xlabel("step"), a1.set_ylabel("training loss"), a1.set_title("loss")
        if evals:
            a2.plot([r.step for r in evals], [r.alpha for r in evals], marker="o")
        a2.set_xlabel("step"), a2.set_ylabel("alpha (held out)"), a2.set_title("alpha")
        doc.image("training.png", png_bytes(fig))


def _validation(doc: Doc, b: BenchResult | None) -> None:
    if b is None or b.validation is None:  # no result, or only its summary (the verdict reads that)
        return
    val = b.validation  # the typed result of decode.bench.validate_drafts; the rest is the stage's context
    doc.h("Validation: tokens/s of our decoder")
    split = ("held-out prompts" if b.prompt_roles is None else
             "held-out dev prompts (in-sample: no test split)" if b.in_sample else "test prompts")
    doc.p(f"{len(val.prompts)} {split} x {val.max_new_tokens} new tokens, greedy, all decoders interleaved "
          f"in one run" + (f" of {len(val.repeats)} repeats (the decoder going first rotating; speedups are their "
                            f"median, with the range)" if len(val.repeats) > 1 else "")
          + f" on {b.machine['cpu']} ({b.machine['cpu_count']} cores). "
          f"K = {val.k} ({b.k_reason})"
          + "".join(f", {b.label(n)} at K = {K}" for n, K in val.ks.items())
          + "; "
          + _weights(b)
          + (f", head weights {b.head_quant or 'float32'}" if b.kind == "head" else "")
          + (f"; measured c = {fmt(b.cost_ratio)}" if b.cost_ratio is not None else "")
          + ". tau = tokens per target forward, bonus token included.")
    rows = _decoder_rows(b)
    doc.table(["decoder", "K", "tok/s", "vs target alone (range)", "mean tau", "accepted/drafted", "greedy equal"], rows)
    groups = val.by_group() if val.prompt_stats else {}
    if len(groups) > 1:
        doc.table(["domain", "prompts", *(f"{b.label(n)} vs target alone" for n in val.drafts)],
                  [[g, len(v["prompts"]), *(f"{v['speedup_vs_target_only'][n]:.2f}x ({v['speedup_range'][n][0]:.2f}-"
                                            f"{v['speedup_range'][n][1]:.2f})" for n in val.drafts)]
                   for g, v in groups.items()])
    if "draft_after" in val.stats and "draft_before" in val.stats:
        what = ("Head vs standalone draft (not the same policy search: the head's rounds walked on dev prompts, the "
                "standalone draft at its ranking's plain K)" if b.kind == "head" else
                f"{b.label('draft_after')} vs {b.label('draft_before')} (the same policy search)"
                if b.kind in RACED else "Distilled vs un-distilled draft (both at the distilled draft's policy)")
        per = "".join(f"; {g} {v['median']:.2f}x ({v['range'][0]:.2f}-{v['range'][1]:.2f})"
                      for g, v in (b.after_vs_before or {}).items())
        doc.p(f"{what}: {val.tok_per_s['draft_after'] / val.tok_per_s['draft_before']:.2f}x tokens/s"
              + (f" (each repeat's ratio, median and range: {per[2:]})" if per else "") + ".")
    title = f"decoders, K={val.k}" + ("" if not val.ks else " (some at their own K)")
    doc.image("speed.png", png_bytes(speed_figure([r[0] for r in rows], [r[2] for r in rows], title)))
    if b.ladder:
        _ladder(doc, b)


def _decoder_rows(b: BenchResult) -> list[list]:
    """One row per decoder timed: label, K (and how its rounds stop or branch), tok/s, ratio, tau, acceptance,
    greedy equality."""
    val, rows = b.validation, []
    for name, label in b.decoder_labels.items():
        if name not in val.stats:
            continue
        st, K = val.stats[name], b.k_of(name)
        if name == "draft_after" and b.siblings:  # below this, the head's top m go side by side
            K = (f"{K}, {b.siblings} side by side below p {b.confidence}"
                 + (", each with its next token" if b.sibling_depth == 2 else ""))
        elif name == "draft_after" and b.confidence:  # the head's rounds stop early below this
            K = f"{K}, stops below p {b.confidence}"
        if name == "draft_after" and b.lookup:  # lookup tokens after its chains
            K = f"{K}, lookup {b.lookup}"
        if name == "target_only":
            ratio = "1.00x"
        else:
            lo, hi = val.speedup_range[name]
            ratio = f"{val.speedup(name):.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if len(val.repeats) > 1 else "")
        rows.append([label, "-" if name == "target_only" else K, val.tok_per_s[name], ratio,
                     st.mean_tau, st.acceptance_rate,
                     "-" if name == "target_only" else fmt(val.greedy_equal[name])])
    return rows


def speed_figure(names: list[str], tok_per_s: list[float], title: str):
    """Each decoder's tokens/s as a bar, sized to its labels, the title over the whole figure (over the axes
    alone, long labels pushed it past the right edge)."""
    plt = _plt()
    width = max(6.0, 3.5 + 0.075 * max((len(n) for n in names), default=0))
    fig, ax = plt.subplots(figsize=(width, 2.8))
    ax.barh(names, tok_per_s)
    ax.set_xlabel("tokens/s")
    fig.suptitle(title)
    return fig


def _spread(s: dict | None) -> str:
    return "-" if not s else f"{s['median']:.2f}x ({s['range'][0]:.2f}-{s['range'][1]:.2f})"


def _ladder(doc: Doc, b: BenchResult) -> None:
    """Where the speedup comes from: each rung over the one below and over the target alone, per domain, with the
    predicted speedup beside; a waterfall per domain."""
    doc.h("Where the speedup comes from: the ladder")
    doc.p("Each rung changes one thing over the rung above it in this table; all rungs and the target alone were "
          "timed side by side in the run above (median of the repeats' ratios, with their range). Predicted: the "
          "rung's speedup over the target alone predicted from its dev-prompt evidence.")
    table, rungs = b.ladder, b.rungs()
    groups = table["groups"]
    doc.table(["rung", "what it changes", "predicted", *(f"{g}: over the rung above" for g in groups),
               *(f"{g}: over the target alone" for g in groups)],
              [[b.label(r.name), r.step, fmt(r.predicted, 2), *(_spread(r.spread(g, below=True)) for g in groups),
                *(_spread(r.spread(g)) for g in groups)] for r in rungs])
    for name, v in b.versus.items():
        doc.p(f"{b.label(name)} over {b.label(v['versus'])} (the same policy search, the same quantisation; what "
              "differs: training), each repeat's ratio, median and range: "
              + "; ".join(f"{g} {_spread(s)}" for g, s in (v.get("spread") or {}).items()) + ".")
    plt = _plt()
    fig, axes = plt.subplots(1, len(groups), figsize=(3.4 * len(groups) + 1, 3.8), sharey=True, squeeze=False)
    top = max(max(lo, hi) for g in groups for _, lo, hi in waterfall(table, g))
    for ax, g in zip(axes[0], groups):
        bars = waterfall(table, g)
        x = list(range(len(bars)))
        # a step worth nothing still shows: at least a hairline
        ax.bar(x, [(hi - lo) or 0.004 * top for _, lo, hi in bars], bottom=[lo for _, lo, _ in bars],
               color=["#2a7" if hi >= lo else "#c33" for _, lo, hi in bars])
        for i, (_, lo, hi) in enumerate(bars):
            ax.annotate(f"{hi:.2f}x", (i, max(lo, hi)), xytext=(0, 2), textcoords="offset points", ha="center",
                        va="bottom", fontsize=7)
        if g == "all":  # the predictions are over all prompts
            pred = [(i, r.predicted) for i, r in enumerate(rungs) if r.predicted]
            ax.scatter([i for i, _ in pred], [v for _, v in pred], marker="_", s=200, color="k", zorder=3,
                       label="predicted")
            ax.legend(fontsize=7, loc="lower right")
        ax.axhline(1.0, color="#888", lw=0.8)
        ax.set_ylim(min(0.95, min(lo for _, lo, _ in bars)), top * 1.12)
        ax.set_xticks(x, [textwrap.fill(s, 16) for s, _, _ in bars], rotation=0, fontsize=6)
        ax.set_title(g, fontsize=9)
    axes[0][0].set_ylabel("speedup over the target alone")
    fig.suptitle("the ladder: each rung's gain over the one before (median of the repeats)", fontsize=9)
    doc.image("ladder.png", png_bytes(fig))


def _export(doc: Doc, e: HeadExport | DraftExport | None, bench: BenchResult | None) -> None:
    if not e:
        return
    doc.h("Export")
    if isinstance(e, HeadExport):
        _head_export(doc, e, bench)
        return
    rows = []
    if e.hf:
        c = e.hf.checks
        rows.append(["HF folder", e.hf.path, (f"reload max |diff| {fmt(c['reload']['max_abs_diff'], 2)}; "
                     f"HF assisted generation greedy-equal: {fmt(c['assisted_greedy']['equal'])}")])
    for g in e.gguf or []:
        lg = g.checks["logits"]
        rows.append([f"GGUF {g.gguf_type}", g.path, (f"top-1 agreement {fmt(lg['top1_agreement'])}, relative "
                     f"max |diff| {lg['rel_max_abs_diff']:.2g} (through transformers' GGUF loader)")])
    if rows:
        doc.table(["what", "path", "checked"], rows)
    for t, lc in (e.llama_cpp or {}).items():
        doc.p(f"llama.cpp (llama-server, {t} draft, K = {lc.draft_max}): "
              f"{llama_cpp_result(lc.to_dict(), e.llama_cpp_target_only)}.")
    _prediction(doc, e.llama_cpp_prediction)
    doc.p(f"Serving lines, K = {e.best_k} ({e.best_k_source}):" + _slow_note(bench, "draft_after"))
    for name, line in (e.serving or {}).items():
        doc.code(f"# {name}\n{line}")
    for w in e.warnings or []:
        doc.p(f"Warning: {w}")


def _head_export(doc: Doc, e: HeadExport, bench: BenchResult | None) -> None:
    """A head's export: the vLLM and SGLang folders and what was checked of each (`HeadExport.checked`: their
    contract, field by field; an engine's own load only where the record says one ran), llama-server's runs."""
    rows = [["vLLM speculators", e.vllm, e.checked("vllm")], ["SGLang EAGLE-3", e.sglang, e.checked("sglang")]]
    if e.gguf:
        rows.append(["GGUF (eagle3)", e.gguf.path, e.checked("gguf")])
    doc.table(["what", "path", "checked"], rows)
    lc = e.llama_cpp
    if lc:
        base = lc.target_alone_mean_tokens_per_s
        doc.p(f"llama-server, `--spec-type draft-eagle3`, target alone {base:.1f} tok/s "
              f"({', '.join(f'{x:.1f}' for x in lc.target_alone_tokens_per_s)}):")
        doc.table(["K", "accepted/drafted", "tok/s", "vs target alone", "greedy text equal"],
                  [[k, f"{r.accepted}/{r.drafted}", r.tokens_per_s, f"{r.speedup_vs_target_only:.2f}x",
                    f"{r.greedy_equal['equal']}/{r.greedy_equal['prompts']}"] for k, r in lc.runs.items()])
    _prediction(doc, e.llama_cpp_prediction)
    doc.p(f"Serving lines, K = {e.k}:" + _slow_note(bench, "draft_after"))
    for name, line in (e.serving or {}).items():
        doc.code(f"# {name}\n{line}")


def _prediction(doc: Doc, pred: dict | None) -> None:
    """llama-server's speedup predicted from llama.cpp's costs beside measured, and acceptance in both engines."""
    if not pred:
        return
    lines = prediction_lines(pred)
    doc.p(lines[0])
    doc.table(PREDICTION_HEADERS, prediction_rows(pred))
    doc.p(lines[-1])


def _slow_note(bench: BenchResult | None, name: str) -> str:
    """A warning beside serving lines for a draft measured slower than the target alone."""
    x = bench.speedup(name) if bench is not None else None
    return (f" this draft measured {x:.2f}x the target alone in validation: serving it would slow decoding down."
            if x is not None and x < 1 else "")


def side_by_side(bench: BenchResult | None, exp: HeadExport | DraftExport | None) -> list[list]:
    """Rows [draft, our K, our speedup, llama.cpp K, llama.cpp speedup, llama.cpp accepted/drafted] for the
    un-distilled and the distilled draft: validate/bench.json's decoder beside export.json's llama-server."""
    bench, exp = bench or BenchResult(), exp or DraftExport()
    if isinstance(exp, HeadExport):  # llama.cpp served the head at one or more K (`runs`)
        drafts = [(bench.label("draft_before", "standalone draft"), "draft_before", None)]
        drafts += [("head", "draft_after", lc) for lc in ((exp.llama_cpp.runs if exp.llama_cpp else None)
                                                          or {None: None}).values()]
    else:
        drafts = [("un-distilled draft", "draft_before", exp.llama_cpp_before)]
        drafts += [(f"distilled draft ({t})", "draft_after", lc) for t, lc in (exp.llama_cpp or {}).items()]
    rows = []
    for label, key, lc in drafts:
        ours = bench.speedup(key)
        if ours is None and not lc:
            continue
        acc = f"{lc.accepted}/{lc.drafted}" if lc and lc.drafted else None
        rows.append([label, bench.k_of(key) if key in bench.speedup_vs_target_only else None, ours,
                     lc.draft_max if lc else None, lc.speedup_vs_target_only if lc else None, acc])
    return rows


def _engines(doc: Doc, bench: BenchResult | None, exp: HeadExport | DraftExport | None) -> None:
    if not exp or not exp.served():
        return
    doc.h("Our decoder and llama.cpp, side by side")
    doc.p("Speedup over the target alone, each engine against its own target-alone run (ours: validate, "
          "held-out prompts; llama.cpp: llama-server in the export check, between two runs of the target alone).")
    doc.table(["draft", "our K", "our decoder", "llama.cpp K", "llama.cpp", "llama.cpp accepted/drafted"],
              [[d, k, f"{a:.2f}x" if a else None, lk, f"{b:.2f}x" if b else None, acc]
               for d, k, a, lk, b, acc in side_by_side(bench, exp)])


def write_report(run: Path) -> Path:
    """report.md + report.html (+ report/*.png) in `run`, from the stages that have written their results."""
    run = Path(run)
    recipe_text = (run / "recipe.yaml").read_text() if (run / "recipe.yaml").is_file() else ""
    res = read_results(run)
    doc = Doc(f"draftsmith run: {run.name}")
    said = verdict(res.bench, res.export)
    if said:
        doc.verdict(*said)
    _stages(doc, res.stages)
    _pairing(doc, res.board)
    _data(doc, res.prompts, res.rows)
    _distill(doc, res)
    _race(doc, res.race)
    _validation(doc, res.bench)
    _export(doc, res.export, res.bench)
    _engines(doc, res.bench, res.export)
    if recipe_text:
        doc.h("Resolved recipe")
        doc.code(recipe_text.rstrip())
    doc.write(run, "report")
    return run / "report.md"
