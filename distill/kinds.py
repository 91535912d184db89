"""Draft kinds: what a recipe's stages ask of a draft, answered once per kind.

    from draftsmith.distill.kinds import kind_for
    kind = kind_for(recipe.distill.draft)          # "head" -> the head kind; a model spec or "best" -> standalone
    kind.train(ctx); kind.validation(ctx); kind.export(ctx)

Every kind answers the same questions, and the runner asks them without knowing which kind it holds:
- `settings(recipe)`: what its distill stage depends on (a change makes that stage stale);
- `data_draft(ctx)`: the draft the data stage generates with (on-policy rows, speculative generation);
- `train(ctx)`: make the draft (distil a standalone model; or data, held-out references and training of a head),
  keeping its best checkpoint by held-out agreement and resuming an interrupted run;
- `validation(ctx)`: the drafts to time beside the target alone (`pairing.validate.DraftUnderTest`), with the
  evidence (measured on dev prompts) that chooses their round policy;
- `export(ctx)`: the engine formats it can be written to, at the K validation chose.
Decoding needs no kind: every draft runs as a `decode` runner (a head as `decode.head.HeadDraft`, which declares
the target features it reads), opened by `pairing.drafts.open_draft`.

Adding a kind: a class with these methods, registered in `KINDS` under the `distill.draft` value that selects it
(docs/design.md, "Draft kinds").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import read_json
from draftsmith.decode.prompts import Prompt, load_prompts, load_test_prompts
from draftsmith.decode.spec import DraftSpec
from draftsmith.distill.heads.pipeline import HEAD, HeadRunConfig, head_result, held_rows, run_head
from draftsmith.distill.pipeline import DistillConfig, run_distill, split_prompts
from draftsmith.pairing.policy import known_k
from draftsmith.pairing.validate import DraftUnderTest, ValidateConfig


@dataclass
class RunContext:
    """What a kind needs of a recipe run: plain values and the stage folders (distill cannot import recipes)."""

    name: str
    target: str
    prompts: str
    limit_per_domain: int | None
    device: str
    distill: DistillConfig
    head: HeadRunConfig
    export_cfg: Any  # distill.export.ExportConfig
    folders: dict[str, Path]  # stage -> its folder: pair, data, distill, validate, export
    has_data_stage: bool = False  # the recipe has a data section: distill trains on its rows
    test_prompts: str = ""  # the recipe's test_prompts ("" = the built-in test split of `prompts`)
    config: dict = dataclasses.field(default_factory=dict)  # the resolved recipe (for wandb)
    validate: ValidateConfig | None = None  # the validate stage's settings

    def held_out(self) -> list[Prompt]:
        """The dev prompts: never trained on, used to choose (a checkpoint, K): the first
        `distill.eval_per_domain` of every domain."""
        prompts = load_prompts(self.prompts, limit_per_domain=self.limit_per_domain)
        return split_prompts(prompts, self.distill.eval_per_domain)[1]

    def test(self) -> tuple[list[Prompt], str]:
        """The test prompts (never trained on, never used to choose) and where they come from: `test_prompts`,
        else the built-in test split of `prompts` ([] for a prompt file without `test_prompts`)."""
        if self.test_prompts:
            return load_test_prompts(self.test_prompts) or load_prompts(self.test_prompts), self.test_prompts
        return load_test_prompts(self.prompts), f"the built-in test split of {self.prompts}"

    def leaderboard(self) -> dict | None:
        return read_json(self.folders["pair"] / "leaderboard.json", missing_ok=True, what="leaderboard")

    def bench(self) -> dict:
        return read_json(self.folders["validate"] / "bench.json", missing_ok=True, what="validation result") or {}


class DraftKind(Protocol):
    name: str

    def settings(self, recipe: dict) -> dict: ...
    def data_draft(self, ctx: RunContext) -> str: ...
    def train(self, ctx: RunContext) -> dict: ...
    def trained(self, ctx: RunContext) -> dict[str, str]: ...
    def validation(self, ctx: RunContext) -> list[DraftUnderTest]: ...
    def export(self, ctx: RunContext) -> dict: ...


def serving_k(ctx: RunContext, draft: str | None = None) -> tuple[int, str]:
    """The K of the serving lines: the export's own (`export.best_k` > 0), else the K validation chose, else the
    pair stage's best K for `draft`, else the default (`pairing.policy.known_k`); with where it came from."""
    pair_k = next((row.get("best_k") for row in (ctx.leaderboard() or {}).get("candidates", [])
                   if row["draft"] == draft), None)
    return known_k((ctx.export_cfg.best_k, "given (export.best_k)"),
                   (ctx.bench().get("k"), "chosen by validate (validate/bench.json)"),
                   (pair_k, "chosen by pair (pairing/leaderboard.json)"))


def top_standalone(ctx: RunContext) -> tuple[str | None, int | None]:
    """The pair stage's best token-level candidate that is not a head, and its best K (None where pair has not
    run)."""
    board = ctx.leaderboard() or {}
    best = next((c for c in board.get("candidates", [])
                 if c["compatible"] and not DraftSpec.parse(c["draft"]).is_head), None)
    return (best["draft"], best.get("best_k")) if best else (None, None)


class Standalone:
    """A draft that runs on its own: a zoo model, an HF folder, a GGUF or a derived slice of the target;
    `best` takes the pair stage's top candidate that is a whole model (not vocabulary-pruned). Trained by
    distillation toward the target's outputs."""

    name = "standalone"

    def __init__(self, draft: str) -> None:
        self.draft = draft

    def settings(self, recipe: dict) -> dict:
        return {"distill": recipe["distill"], "pair": recipe["pair"] if self.draft == "best" else None,
                **({"data": recipe["data"]} if recipe["data"]["n"] else {})}

    def chosen(self, ctx: RunContext) -> str:
        """The draft to distil: the recipe's, or the leaderboard's top token-level candidate."""
        if self.draft != "best":
            return self.draft
        board = ctx.leaderboard()
        if board is None:
            raise DraftsmithError("distill.draft is 'best' but the pair stage has not run here: add pair to --stages, "
                                  "or name the draft (distill.draft=MODEL)")
        for row in board["candidates"]:  # sorted by predicted speedup; distillation trains a whole model
            if row["compatible"] and not DraftSpec.parse(row["draft"]).decoder_only:
                return row["draft"]
        raise DraftsmithError("no candidate on the leaderboard shares the target's tokenizer; distillation needs one "
                              "(set distill.draft=MODEL)")

    def data_draft(self, ctx: RunContext) -> str:
        return self.chosen(ctx)

    def trained(self, ctx: RunContext) -> dict[str, str]:
        """{the trained draft's spec, as it serves: its untrained equivalent's} ({} before distillation): the
        served form a run over an int4 base picked (`distill.served`), else the best/ folder."""
        made = read_json(ctx.folders["distill"] / "distill.json", missing_ok=True, what="distillation result")
        if not made or not (ctx.folders["distill"] / "best").is_dir():
            return {}
        return {made.get("served_spec") or str(ctx.folders["distill"] / "best"): made["draft"]}

    def train(self, ctx: RunContext) -> dict:
        draft = self.chosen(ctx)
        _log_recipe_to_wandb(ctx)
        cfg = ctx.distill
        if ctx.has_data_stage:  # train on the data stage's rows (held-out prompts still come from the recipe's)
            rows = ctx.folders["data"] / "rows"
            if not (rows / "dataset").is_dir():
                raise DraftsmithError("distill: the recipe has a data section (data.n > 0) but the data stage has "
                                      "not finished here; add data to --stages")
            cfg = dataclasses.replace(cfg, data_dir=str(rows))
        result = run_distill(ctx.target, draft, ctx.folders["distill"], cfg, prompts=ctx.prompts,
                             limit_per_domain=ctx.limit_per_domain, resume=True, device=ctx.device)
        return {"draft": draft, "alpha_before": result["alpha_before"], "alpha_after": result["alpha_after"],
                "alpha_gain": result["alpha_gain"], "skipped_steps": result["skipped_steps"],
                "served_spec": result.get("served_spec")}

    def validation(self, ctx: RunContext) -> list[DraftUnderTest]:
        """The un-distilled draft beside the distilled one (when distillation ran), the latter choosing K from its
        held-out alpha; without distillation the draft alone, at the alpha the leaderboard measured."""
        folder = ctx.folders["distill"]
        distilled = read_json(folder / "distill.json", missing_ok=True, what="distillation result")
        draft = distilled["draft"] if distilled else self.chosen(ctx)
        tuned = folder / "best"
        if distilled:  # the tuned draft's alpha, else the un-distilled one's (best/ is absent)
            alpha = distilled["alpha_after"] if tuned.is_dir() else distilled["alpha_before"]
        else:  # no distillation here: the leaderboard measured this draft's alpha
            board = ctx.leaderboard() or {}
            alpha = next((c["alpha"] for c in board.get("candidates", []) if c["draft"] == draft), None)
        drafts = [DraftUnderTest("draft_before", draft, alpha=alpha, chooses=not tuned.is_dir())]
        if distilled and tuned.is_dir():
            drafts.append(DraftUnderTest("draft_after", str(tuned), alpha=alpha, chooses=True))
        return drafts

    def export(self, ctx: RunContext) -> dict:
        from draftsmith.distill.export import export

        best_dir = ctx.folders["distill"] / "best"
        if not best_dir.is_dir():
            raise DraftsmithError(f"export: no distilled draft at {best_dir}; run the distill stage first")
        distilled = read_json(ctx.folders["distill"] / "distill.json", missing_ok=True,
                              what="distillation result") or {}
        k, source = serving_k(ctx, distilled.get("draft"))
        info = {"recipe": ctx.name, **run_info(ctx.bench())}  # the rest comes from distill.json next to best/
        if source.startswith("chosen"):
            info["best_k"] = k
        summary = export(str(best_dir), ctx.target, ctx.folders["export"], ctx.export_cfg, info=info,
                         before=distilled.get("draft"))  # llama.cpp serves the un-distilled draft too, side by side
        return {"formats": ctx.export_cfg.formats, "serving": summary.get("serving"), "k": k, "k_source": source}


class Head:
    """An EAGLE-3-style head reading the target's hidden states (`distill.heads`): trained on the target's own
    text and features, unrolled on its own outputs."""

    name = HEAD

    def __init__(self, draft: str = HEAD) -> None:
        self.draft = draft

    def settings(self, recipe: dict) -> dict:
        return {"head": recipe["head"], "eval_per_domain": recipe["distill"]["eval_per_domain"]}

    def data_draft(self, ctx: RunContext) -> str:
        return ctx.target  # the data stage's rows are the target's own

    def trained(self, ctx: RunContext) -> dict[str, str]:
        return {}  # a head does not race standalone drafts: validate times it beside the best of them

    def train(self, ctx: RunContext) -> dict:
        result = run_head(ctx.target, ctx.folders["distill"], ctx.head, prompts=ctx.prompts,
                          limit_per_domain=ctx.limit_per_domain, eval_per_domain=ctx.distill.eval_per_domain,
                          device=ctx.device)
        return {"draft": HEAD, "agreement_before": result["agreement_before"],
                "agreement_after": result["agreement_after"]}

    def _trained(self, ctx: RunContext, stage: str) -> dict:
        head = head_result(ctx.folders["distill"])
        if head is None:
            raise DraftsmithError(f"{stage}: no trained head here; run the distill stage first")
        return head

    def validation(self, ctx: RunContext) -> list[DraftUnderTest]:
        """The head beside the pair stage's best standalone draft (at that draft's best K), the head choosing its
        policy by walking its rounds on the held-out references."""
        head = self._trained(ctx, "validate")
        standalone, standalone_k = top_standalone(ctx)
        drafts = [DraftUnderTest("draft_before", standalone, label=f"standalone draft ({standalone})",
                                 k=standalone_k)] if standalone else []
        drafts.append(DraftUnderTest("draft_after", DraftSpec.head(head["head"]).text, label="head",
                                     rates=head["agreement_after"], held=held_rows(ctx.folders["distill"]),
                                     chooses=True))
        return drafts

    def export(self, ctx: RunContext) -> dict:
        from draftsmith.distill.export.heads import export_head

        head = self._trained(ctx, "export")
        e = ctx.export_cfg
        k, source = serving_k(ctx)
        summary = export_head(head["head"], ctx.target, ctx.folders["export"], k=k, gguf="gguf" in e.formats,
                              check_llama_cpp=e.check_llama_cpp, target_gguf=e.target_gguf,
                              ks=sorted(set(e.llama_cpp_ks) | {k}) if e.llama_cpp_search else [k])
        return {"formats": ["vllm", "sglang"] + (["gguf"] if "gguf" in summary else []),
                "serving": summary.get("serving"), "k": k, "k_source": source}


KINDS: dict[str, type] = {HEAD: Head}  # distill.draft value -> kind; any other: standalone


def kind_for(draft: str) -> DraftKind:
    """The kind a recipe's `distill.draft` selects."""
    return KINDS.get(draft, Standalone)(draft)


def is_model_spec(draft: str) -> bool:
    """Whether `distill.draft` names a model (rather than `best` or a registered kind)."""
    return draft != "best" and draft not in KINDS


def run_info(bench: dict) -> dict:
    """What the validate stage measured, for the model card: K and the distilled draft's speedup."""
    info: dict[str, Any] = {}
    if bench.get("k"):
        info["best_k"] = bench["k"]  # chosen by validate: measured cost and the distilled draft's alpha
    after = (bench.get("speedup_vs_target_only") or {}).get("draft_after")
    if after is not None:
        tps = bench["tok_per_s"]
        info["speedup"] = after
        info["speedup_detail"] = (f"draftsmith's decoder on {bench.get('device', 'cpu')}, K={bench['k']}, "
                                  f"{len(bench['prompts'])} held-out prompts: {tps['draft_after']:.2f} tok/s with the "
                                  f"draft vs {tps['target_only']:.2f} target alone (validate/bench.json)")
    return info


def _log_recipe_to_wandb(ctx: RunContext) -> None:
    mode = ctx.distill.train.wandb
    if mode == "disabled":
        return
    import wandb

    run = wandb.init(mode=mode, dir=str(ctx.folders["distill"].parent), project="draftsmith",
                     name=f"{ctx.name}-recipe", job_type="recipe", config=ctx.config)
    run.finish()
