"""A draft head through the recipe line: data, held-out references and training (`run_head`). `draftsmith run`
calls it (through `distill.kinds`) when a recipe says `distill.draft: head`; validation is `pairing.validate`.

    from draftsmith.distill.heads.pipeline import HeadRunConfig, run_head
    result = run_head("smollm2-135m-instruct", Path("runs/x/distill"), HeadRunConfig(train_minutes=12.5),
                      prompts="code,json,summarize,chat", eval_per_domain=4)

Prompts split as in distillation (the first `eval_per_domain` of every domain held out). `out/data/`: the
target's sampled continuations of the training prompts with its features (`distill.heads.data`); with
`written_prompts`, `out/prompts/` (requests the target writes itself, `distill.prompt_gen`) and `out/written/`
(its continuations of them, trained on beside `out/data/`); `out/held/`:
greedy continuations of the held-out prompts; `out/head/`: training (`distill.heads.train`; `best/` by held-out
depth-1 agreement, resumable); `out/head.json`: this run's result. Every step resumes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


from draftsmith.decode.batch import GEN_DTYPES
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, read_json
from draftsmith.decode.runtime.kernels import bf16_speedup
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.prompts import load_prompts
from draftsmith.distill.heads.data import HeadDataConfig, build_head_data, generation_seconds, load_head_data
from draftsmith.distill.heads.train import HeadTrainConfig, prompt_key, train_head

HEAD = "head"  # distill.draft's value that trains a head instead of distilling a standalone draft
HEAD_RESULT = "head.json"


@dataclass
class HeadRunConfig:
    """A recipe's `head:` section: the head's data and training (used when distill.draft is `head`)."""

    samples: int = 12  # sampled continuations of the target per training prompt
    max_new_tokens: int = 128  # tokens per continuation
    temperature: float = 0.8  # of the training continuations (held-out ones are greedy)
    gen_batch_size: int = 64  # rows the target decodes together
    written_prompts: int = 0  # prompts the target writes itself (distill.prompt_gen, the training prompts' domains),
    # answered and trained on beside the recipe's own
    written_samples: int = 1  # sampled continuations per written prompt
    prompt_tokens: int = 96  # a written prompt longer than this is dropped
    gen_dtype: str = "float32"  # the target's weights while it writes the training data (a copy; bfloat16: faster
    # on CPUs with AMX); the held-out references are always written in the target's own dtype
    draft_vocab_size: int = 8192  # ids the head can propose: the target's most frequent predictions
    ttt_steps: int = 3  # depths unrolled in training (EAGLE-3's training-time test)
    lr: float = 1e-3  # peak AdamW learning rate
    epochs: float = 10.0  # passes over the data (at most; train_minutes usually ends training first)
    rows_per_step: int = 8  # sequences per optimizer step
    train_minutes: float = 12.5  # training time budget (the cosine schedule is fitted to it); 0 = epochs decide
    budget_minutes: float = 0.0  # data and training together: training gets what the data's generation left
    # (its recorded seconds, so a resumed run plans the same), at most train_minutes; 0 = train_minutes alone
    data_share: float = 0.7  # with budget_minutes: the data's generation stops at this share of the budget
    # (answers cut short, fewer written prompts) so that a slower machine still trains
    eval_every: int = 50  # steps between held-out evaluations
    label_temperature: float = 1.0  # the target's distribution the head learns, at this temperature (< 1 sharpens)
    train_dtype: str = "float32"  # matmuls of training in bfloat16 (autocast; weights and optimizer stay float32)
    intermediate_size: int | None = None  # the head's MLP width (null: the target's)
    extra_data: list[str] = field(default_factory=list)  # head data folders (distill.heads.data) trained on too
    prompt_stride: int = 1  # train on every S-th distinct prompt's rows (with rows_per_prompt: what diversity buys)
    rows_per_prompt: int = 0  # train on at most N rows (samples) per prompt (0 = all)
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in (("gen_dtype", self.gen_dtype), ("train_dtype", self.train_dtype)):
            if value not in GEN_DTYPES:
                raise ValueError(f"{name} must be {' or '.join(GEN_DTYPES)}, got {value!r}")
        if self.written_prompts < 0:
            raise ValueError(f"written_prompts must be >= 0, got {self.written_prompts}")
        for name in ("samples", "written_samples", "prompt_tokens", "max_new_tokens", "gen_batch_size",
                     "draft_vocab_size", "ttt_steps", "rows_per_step", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.label_temperature <= 0:
            raise ValueError(f"label_temperature must be > 0, got {self.label_temperature}")
        if self.lr <= 0 or self.epochs <= 0 or self.train_minutes < 0 or self.temperature < 0:
            raise ValueError("lr and epochs must be > 0, train_minutes and temperature >= 0")
        if self.prompt_stride < 1 or self.rows_per_prompt < 0:
            raise ValueError(f"prompt_stride must be >= 1 and rows_per_prompt >= 0, got {self.prompt_stride}, "
                             f"{self.rows_per_prompt}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1 (or null), got {self.intermediate_size}")
        if self.budget_minutes < 0:
            raise ValueError(f"budget_minutes must be >= 0, got {self.budget_minutes}")
        if not 0 < self.data_share <= 1:
            raise ValueError(f"data_share must be in (0, 1], got {self.data_share}")


def aux_layers_for(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature layers: low, middle, high ([2, L/2, L-3], as llama.cpp's converter assumes)."""
    if n_layers < 4:
        raise DraftsmithError(f"a head reads 3 target layers [2, L/2, L-3]: the target has only {n_layers}")
    return 2, n_layers // 2, n_layers - 3


def fast_dtype(requested: str, device: str, name: str = "dtype",
               shape: tuple[int, int, int] = (256, 1024, 4096)) -> str:
    """`requested`, unless it is bfloat16 on a CPU where bfloat16 Linears are not faster than float32 at `shape`
    (rows, in, out: `decode.runtime.kernels.bf16_speedup`, timed here; no oneDNN path at all, as with AVX2 alone,
    counts as slower): float32 there, said in one line with the measured ratio. GPUs get what was asked."""
    if requested != "bfloat16" or not str(device).startswith("cpu"):
        return requested
    speedup = bf16_speedup(*shape)
    if speedup > 1.0:
        return requested
    why = (f"bfloat16 ran {speedup:.2f}x float32 at {shape[0]} x {shape[1]} x {shape[2]} here" if speedup
           else "this CPU has no fast bfloat16 path (AVX-512 BF16 / AMX)")
    print(f"head: {name} bfloat16 -> float32: {why}", file=sys.stderr)
    return "float32"


def _build_data(target, cfg: HeadRunConfig, out: Path, train_p: list, held_p: list, aux: tuple[int, ...],
                progress: bool) -> tuple[dict, dict | None, dict, float, DataCap, list[Path]]:
    """The held-out references (whole), then the training answers, the target's own prompts and its answers to
    them within the data's share of the budget (`DataCap`) -> (data, written, held stats, prompt seconds, the cap,
    the training folders)."""
    held = build_head_data(target, held_p, out / "held", HeadDataConfig(  # the references: always whole
        samples=1, max_new_tokens=cfg.max_new_tokens, temperature=0.0, batch_size=cfg.gen_batch_size,
        aux_layers=aux), progress=progress)
    cap = DataCap(cfg.budget_minutes * 60 * cfg.data_share if cfg.budget_minutes else None,
                  weights=PHASE_WEIGHTS if cfg.written_prompts else {"data": 1.0}, spent=generation_seconds(held))
    data = build_head_data(target, train_p, out / "data", HeadDataConfig(
        samples=cfg.samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed,
        batch_size=cfg.gen_batch_size, aux_layers=aux, dtype=cfg.gen_dtype), progress=progress,
        max_seconds=cap.allow("data"))
    cap.spend("data", generation_seconds(data))
    folders, written, prompt_s = [out / "data"], None, 0.0
    if cfg.written_prompts and cap.has_time("prompts"):
        from draftsmith.distill.prompt_gen import DOMAINS, generate_prompts

        domains = [d for d in dict.fromkeys(p.domain for p in train_p) if d in DOMAINS] or list(DOMAINS)
        generate_prompts(target, cfg.written_prompts, domains, out / "prompts", temperature=cfg.temperature or 0.8,
                         seed=cfg.seed, batch_size=cfg.gen_batch_size, max_prompt_tokens=cfg.prompt_tokens,
                         dtype=cfg.gen_dtype, progress=progress, max_seconds=cap.allow("prompts"))
        prompt_s = read_json(out / "prompts" / "stats.json", what="prompt statistics")["seconds_this_run"]
        cap.spend("prompts", prompt_s)
        if cap.has_time("written"):
            written = build_head_data(target, load_prompts(out / "prompts"), out / "written", HeadDataConfig(
                samples=cfg.written_samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                seed=cfg.seed, batch_size=cfg.gen_batch_size, aux_layers=aux, dtype=cfg.gen_dtype),
                progress=progress, max_seconds=cap.allow("written"))
            folders.append(out / "written")
    if cap.skipped:
        print(f"head: the data's share of the budget ({cap.total / 60:.1f} min) was spent before "
              f"{' and '.join(PHASE_NAMES[p] for p in cap.skipped)}: left out", file=sys.stderr)
    return data, written, held, prompt_s, cap, folders


def run_head(target_spec: str, out: Path, cfg: HeadRunConfig, *, prompts: str = "code,json,summarize,chat",
             limit_per_domain: int | None = None, eval_per_domain: int = 4, device: str = "cpu",
             progress: bool = True) -> dict:
    """Data, held-out references and training into `out`; returns (and writes out/head.json) the result."""
    from draftsmith.distill.pipeline import split_prompts

    out = Path(out)
    target = load(target_spec, device=device)
    mc = target.model.config  # each dtype's Linears at the rows it runs: a step's rows, and a training batch's
    hidden, inner = mc.hidden_size, getattr(mc, "intermediate_size", 4 * mc.hidden_size)
    cfg = dataclasses.replace(
        cfg, gen_dtype=fast_dtype(cfg.gen_dtype, device, "gen_dtype", (cfg.gen_batch_size, hidden, inner)),
        train_dtype=fast_dtype(cfg.train_dtype, device, "train_dtype",
                               (cfg.rows_per_step * cfg.max_new_tokens, hidden, inner)))
    aux = aux_layers_for(target.model.config.num_hidden_layers)
    train_p, held_p = split_prompts(load_prompts(prompts, limit_per_domain=limit_per_domain), eval_per_domain)
    t0 = time.perf_counter()
    data, written, held, prompt_s, cap, folders = _build_data(target, cfg, out, train_p, held_p, aux, progress)
    data_seconds = time.perf_counter() - t0
    for extra in cfg.extra_data:
        if not any(Path(extra).expanduser().glob("shard-*.safetensors")):
            raise DraftsmithError(f"head.extra_data: no head data in {extra} (shard-*.safetensors)")
        folders.append(Path(extra).expanduser())
    rows = thin_rows([r for folder in folders for r in load_head_data(folder)], cfg.prompt_stride,
                     cfg.rows_per_prompt)
    generation_s = sum(generation_seconds(d) for d in (data, written, held) if d) + prompt_s
    train_minutes = cfg.train_minutes
    if cfg.budget_minutes:
        left = cfg.budget_minutes - generation_s / 60
        if left < 1:
            raise DraftsmithError(f"head: the data took {generation_s / 60:.1f} of budget_minutes "
                                  f"{cfg.budget_minutes:g}; nothing is left to train (raise it, or ask for less data)")
        train_minutes = min(train_minutes, left) if train_minutes else left
    summary = train_head(target, rows, load_head_data(out / "held"), out / "head",
                         HeadTrainConfig(draft_vocab_size=cfg.draft_vocab_size, ttt_steps=cfg.ttt_steps, lr=cfg.lr,
                                         epochs=cfg.epochs, rows_per_step=cfg.rows_per_step,
                                         eval_every=cfg.eval_every, max_minutes=train_minutes, seed=cfg.seed,
                                         dtype=cfg.train_dtype, label_temperature=cfg.label_temperature,
                                         intermediate_size=cfg.intermediate_size),
                         aux_layers=aux, progress=progress)
    evals = summary["evals"]
    best = next((e for e in evals if e["step"] == summary["best_step"]), evals[-1])
    result = {
        "kind": HEAD, "target": target_spec, "head": str(out / "head" / "best"), "aux_layers": list(aux),
        "config": asdict(cfg), "train_prompts": len(train_p), "held_out_prompts": len(held_p),
        "held_out_ids": [p.id for p in held_p], "data": data, "written_data": written, "held_data": held,
        "data_seconds_this_session": data_seconds, "generation_seconds": generation_s,
        "train_minutes": train_minutes,
        "data_cap": {"seconds": cap.total, "left_out": [PHASE_NAMES[p] for p in cap.skipped],
                     "cut_shards": sum(d.get("cut_shards", 0) for d in (data, written) if d),
                     "skipped_shards": sum(d.get("skipped_shards", 0) for d in (data, written) if d)},
        "agreement_before": evals[0]["agreement_by_depth"], "agreement_after": best["agreement_by_depth"],
        "curve": [{"tokens": e["tokens"], "agreement_by_depth": e["agreement_by_depth"]} for e in evals],
        "train_summary": {k: v for k, v in summary.items() if k != "evals"},
    }
    atomic_write_json(out / HEAD_RESULT, result)
    return result


PHASE_WEIGHTS = {"data": 0.55, "prompts": 0.18, "written": 0.27}  # the data's parts, as measured on a fast CPU
PHASE_NAMES = {"data": "the answers to the training prompts", "prompts": "the prompts the target writes",
               "written": "its answers to them"}


@dataclass
class DataCap:
    """The data's time budget (`total` seconds; None: none) shared by its parts in order: each gets what is
    left times its weight over the weights still to come, so a part that ends early leaves more to the next."""

    total: float | None
    weights: dict[str, float]
    spent: float = 0.0
    skipped: list[str] = field(default_factory=list)
    _done: list[str] = field(default_factory=list)

    def allow(self, part: str) -> float | None:
        """The seconds `part` may take (None: no budget; <= 0: none left, and `part` is noted as skipped)."""
        if self.total is None:
            return None
        to_come = [p for p in self.weights if p not in self._done]
        left = (self.total - self.spent) * self.weights[part] / sum(self.weights[p] for p in to_come)
        if left <= 0 and part not in self.skipped:
            self.skipped.append(part)
        return left

    def has_time(self, part: str) -> bool:
        allowed = self.allow(part)
        return allowed is None or allowed > 0

    def spend(self, part: str, seconds: float) -> None:
        """`part` took `seconds`: the parts after it share what is left."""
        self.spent += seconds
        self._done.append(part)


def thin_rows(rows: list[dict], stride: int = 1, per_prompt: int = 0) -> list[dict]:
    """Every `stride`-th distinct prompt (in order of first appearance) with at most `per_prompt` of its rows
    (0 = all), in their order."""
    groups: dict[bytes, list[dict]] = {}
    for r in rows:
        groups.setdefault(prompt_key(r), []).append(r)
    keep = {id(r) for g in list(groups.values())[::stride] for r in (g[:per_prompt] if per_prompt else g)}
    return [r for r in rows if id(r) in keep]


def held_rows(folder: Path) -> list[dict] | None:
    """The held-out reference rows `run_head` wrote into folder/held (None where there are none)."""
    held = Path(folder) / "held"
    return load_head_data(held) if any(held.glob("shard-*.safetensors")) else None


def head_result(folder: Path) -> dict | None:
    """out/head.json of a head run (None when absent)."""
    return read_json(Path(folder) / HEAD_RESULT, missing_ok=True, what="head result")


__all__ = ["HEAD", "HeadRunConfig", "aux_layers_for", "head_result", "held_rows", "run_head"]
