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
from draftsmith.decode.speculative import KPolicy
from draftsmith.distill.fastest import FASTEST, FastestConfig, make_fastest
from draftsmith.distill.heads.pipeline import HEAD, HeadRunConfig, head_result, held_rows, run_head
from draftsmith.distill.pipeline import DistillConfig, run_distill, split_prompts
from draftsmith.pairing.leaderboard import PairConfig
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
    fastest: FastestConfig = dataclasses.field(default_factory=FastestConfig)  # the `fastest` kind's settings
    pair: PairConfig | None = None  # the pair stage's settings (the `fastest` kind ranks with them)
    validate: ValidateConfig | None = None  # the validate stage's settings (the `fastest` kind races with them)

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
                "alpha_gain": result["alpha_gain"], "skipped_steps": result["skipped_steps"]}

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


class Fastest:
    """The fastest standalone draft: a whole model (`fastest.base`, or the pair stage's top whole model) beside its
    vocabulary-pruned variants, ranked on dev prompts (`distill.fastest`); nothing is trained. Validation times
    the ladder from the stock draft at plain K to the winner, each rung at the policy the race walked for it."""

    name = FASTEST

    def __init__(self, draft: str = FASTEST) -> None:
        self.draft = draft

    def settings(self, recipe: dict) -> dict:
        return {"fastest": recipe["fastest"], "pair": recipe["pair"]}

    def base(self, ctx: RunContext) -> str:
        if ctx.fastest.base != "best":
            return ctx.fastest.base
        return Standalone("best").chosen(ctx)

    def data_draft(self, ctx: RunContext) -> str:
        return self.base(ctx)

    def train(self, ctx: RunContext) -> dict:
        result = make_fastest(ctx.target, self.base(ctx), ctx.fastest, ctx.pair, out=ctx.folders["distill"],
                              run=ctx.folders["distill"].parent, prompts=ctx.prompts,
                              limit_per_domain=ctx.limit_per_domain, device=ctx.device, validate=ctx.validate,
                              dev=ctx.held_out())
        return {"draft": result["draft"], "alpha": result["alpha"], "measured_speedup": result["measured_speedup"]}

    def validation(self, ctx: RunContext) -> list[DraftUnderTest]:
        """The ladder (`pairing.ladder`): the stock draft as loaded at its ranking's plain K, then at its walked
        policy, then its int4 copy, then the best raced pruned variant, each at the policy the race walked for it on
        the dev prompts (the same search for all). The pick is `draft_after`, the stock at its walked policy
        `draft_before`: the fair baseline (the same policy search; what differs is int4 weights and pruning)."""
        made = read_json(ctx.folders["distill"] / "fastest.json", missing_ok=True, what="fastest result")
        if made is None:
            raise DraftsmithError("validate: no ranked drafts here; run the distill stage first")
        ranked = {row["draft"]: row for row in made["ranking"]}
        base, pick, k = made["base"], made["draft"], made["base_k"]
        if not ranked[base].get("policy"):
            raise DraftsmithError("validate: the stock draft has no raced policy in distill/fastest.json (an older "
                                  "run?); rerun with --restart distill")

        def rung(spec: str, name: str, step: str, label: str) -> DraftUnderTest:
            row = ranked[spec]
            return DraftUnderTest(name, spec, label=label, alpha=row["alpha"], chooses=spec == pick, walk=True,
                                  policy=KPolicy.from_dict(row["policy"]), step=step,
                                  predicted=row.get("policy_predicted"))

        stock = base.rsplit("/", 1)[-1]
        q = ctx.validate.draft_quant if ctx.validate else "int8"
        rungs = [DraftUnderTest("stock_plain", base, label=f"stock {stock} ({q or 'float32'}), plain K = {k}", k=k,
                                alpha=ranked[base]["alpha"], step=f"stock {stock} as loaded, plain K = {k}",
                                predicted=ranked[base].get("predicted_speedup")),
                 rung(base, "draft_before", "its walked policy", f"stock {stock} at its walked policy")]
        specs = {s: DraftSpec.parse(s) for s in ranked}
        size = {s: n for s in ranked for n, path in made["vocab_files"].items() if specs[s].vocab == Path(path)}
        int4 = [s for s in ranked if specs[s].kind == "int4" and ranked[s].get("policy")]
        for s in int4[:1]:
            rungs.append(rung(s, "draft_after" if s == pick else "int4", "int4 weights", f"int4 {stock}"))
        pruned = sorted((s for s in size if ranked[s].get("policy")), key=lambda s: (s != pick, -(
            ranked[s].get("worst_over_reference") or ranked[s].get("measured_speedup") or 0)))
        for s in pruned[:1]:
            four = "int4 " if specs[s].quant == "int4" else ""
            rungs.append(rung(s, "draft_after" if s == pick else "pruned", f"vocabulary pruned to {size[s]} ids",
                              f"{four}{stock} pruned to {size[s]} ids"))
        if pick != base and not any(d.name == "draft_after" for d in rungs):
            raise DraftsmithError(f"validate: the pick {pick} is neither the int4 copy nor a pruned variant")
        return rungs

    def export(self, ctx: RunContext) -> dict:
        raise DraftsmithError("export: an int4 or vocabulary-pruned draft runs in draftsmith's decoder only (no "
                              "engine takes one); export the whole model instead (distill.draft=MODEL), or leave "
                              "export out of the recipe's stages")


KINDS: dict[str, type] = {HEAD: Head, FASTEST: Fastest}  # distill.draft value -> kind; any other: standalone


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
