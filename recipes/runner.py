"""Run a recipe: pair -> data -> distill -> race -> validate -> export into one run folder, resumable, with a report.

    .venv/bin/draftsmith run recipes/quickstart.yaml [distill.train.steps=200 ...] [--out runs/NAME]
        [--stages pair,validate] [--restart distill]

Run folder (`runs/<name>/` by default):
    recipe.yaml               the resolved recipe (defaults and overrides filled in)
    state.json                per stage: running | done, its settings, seconds
    pairing/leaderboard.*     the pair stage (json, md, csv, html, plots)
    distill/                  data/ (datasets on disk), checkpoints/, best/ (HF folder), log.jsonl, distill.json
    race/                     ranking/, race.json, pick.json: drafts raced at their walked policies (a race stage)
    validate/bench.json       target alone vs un-distilled vs distilled draft, same prompts, same run
    export/                   hf/, draft-*.gguf, export.json, README.md (serving lines)
    report.md, report.html, report/*.png

A finished stage whose settings are unchanged is skipped; an interrupted one resumes (training from its last
checkpoint, data generation from its last row). A finished stage whose settings changed is refused with the
keys that changed: `--restart STAGE` redoes it and every stage after it.

Validate times decoders, so once another stage has run in this process it runs in a fresh one (`spawn`): in the
process that had just trained a head, its step timed 1.6-1.8x slower than in a fresh process, where the target
alone was not slower (README, SmolLM2 head), and a stage's numbers should not depend on what ran before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from draftsmith.decode.runtime.allocator import keep_freed_memory, release_freed_memory
from draftsmith.decode.runtime.settings import RuntimeSettings, configure, current
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, read_json
from draftsmith.distill.kinds import RunContext, Standalone, kind_for
from draftsmith.pairing.leaderboard import run_pair
from draftsmith.pairing.race import PICK, ladder_drafts, run_race
from draftsmith.pairing.validate import validate
from draftsmith.recipes.config import STAGES, Recipe, dump_recipe
from draftsmith.recipes.report import write_report

STAGE_DIRS = {"pair": "pairing", "data": "data", "distill": "distill", "race": "race", "validate": "validate",
              "export": "export"}


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
    base = {"target": recipe.target, "prompts": recipe.prompts, "limit_per_domain": recipe.limit_per_domain}
    if stage == "validate" and recipe.test_prompts:
        base["test_prompts"] = recipe.test_prompts
    if stage == "pair":
        return {**base, "pair": asdict(recipe.pair)}
    if stage == "data":
        d = asdict(recipe.distill)
        return {"target": recipe.target, "data": asdict(recipe.data),
                "rows": {k: d[k] for k in ("draft", "data", "mix", "data_temperature", "speculative_data")},
                "teacher": {k: d["train"][k] for k in ("teacher", "teacher_topk", "teacher_cache_dtype", "seed")}}
    if stage == "distill":
        return {**base, **kind_for(recipe.distill.draft).settings(recipe.to_dict())}
    upstream = state.get("distill", {}).get("settings")
    if stage == "race":
        return {**base, "race": asdict(recipe.race), "pair": asdict(recipe.pair), "validate": asdict(recipe.validate),
                "distill": upstream}
    if stage == "validate":
        return {**base, "validate": asdict(recipe.validate), "distill": upstream,
                "race": state.get("race", {}).get("settings")}
    return {"target": recipe.target, "export": asdict(recipe.export), "distill": upstream,
            "validate": state.get("validate", {}).get("settings")}


class RunFolder:
    """The run folder and its state.json (written atomically after every change)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.state: dict[str, dict] = (read_json(self.out / "state.json", missing_ok=True, what="run state")
                                       or {}).get("stages", {})

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


def context(recipe: Recipe, run: RunFolder) -> RunContext:
    """What the draft's kind needs of this recipe run."""
    return RunContext(name=recipe.name, target=recipe.target, prompts=recipe.prompts,
                      limit_per_domain=recipe.limit_per_domain, device=recipe.device, distill=recipe.distill,
                      head=recipe.head, export_cfg=recipe.export,
                      folders={stage: run.path(stage) for stage in STAGE_DIRS}, has_data_stage=bool(recipe.data.n),
                      config=recipe.to_dict(), test_prompts=recipe.test_prompts, validate=recipe.validate)


# --- stages -----------------------------------------------------------------------------------------


def stage_pair(recipe: Recipe, run: RunFolder) -> dict:
    board = run_pair(recipe.target, run.path("pair"), recipe.pair, prompts=recipe.prompts,
                     limit_per_domain=recipe.limit_per_domain, device=recipe.device)
    top = board["candidates"][0]
    return {"best": top["draft"], "alpha": top["alpha"], "predicted_speedup": top["predicted_speedup"],
            "best_k": top["best_k"]}


def stage_distill(recipe: Recipe, run: RunFolder) -> dict:
    return kind_for(recipe.distill.draft).train(context(recipe, run))


def stage_race(recipe: Recipe, run: RunFolder) -> dict:
    """The race stage (`pairing.race`): the stock draft (race.base, or the pair stage's top whole model), its int4
    copy, its pruned variants and what the distill stage trained, ranked and raced on the dev prompts."""
    kind, ctx = kind_for(recipe.distill.draft), context(recipe, run)
    base = recipe.race.base if recipe.race.base != "best" else Standalone("best").chosen(ctx)
    trained = kind.trained(ctx) if "distill" in recipe.stages else {}
    made = run_race(recipe.target, base, recipe.race, recipe.pair, out=run.path("race"), run=run.out,
                    prompts=recipe.prompts, limit_per_domain=recipe.limit_per_domain, device=recipe.device,
                    validate=recipe.validate, dev=ctx.held_out(), trained=trained)
    return {"draft": made["draft"], "alpha": made["alpha"], "measured_speedup": made["measured_speedup"],
            "trained": made["trained"]}


def stage_validate(recipe: Recipe, run: RunFolder) -> dict:
    """The drafts timed on the test prompts: with a race stage, the ladder of the raced drafts
    (`pairing.race.ladder_drafts`); else what the draft's kind asks for."""
    kind, ctx = kind_for(recipe.distill.draft), context(recipe, run)
    test, source = ctx.test()
    if "race" in recipe.stages:
        made = read_json(run.path("race") / PICK, missing_ok=True, what="race result")
        if made is None:
            raise DraftsmithError("validate: the recipe has a race stage but it has not run here; add race to --stages")
        drafts, name = ladder_drafts(made, recipe.validate), "race"
    else:
        drafts, name = kind.validation(ctx), kind.name
    result = validate(recipe.target, drafts, ctx.held_out(), test, recipe.validate,
                      out=run.path("validate") / "bench.json", kind=name, test_source=source, device=recipe.device)
    return {"k": result.k, "policy": result.to_dict()["policies"],
            "speedup_vs_target_only": result.validation.speedup_vs_target_only,
            "speedup_range": result.validation.speedup_range, "timed_split": result.roles["timed_split"],
            "greedy_equal": True}


def stage_export(recipe: Recipe, run: RunFolder) -> dict:
    return kind_for(recipe.distill.draft).export(context(recipe, run))


def _report(run: RunFolder, say: Callable[[str], None]) -> None:
    """Rewrite the report; a report problem never hides the stage's own result or error."""
    try:
        write_report(run.out)
    except Exception as e:  # noqa: BLE001 - the report is a view; the stage outputs are the record
        say(f"warning: could not write the report: {type(e).__name__}: {e}")


def stage_data(recipe: Recipe, run: RunFolder) -> dict:
    from draftsmith.distill.pipeline import run_data

    # gen-data's rows are the target's; the draft only matters for on-policy rows or speculative generation
    draft = kind_for(recipe.distill.draft).data_draft(context(recipe, run))
    return run_data(recipe.target, run.path("data"), recipe.data, dataclasses.replace(recipe.distill, draft=draft),
                    device=recipe.device)


STAGE_FUNCS: dict[str, Callable[[Recipe, RunFolder], dict]] = {
    "pair": stage_pair, "data": stage_data, "distill": stage_distill, "race": stage_race, "validate": stage_validate,
    "export": stage_export,
}
FRESH_PROCESS_STAGES = ("race", "validate")  # they time decoders: after another stage, in a process of their own


def _stage_in_child(func: Callable[[Recipe, RunFolder], dict], recipe: Recipe, out: str, settings: dict) -> dict:
    """A stage's body in a spawned process under the parent's runtime settings (the allocator set as in the
    parent), ended with its parent."""
    _end_with_parent()
    configure(RuntimeSettings.from_dict(settings))
    keep_freed_memory()
    return func(recipe, RunFolder(Path(out)))


def _end_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent ends (`prctl(PR_SET_PDEATHSIG)`), so a recipe run killed
    mid-validate leaves no child timing decoders on its own. Elsewhere, nothing."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def run_stage_fresh(func: Callable[[Recipe, RunFolder], dict], recipe: Recipe, run: RunFolder) -> dict:
    """`func(recipe, run)` (a module-level function) in a fresh Python process (spawn: nothing of this one's
    state); its result, or its exception re-raised here."""
    release_freed_memory()  # what earlier stages freed goes back to the OS, not held beside the child's
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        return pool.submit(_stage_in_child, func, recipe, str(run.out), current().to_dict()).result()
    except BrokenProcessPool as e:
        raise DraftsmithError(f"{func.__name__}: its process ended without a result (killed? out of memory?)") from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


LOCK = ".lock"  # in a run folder: held by the one `draftsmith run` working in it


@contextlib.contextmanager
def run_lock(folder: Path):
    """An exclusive lock on `folder` for one recipe run (flock on folder/.lock, released when the process ends,
    however it ends): a second run on the same folder refuses in one line instead of interleaving its writes."""
    path = folder / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise DraftsmithError(f"{folder}: another draftsmith run is working in this folder"
                                  + (f" (pid {held})" if held else "") + "; wait for it to end, or use another --out"
                                  ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def run_recipe(recipe: Recipe, out: Path | None = None, *, stages: list[str] | None = None,
               restart: str | None = None, say: Callable[[str], None] = print) -> dict:
    """Run (or resume) the recipe's stages in order; returns the final state. Writes the report after each stage.
    One run at a time in a run folder (`run_lock`)."""
    if recipe.device == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError("device: cuda, but torch sees no GPU here (this build: "
                              f"torch {torch.__version__}); set device=cpu")
    folder = Path(out) if out else Path("runs") / recipe.name
    folder.mkdir(parents=True, exist_ok=True)
    with run_lock(folder):
        return _run_recipe(recipe, folder, stages=stages, restart=restart, say=say)


def _run_recipe(recipe: Recipe, folder: Path, *, stages: list[str] | None, restart: str | None,
                say: Callable[[str], None]) -> dict:
    run = RunFolder(folder)
    wanted = [s for s in STAGES if s in (stages or recipe.stages)]
    if restart:
        run.restart(restart)
    (run.out / "recipe.yaml").write_text(dump_recipe(recipe))

    ran_here = False  # a stage ran in this process (a later timed stage then gets a fresh one)
    for stage in wanted:
        if stage == "data" and not recipe.data.n:
            continue  # no data section: distill makes its rows from the recipe's prompts
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
        fresh = ran_here and stage in FRESH_PROCESS_STAGES
        if fresh:
            say(f"[{stage}] in a fresh process (it times decoders)")
        ran_here = True
        try:
            func = STAGE_FUNCS[stage]
            result = run_stage_fresh(func, recipe, run) if fresh else func(recipe, run)
        finally:
            run.state[stage]["seconds"] += time.perf_counter() - started
            run.save()
            _report(run, say)
        run.state[stage].update(status="done", finished=_now(), result=result)
        run.save()
        _report(run, say)
        say(f"[{stage}] done in {run.state[stage]['seconds']:.0f} s")
    if not ran_here:  # every stage done earlier: the report is still made anew (a newer draftsmith, a lost file)
        _report(run, say)
    say(f"report: {run.out / 'report.md'}")
    return run.state
