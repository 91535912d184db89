"""One distillation: held-out split -> data from the target -> training -> alpha (and tokens/s) before and after.

    .venv/bin/draftsmith distill --target smollm2-135m-instruct --draft derive:smollm2-135m-instruct:keep=4 \
        --data target --loss fkl --steps 300 --eval-every 50 --speed-prompts 4 --out runs/distill-smollm2

Prompts: the built-in suites (or a file). The first `eval_per_domain` prompts of every domain are held out
for evaluation (reference continuations of the target, teacher-forced alpha); training data comes only from
the rest. Everything lands in `--out`: `data/` (resumable), `checkpoints/`, `best/` (an HF folder),
`log.jsonl`, `summary.json`, and `distill.json` (this run's result; with `speed_prompts > 0` also the
speculative speedup of the draft before and after, measured side by side by `decode.bench.validate_drafts`).
`DistillConfig` is both a recipe's `distill:` section and the options of `draftsmith distill` / `gen-data`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch

from draftsmith.decode.bench import Validation, validate_drafts
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.loading import eos_ids, load
from draftsmith.decode.prompts import Prompt, load_prompts
from draftsmith.decode.runtime.quant import draft_quant
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.spec import DraftSpec
from draftsmith.distill.curve import curve_summary
from draftsmith.distill.data import generate_data, load_data_folder
from draftsmith.distill.results import log_lines
from draftsmith.distill.train import TrainConfig, train
from draftsmith.pairing.derive import resolve_candidate
from draftsmith.pairing.reference import reference_continuations

DATA_SOURCES = ("target", "draft", "mixed")


@dataclass
class DistillConfig:
    """The distill stage's settings: data from the target (and the draft), then divergence training."""

    draft: str = "best"  # the draft to distil: a model spec; in a recipe 'best' = the leaderboard's top candidate
    data: str = "target"  # whose continuations: target | draft (on-policy) | mixed
    mix: float = 0.5  # fraction of draft (on-policy) rows when data = mixed
    max_new_tokens: int = 64  # continuation length of each data row
    data_temperature: float = 1.0  # sampling temperature of the data rows (0 = greedy)
    samples_per_prompt: int = 1  # rows written per training prompt (each sampled on its own seed: temperature > 0)
    speculative_data: bool = False  # generate the target's rows with the draft's proposals (pays once alpha is high)
    gen_batch_size: int = 8  # prompts decoded together where a model decodes alone
    engine: str = "hf"  # hf | vllm: what decodes the target's rows (vllm where installed: its own batching and GPUs)
    onpolicy_quant: str | None = None  # int4 | int8 | null: the draft's copy writing its rows, many at once (null: as loaded)
    onpolicy_calib: str = ""  # a calibration file (decode.runtime.quant.write_calib) to GPTQ-round the int4 writer on
    eval_per_domain: int = 6  # held-out prompts per domain, never trained on
    speed_prompts: int = 0  # held-out prompts timed before/after distillation (0 = leave it to the validate stage)
    speed_k: int = 3  # K for that before/after timing
    data_dir: str = ""  # a gen-data folder to train on instead of generating (held-out prompts: from prompts)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.data not in DATA_SOURCES:
            raise ValueError(f"data must be one of {', '.join(DATA_SOURCES)}, got {self.data!r}")
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {self.mix}")
        if self.data_temperature < 0:
            raise ValueError(f"data_temperature must be >= 0, got {self.data_temperature}")
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"engine must be hf or vllm, got {self.engine!r}")
        if self.onpolicy_quant not in (None, "int4", "int8"):
            raise ValueError(f"onpolicy_quant must be int4, int8 or null, got {self.onpolicy_quant!r}")
        if self.onpolicy_calib and self.onpolicy_quant != "int4":
            raise ValueError("onpolicy_calib rounds an int4 writer: set onpolicy_quant to int4")
        if self.samples_per_prompt > 1 and self.data_temperature == 0:
            raise ValueError("samples_per_prompt > 1 needs data_temperature > 0 (greedy rows would repeat)")
        for name in ("max_new_tokens", "eval_per_domain", "gen_batch_size", "speed_k", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.speed_prompts < 0:
            raise ValueError(f"speed_prompts must be >= 0, got {self.speed_prompts}")


def split_prompts(prompts: list[Prompt], eval_per_domain: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held_out): the first `eval_per_domain` prompts of each domain are held out."""
    seen: dict[str, int] = {}
    train_p, held = [], []
    for p in prompts:
        n = seen.get(p.domain, 0)
        (held if n < eval_per_domain else train_p).append(p)
        seen[p.domain] = n + 1
    if not train_p or not held:
        raise DraftsmithError(f"need prompts both to train on and to hold out (eval_per_domain={eval_per_domain})")
    return train_p, held


def repeat_prompts(prompts: list[Prompt], n: int) -> list[Prompt]:
    """Each prompt `n` times in a row, the copies after the first with ids `ID~2` ... `ID~n` (each data row is
    seeded by its place in the list: every copy samples its own answer)."""
    return [p if j == 0 else dataclasses.replace(p, id=f"{p.id}~{j + 1}") for p in prompts for j in range(n)]


def skipped_note(summary: dict) -> str | None:
    """What a user must know when steps were skipped for a non-finite loss or gradient (None when none were)."""
    n = summary.get("skipped_steps", 0)
    if not n:
        return None
    best = summary.get("best_step")
    kept = (f"best/ is the draft of step {best}, the best alpha measured" if best is not None
            else "best/ is the final student")
    return (f"{n} step(s) had a non-finite loss or gradient and were skipped (their updates were not applied); "
            f"{kept}, before the loss diverged; lower lr if this repeats")


@dataclass
class DataConfig:
    """A recipe's `data:` section: prompts the target writes itself (`gen-prompts`), then its answers with the
    teacher's top-k (`gen-data`, with the distill section's data settings), for the distill stage to train on.
    n = 0: no data stage (distill generates its rows from the recipe's own prompts)."""

    n: int = 0  # prompts to keep, shared evenly across the domains (0 = no data stage)
    domains: list[str] = field(default_factory=lambda: ["code", "json", "summarize", "chat"])  # what they ask for
    prompt_temperature: float = 0.8  # sampling temperature of the requests
    max_prompt_tokens: int = 96  # a request longer than this is dropped
    dedup_threshold: float = 0.7  # word 3-gram Jaccard similarity at or above which a request is a near-duplicate
    batch_size: int = 64  # requests (then answers) decoded together
    max_new_tokens: int = 160  # tokens per answer (distill.max_new_tokens stays the held-out references' length)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 0 or self.batch_size < 1 or self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("n must be >= 0, batch_size, max_prompt_tokens and max_new_tokens >= 1")
        if self.n and not self.domains:
            raise ValueError("domains: name at least one (code, json, summarize, chat)")


def run_data(target_spec: str, out: Path, data: DataConfig, cfg: DistillConfig, *, device: str = "cpu") -> dict:
    """The data stage: out/prompts (the target's own requests) then out/rows (its answers, the teacher cache
    beside them; `data.max_new_tokens` and `data.batch_size`, the rest of the rows' settings from the distill
    section); both resume. Returns what the stage reports."""
    from draftsmith.decode.runtime.io import read_json
    from draftsmith.distill.prompt_gen import generate_prompts

    out = Path(out)
    target = load(target_spec, device=device)
    generate_prompts(target, data.n, list(data.domains), out / "prompts", temperature=data.prompt_temperature,
                     seed=data.seed, batch_size=data.batch_size, max_prompt_tokens=data.max_prompt_tokens,
                     dedup_threshold=data.dedup_threshold)
    del target
    rows_cfg = dataclasses.replace(cfg, max_new_tokens=data.max_new_tokens, gen_batch_size=data.batch_size)
    got = gen_data(target_spec, out / "rows", rows_cfg, prompts=str(out / "prompts"), device=device)
    p = read_json(out / "prompts" / "stats.json", what="prompt statistics")
    return {"prompts": p["kept"], "unique_fraction": p["unique_fraction"], "rows": len(got["dataset"]),
            "new_tokens": (got["stats"] or {}).get("new_tokens"), "tokens_per_s": (got["stats"] or {}).get("tokens_per_s"),
            "data_dir": str(out / "rows")}


def gen_data(target_spec: str, out: Path, cfg: DistillConfig, *, prompts: str = "code,json,summarize,chat",
             limit_per_domain: int | None = None, device: str = "cpu", progress: bool = True) -> dict:
    """`draftsmith gen-data`: the rows of `distill.data.generate_data` for the prompts, then (teacher = cache)
    the target's top-k cache every training run on the folder finds. Returns {dataset, stats, cache, how, main}.

    Under `accelerate launch --num_processes N` (one machine or several) each process generates its share of
    the prompts (`shard`), the main process (`main`) merges the shards into the one dataset a single process
    would have written and builds the cache, and every process returns the same dataset."""
    from draftsmith.distill.data import DATASET_DIR, TOPK_DIR, captured_topk, data_stats, merge_shards, training_rows
    from draftsmith.distill.teacher_cache import build_teacher_cache, write_teacher_cache
    from draftsmith.distill.train import TEACHER_CACHE_DIR

    state = _distributed(device)
    shard = (state.process_index, state.num_processes) if state is not None else None
    main = state is None or state.is_main_process
    if state is not None and device == "cuda":
        device = str(state.device)
    rows = repeat_prompts(load_prompts(prompts, limit_per_domain=limit_per_domain), cfg.samples_per_prompt)
    target = load(target_spec, device=device)
    draft = load(resolve_candidate(cfg.draft), device=device)
    topk = cfg.train.teacher_topk if cfg.train.teacher == "cache" else 0
    ds = generate_data(target, draft, rows, out, source=cfg.data, mix=cfg.mix, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.data_temperature, seed=cfg.train.seed, speculative=cfg.speculative_data,
                       batch_size=cfg.gen_batch_size, topk=topk, shard=shard, engine=cfg.engine,
                       draft_quant=cfg.onpolicy_quant, draft_calib=cfg.onpolicy_calib or None,
                       progress=progress and (state is None or state.is_local_main_process))
    if shard is not None:
        state.wait_for_everyone()
        if main:
            ds = merge_shards(out, rows, state.num_processes)
    result: dict = {"cache": None, "how": None, "main": main}
    if main and cfg.train.teacher == "cache":  # the target's top-k now, where every training run on it finds it
        train_rows, root = training_rows(ds), Path(out) / TEACHER_CACHE_DIR
        kept = captured_topk(out, len(ds)) if len(train_rows) == len(ds) else None
        if kept is not None:  # kept while the target generated: no second pass
            cache = write_teacher_cache(target, train_rows, root, *kept, dtype=cfg.train.teacher_cache_dtype)
            shutil.rmtree(Path(out) / TOPK_DIR, ignore_errors=True)  # now in the cache: not kept twice
        else:
            cache = build_teacher_cache(target, train_rows, root, k=cfg.train.teacher_topk,
                                        dtype=cfg.train.teacher_cache_dtype, batch_size=cfg.train.batch_size)
        result.update(cache=cache, how="kept while generating" if kept is not None else "computed")
    if shard is not None:
        state.wait_for_everyone()  # the other processes read the merged dataset once it is in place
        if not main:
            ds = datasets.load_from_disk(str(Path(out) / DATASET_DIR))
    result.update(dataset=ds, stats=data_stats(out))
    return result


def _distributed(device: str):
    """accelerate's PartialState when this process is one of several (`accelerate launch`), else None. On CPU
    the processes talk through gloo: launch them with `accelerate launch --multi_gpu --num_processes N` (its
    torchrun launcher; `--cpu` alone starts one process unless MPI is installed) or `torchrun`."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    state = PartialState(cpu=device == "cpu")
    return state if state.num_processes > 1 else None


def run_distill(target_spec: str, draft_spec: str, out: Path, cfg: DistillConfig, *,
                prompts: str = "code,json,summarize,chat", limit_per_domain: int | None = None, resume: bool = True,
                device: str = "cpu") -> dict:
    """The whole distillation into `out`; returns (and writes to out/distill.json) its result."""
    out = Path(out)
    spec = DraftSpec.parse(draft_spec)
    if spec.kind not in ("model", "derive", "int4") or spec.adapter is not None:
        raise DraftsmithError(f"{draft_spec}: distillation trains a whole model or its int4 copy (int4:MODEL), not a "
                              "vocabulary-pruned draft or one with an adapter")
    if spec.kind == "int4":  # the served int4 draft itself: LoRA over its frozen int4 weights, or its group pairs
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, base_quant="int4", base_calib=str(spec.calib) if spec.calib else None))
    target = load(target_spec, device=device)
    draft = load(resolve_candidate(spec.weights), device=device)
    draft.name = draft_spec
    train_p, held = split_prompts(load_prompts(prompts, limit_per_domain=limit_per_domain), cfg.eval_per_domain)
    if cfg.data_dir:  # rows made before (gen-data: the target's prompts and answers at scale)
        data = load_data_folder(Path(cfg.data_dir), target)
    else:
        data = generate_data(target, draft, repeat_prompts(train_p, cfg.samples_per_prompt), out / "data",
                             source=cfg.data, mix=cfg.mix,
                             max_new_tokens=cfg.max_new_tokens, temperature=cfg.data_temperature, seed=cfg.train.seed,
                             speculative=cfg.speculative_data, batch_size=cfg.gen_batch_size,
                             draft_quant=cfg.onpolicy_quant, draft_calib=cfg.onpolicy_calib or None)
    refs = reference_continuations(target, held, max_new_tokens=cfg.max_new_tokens)
    summary = train(target, draft, data, refs, out, cfg.train, resume=resume)
    tuned = load(summary["paths"]["best"], device=device) if "best" in summary.get("paths", {}) else None
    result = {
        "target": target_spec, "draft": draft_spec, "config": asdict(cfg.train), "distill": asdict(cfg),
        "data_source": cfg.data, "train_prompts": len(data) if cfg.data_dir else len(train_p), "data_dir": cfg.data_dir or None,
        "held_out_prompts": len(held), "data_rows": len(data),
        "alpha_before": summary["alpha_before"], "alpha_after": summary["alpha_after"],
        "alpha_gain": summary["alpha_after"] - summary["alpha_before"] if summary["alpha_before"] is not None else None,
        "skipped_steps": summary.get("skipped_steps", 0),
        "skipped_note": skipped_note(summary),
        "train_summary": summary,
        "curve": curve_summary(log_lines(out / "log.jsonl")),
    }
    if cfg.train.base_quant is not None and tuned is not None:  # which form serves: unmerged or re-quantised
        from draftsmith.distill.served import compare_served, served_specs

        specs = served_specs(spec.weights, out, spec.calib, adapter=cfg.train.lora_r > 0)
        served = compare_served(target, specs, refs, device=device)
        result.update(served=served, served_spec=served["forms"][served["pick"]]["spec"])
    if tuned is not None and cfg.speed_prompts:
        with torch.no_grad():
            rows = list(refs)[: cfg.speed_prompts]
            max_len = max(len(r["prompt_ids"]) for r in rows) + cfg.max_new_tokens + cfg.speed_k + 2
            runners = {name: make_runner(m.model, max_len, quantize=draft_quant(m.model))
                       for name, m in (("draft_before", draft), ("draft_after", tuned))}
            val: Validation = validate_drafts(make_runner(target.model, max_len), runners, [r["prompt_ids"] for r in rows],
                                              k=cfg.speed_k, max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids(target),
                                              names=[r["id"] for r in rows], desc="before/after", device=device)
            result["speed"] = val.to_dict()
    atomic_write_json(out / "distill.json", result)
    return result
