"""Run a recipe: pair -> distill -> validate -> export into one run folder, resumable, with a report.

    .venv/bin/draftsmith run recipes/quickstart.yaml [distill.train.steps=200 ...] [--out runs/NAME]
        [--stages pair,validate] [--restart distill]

Run folder (`runs/<name>/` by default):
    recipe.yaml               the resolved recipe (defaults and overrides filled in)
    state.json                per stage: running | done, its settings, seconds
    pairing/leaderboard.*     the pair stage (json, md, csv, html, plots)
    distill/                  data/ (datasets on disk), checkpoints/, best/ (HF folder), log.jsonl, distill.json
    validate/bench.json       target alone vs un-distilled vs distilled draft, same prompts, same run
    export/                   hf/, draft-*.gguf, export.json, README.md (serving lines)
    report.md, report.html, report/*.png

A finished stage whose settings are unchanged is skipped; an interrupted one resumes (training from its last
checkpoint, data generation from its last row). A finished stage whose settings changed is refused with the
keys that changed: `--restart STAGE` redoes it and every stage after it.
"""

from __future__ import annotations

import datetime as dt
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from decode.bench import atomic_write_json, side_by_side
from decode.errors import DraftsmithError
from decode.loading import load
from decode.model import make_runner
from decode.prompts import load_prompts
from decode.textgen import eos_ids, machine_info, prompt_ids, versions
from distill.run import run_distill, split_prompts
from pairing.cost import best_k, measure_cost
from pairing.derive import resolve_candidate
from pairing.leaderboard import PairSettings, run_pair
from recipes.config import STAGES, Recipe, dump_recipe
from recipes.report import write_report

COST_CONTEXT = 64  # tokens of context when timing c and v(K), as the pair stage does
STAGE_DIRS = {"pair": "pairing", "distill": "distill", "validate": "validate", "export": "export"}


def _read_json(path: Path) -> dict | None:
    import json

    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


_ABSENT = object()


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts. A key the old settings lack is no change: it is
    a setting added to draftsmith since that run, and new settings come with defaults that keep the old behaviour."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            if k in old:
                out += _diff(old[k], new.get(k, _ABSENT), f"{prefix}.{k}" if prefix else str(k))
        return out
    if old == new:
        return []
    return [f"{prefix}: {old!r} -> {'(removed)' if new is _ABSENT else repr(new)}"]


def stage_settings(recipe: Recipe, stage: str, state: dict) -> dict:
    """What a stage's result depends on: if this changes, the stage's output is stale."""
    base = {"target": recipe.target, "prompts": asdict(recipe.prompts)}
    if stage == "pair":
        return {**base, "pair": asdict(recipe.pair)}
    if stage == "distill":
        return {**base, "distill": asdict(recipe.distill),
                "pair": asdict(recipe.pair) if recipe.distill.draft == "best" else None}
    upstream = state.get("distill", {}).get("settings")
    if stage == "validate":
        return {**base, "validate": asdict(recipe.validate), "distill": upstream}
    return {"target": recipe.target, "export": asdict(recipe.export), "distill": upstream,
            "validate": state.get("validate", {}).get("settings")}


class RunFolder:
    """The run folder and its state.json (written atomically after every change)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.state: dict[str, dict] = (_read_json(self.out / "state.json") or {}).get("stages", {})

    def path(self, stage: str) -> Path:
        return self.out / STAGE_DIRS[stage]

    def save(self) -> None:
        atomic_write_json(self.out / "state.json", {"stages": self.state})

    def restart(self, stage: str) -> None:
        """Forget `stage` and every stage after it (their folders are removed)."""
        for s in STAGES[STAGES.index(stage):]:
            self.state.pop(s, None)
            shutil.rmtree(self.path(s), ignore_errors=True)
        self.save()


def choose_draft(recipe: Recipe, run: RunFolder) -> str:
    """The draft to distill: the recipe's, or the leaderboard's top token-level candidate."""
    if recipe.distill.draft != "best":
        return recipe.distill.draft
    board = _read_json(run.path("pair") / "leaderboard.json")
    if board is None:
        raise DraftsmithError("distill.draft is 'best' but the pair stage has not run here: add pair to --stages, "
                              "or name the draft (distill.draft=MODEL)")
    for row in board["candidates"]:  # sorted by predicted speedup
        if row["compatible"]:
            return row["draft"]
    raise DraftsmithError("no candidate on the leaderboard shares the target's tokenizer; distillation needs one "
                          "(set distill.draft=MODEL)")


# --- stages -----------------------------------------------------------------------------------------


def stage_pair(recipe: Recipe, run: RunFolder) -> dict:
    p = recipe.pair
    limits = [n for n in (p.limit_per_domain, recipe.prompts.limit_per_domain) if n is not None]
    settings = PairSettings(
        suite=recipe.prompts.suite, prompts_file=recipe.prompts.file, limit_per_domain=min(limits),
        max_new_tokens=p.max_new_tokens, validate=p.validate, validate_prompts=p.validate_prompts,
        draft_quant=p.draft_quant, batch_size=p.batch_size, seed=recipe.distill.train.seed, device=recipe.device,
    )
    board = run_pair(recipe.target, p.candidates, run.path("pair"), settings)
    top = board["candidates"][0]
    return {"best": top["draft"], "alpha": top["alpha"], "predicted_speedup": top["predicted_speedup"]}


def _log_recipe_to_wandb(recipe: Recipe, run: RunFolder) -> None:
    mode = recipe.distill.train.wandb
    if mode == "disabled":
        return
    import wandb

    r = wandb.init(mode=mode, dir=str(run.out), project="draftsmith", name=f"{recipe.name}-recipe",
                   job_type="recipe", config=recipe.to_dict())
    r.finish()


def stage_distill(recipe: Recipe, run: RunFolder) -> dict:
    d = recipe.distill
    draft = choose_draft(recipe, run)
    _log_recipe_to_wandb(recipe, run)
    result = run_distill(
        recipe.target, draft, run.path("distill"), d.train, prompts=recipe.prompts.source,
        eval_per_domain=d.eval_per_domain, data_source=d.data, mix=d.mix, max_new_tokens=d.max_new_tokens,
        data_temperature=d.data_temperature, speed_prompts=0, resume=True, speculative_data=d.speculative_data,
        limit_per_domain=recipe.prompts.limit_per_domain, device=recipe.device,
    )
    return {"draft": draft, "alpha_before": result["alpha_before"], "alpha_after": result["alpha_after"],
            "alpha_gain": result["alpha_gain"]}


def _validation_prompts(recipe: Recipe) -> list:
    """Held-out prompts (never trained on): the first few of each domain's held-out share."""
    prompts = load_prompts(recipe.prompts.source, limit_per_domain=recipe.prompts.limit_per_domain)
    _, held = split_prompts(prompts, recipe.distill.eval_per_domain)
    seen: dict[str, int] = {}
    chosen = []
    for p in held:
        if seen.get(p.domain, 0) < recipe.validate.prompts_per_domain:
            chosen.append(p)
            seen[p.domain] = seen.get(p.domain, 0) + 1
    return chosen


def stage_validate(recipe: Recipe, run: RunFolder) -> dict:
    v = recipe.validate
    distilled = _read_json(run.path("distill") / "distill.json")
    draft_spec = distilled["draft"] if distilled else choose_draft(recipe, run)
    best_dir = run.path("distill") / "best"
    torch.set_grad_enabled(False)
    dev = recipe.device
    quant = v.draft_quant if dev == "cpu" else None  # fbgemm int8 is a CPU kernel
    target = load(recipe.target, device=dev)
    before = load(resolve_candidate(draft_spec), device=dev)
    after = load(str(best_dir), device=dev) if distilled and best_dir.is_dir() else None
    prompts = _validation_prompts(recipe)
    ids = [prompt_ids(target.tokenizer, p.prompt) for p in prompts]
    k_room = max(v.k, v.max_k) + 2
    max_len = max(max(len(i) for i in ids) + v.max_new_tokens, COST_CONTEXT) + k_room
    t_run = make_runner(target.model, max_len)
    drafts: dict[str, Any] = {"target_only": None,
                              "draft_before": make_runner(before.model, max_len, quantize=quant)}
    if after is not None:
        drafts["draft_after"] = make_runner(after.model, max_len, quantize=quant)

    # K: the recipe's, or the best predicted from the cost measured here and the draft's teacher-forced alpha
    tuned = "draft_after" if after is not None else "draft_before"
    cost = measure_cost(t_run, drafts[tuned], ks=range(1, v.max_k + 1), context=COST_CONTEXT, repeats=3, warmup=1,
                        device=dev)
    alpha = (distilled or {}).get("alpha_after" if after is not None else "alpha_before")
    if alpha is None:  # no distillation here: the leaderboard measured this draft's alpha
        board = _read_json(run.path("pair") / "leaderboard.json") or {"candidates": []}
        alpha = next((c["alpha"] for c in board["candidates"] if c["draft"] == draft_spec), None)
    if v.k:
        k, why = v.k, "set by the recipe"
    elif alpha is not None:
        k, why = best_k(alpha, cost.c, cost.v)[0], f"best predicted for alpha {alpha:.3f} and the measured cost"
    else:
        k, why = 3, "default (no alpha measured: neither the pair nor the distill stage has run)"

    runs = side_by_side(t_run, drafts, ids, k=k, max_new_tokens=v.max_new_tokens, eos_ids=eos_ids(target),
                        desc="validate", device=dev)
    reference = runs["target_only"][1]
    tps = {name: st.tokens_per_s for name, (st, _) in runs.items()}
    result = {
        "target": recipe.target, "draft": draft_spec, "distilled": str(best_dir) if after is not None else None,
        "k": k, "k_reason": why, "prompts": [p.id for p in prompts], "max_new_tokens": v.max_new_tokens,
        "draft_quant": quant, "device": dev, "alpha": alpha, "cost_ratio": cost.c,
        "verify_cost": {str(K): x for K, x in cost.v.items()},
        "tok_per_s": tps,
        "seconds": {name: st.seconds for name, (st, _) in runs.items()},
        "tokens": {name: st.new_tokens for name, (st, _) in runs.items()},
        "mean_tau": {name: st.mean_tau for name, (st, _) in runs.items()},
        "acceptance_rate": {name: st.acceptance_rate for name, (st, _) in runs.items()},
        "speedup_vs_target_only": {n: tps[n] / tps["target_only"] for n in drafts if n != "target_only"},
        "greedy_equal": {n: toks == reference for n, (_, toks) in runs.items() if n != "target_only"},
        "tau_definition": "tokens emitted per target forward, including the bonus/corrected token",
        "machine": machine_info(), "versions": versions(),
    }
    if after is not None:
        result["speedup_after_vs_before"] = tps["draft_after"] / tps["draft_before"]
    atomic_write_json(run.path("validate") / "bench.json", result)
    if not all(result["greedy_equal"].values()):
        raise DraftsmithError("validate: speculative output differs from the target's greedy output "
                              f"({result['greedy_equal']}); see {run.path('validate') / 'bench.json'}")
    return {"k": k, "speedup_vs_target_only": result["speedup_vs_target_only"], "greedy_equal": True}


def stage_export(recipe: Recipe, run: RunFolder) -> dict:
    from distill.export import export

    e = recipe.export
    best_dir = run.path("distill") / "best"
    if not best_dir.is_dir():
        raise DraftsmithError(f"export: no distilled draft at {best_dir}; run the distill stage first")
    bench = _read_json(run.path("validate") / "bench.json") or {}
    info: dict[str, Any] = {"recipe": recipe.name}  # the rest comes from distill/distill.json next to best/
    if bench.get("k"):
        info["best_k"] = bench["k"]  # chosen by validate: measured cost and the distilled draft's alpha
    after = (bench.get("speedup_vs_target_only") or {}).get("draft_after")
    if after is not None:
        tps = bench["tok_per_s"]
        info["speedup"] = after
        info["speedup_detail"] = (f"draftsmith's decoder on {bench.get('device', 'cpu')}, K={bench['k']}, "
                                  f"{len(bench['prompts'])} held-out prompts: {tps['draft_after']:.2f} tok/s with the "
                                  f"draft vs {tps['target_only']:.2f} target alone (validate/bench.json)")
    fmt = "all" if set(e.formats) == {"hf", "gguf"} else e.formats[0]
    summary = export(str(best_dir), recipe.target, run.path("export"), fmt=fmt, gguf_type=e.gguf_type,
                     info=info, check_llama_cpp=e.check_llama_cpp)
    return {"formats": e.formats, "serving": summary.get("serving")}


def _report(run: RunFolder, say: Callable[[str], None]) -> None:
    """Rewrite the report; a report problem never hides the stage's own result or error."""
    try:
        write_report(run.out)
    except Exception as e:  # noqa: BLE001 - the report is a view; the stage outputs are the record
        say(f"warning: could not write the report: {type(e).__name__}: {e}")


STAGE_FUNCS: dict[str, Callable[[Recipe, RunFolder], dict]] = {
    "pair": stage_pair, "distill": stage_distill, "validate": stage_validate, "export": stage_export,
}


def run_recipe(recipe: Recipe, out: Path | None = None, *, stages: list[str] | None = None,
               restart: str | None = None, say: Callable[[str], None] = print) -> dict:
    """Run (or resume) the recipe's stages in order; returns the final state. Writes the report after each stage."""
    if recipe.device == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError("device: cuda, but torch sees no GPU here (this build: "
                              f"torch {torch.__version__}); set device=cpu")
    run = RunFolder(Path(out) if out else Path("runs") / recipe.name)
    run.out.mkdir(parents=True, exist_ok=True)
    wanted = [s for s in STAGES if s in (stages or recipe.stages)]
    if restart:
        run.restart(restart)
    (run.out / "recipe.yaml").write_text(dump_recipe(recipe))

    for stage in wanted:
        settings = stage_settings(recipe, stage, run.state)
        entry = run.state.get(stage)
        changed = "; ".join(_diff(entry.get("settings"), settings)[:3]) if entry is not None else ""
        if changed:
            raise DraftsmithError(f"{run.out}: the {stage} stage ({entry['status']}) ran with other settings "
                                  f"({changed}); rerun with --restart {stage}, or use another --out")
        if entry is not None and entry["status"] == "done":
            say(f"[{stage}] done earlier, skipped ({run.path(stage)})")
            continue
        say(f"[{stage}] {'resuming' if entry else 'running'} -> {run.path(stage)}")
        started = time.perf_counter()
        run.state[stage] = {"status": "running", "settings": settings, "started": _now(),
                            "seconds": (entry or {}).get("seconds", 0.0)}
        run.save()
        try:
            result = STAGE_FUNCS[stage](recipe, run)
        finally:
            run.state[stage]["seconds"] += time.perf_counter() - started
            run.save()
            _report(run, say)
        run.state[stage].update(status="done", finished=_now(), result=result)
        run.save()
        _report(run, say)
        say(f"[{stage}] done in {run.state[stage]['seconds']:.0f} s")
    say(f"report: {run.out / 'report.md'}")
    return run.state
