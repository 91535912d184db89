"""The distill and data stages' results, typed: what each writes as JSON, read back (and written) through one
type each, so that readers (the run report, the cross-run leaderboard) never guess at keys.

    from draftsmith.distill.results import DistillResult, read_log
    result = DistillResult.from_dict(read_json(run / "distill" / "distill.json"), "distill/distill.json")

- `PromptStats`: data/prompts/stats.json (`distill.prompt_gen`: the requests the target wrote and kept);
- `RowStats`: data/rows/stats.json (`distill.data`: the answers generated, and how fast);
- `DistillResult`: distill/distill.json (`distill.pipeline.run_distill`); `read_log`: distill/log.jsonl;
- `HeadResult`: distill/head.json (`distill.heads.pipeline.run_head`);
Each is a `decode.runtime.records.Record`: typed fields for the keys readers use, every other key kept as written, a
`version` (a record without one, written before versions were, reads as version 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.decode.runtime.records import Part, Record


@dataclass
class PromptStats(Record):
    """data/prompts/stats.json: requests kept (overall and by domain), their unique fraction, and why the rest
    were rejected."""

    kept: int
    kept_by_domain: dict[str, int]
    unique_fraction: float
    rejected: dict[str, int]


@dataclass
class RowStats(Record):
    """data/rows/stats.json: the answers the target wrote, its new tokens, and the generation's seconds and
    tokens/s (over every session that generated; `processes` for a data-parallel run)."""

    rows: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    batch_size: int | None = None
    processes: int | None = None


@dataclass
class TrainSettings(Part):
    """distill.json's `config` (distill.train.TrainConfig): what the report states of the training."""

    loss: str
    steps: int
    batch_size: int
    lr: float
    lora_r: int = 0
    base_quant: str | None = None  # "int4": trained over the int4 draft's weights (LoRA, or its group pairs)


@dataclass
class TrainSummary(Part):
    """distill.json's `train_summary` (distill.train.train's summary)."""

    best_step: int | None = None
    steps_done: int | None = None


@dataclass
class DistillResult(Record):
    """distill/distill.json: a standalone draft distilled toward the target, alpha on held-out prompts before and
    after; `speed`: decode.bench.Validation's dict when the run timed the drafts itself."""

    NESTED = {"config": ("one", TrainSettings), "train_summary": ("one", TrainSummary)}

    target: str
    draft: str
    config: TrainSettings
    data_source: str
    data_rows: int
    train_prompts: int
    held_out_prompts: int
    alpha_before: float | None
    alpha_after: float | None
    alpha_gain: float | None = None
    skipped_note: str | None = None
    train_summary: TrainSummary = field(default_factory=TrainSummary)
    speed: dict | None = None
    served: dict | None = None  # a run over an int4 base: its forms compared (`distill.served.compare_served`)
    served_spec: str | None = None  # the form it serves in, as a draft spec
    curve: dict | None = None  # alpha against tokens trained on, its fit (`distill.curve.curve_summary`)

    def steps_done(self) -> int:
        """Steps trained: the summary's count, else the configured steps."""
        done = self.train_summary.steps_done
        return self.config.steps if done is None else done

    def speedup_after(self) -> float | None:
        """The distilled draft's speedup when the run timed it (`speed`), else None."""
        return ((self.speed or {}).get("speedup_vs_target_only") or {}).get("draft_after")


@dataclass
class LogRow(Part):
    """One line of distill/log.jsonl: a training step (`loss`) or an evaluation (`eval`: alpha held out, overall
    and by domain)."""

    step: int
    loss: float | None = None
    eval: bool = False
    alpha: float | None = None
    alpha_by_domain: dict[str, float] = field(default_factory=dict)

    def alpha_in(self, domain: str, default: float | None = None) -> float | None:
        return self.alpha_by_domain.get(domain, default)


@dataclass
class TrainLog:
    """distill/log.jsonl, split: the training steps with a loss, and the evaluations."""

    steps: list[LogRow]
    evals: list[LogRow]

    def __bool__(self) -> bool:
        return bool(self.steps or self.evals)

    def best_eval(self, step: int | None) -> LogRow:
        """The evaluation at `step` (the checkpoint kept), else the one with the highest alpha."""
        return next((r for r in self.evals if r.step == step), max(self.evals, key=lambda r: r.alpha))


def log_lines(path: Path) -> list[dict]:
    """distill/log.jsonl's lines as written (none when absent; a line cut by an interruption is left out)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by an interruption
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_log(path: Path) -> TrainLog:
    """distill/log.jsonl as a TrainLog (empty when absent; a line cut by an interruption is left out)."""
    rows = [LogRow.from_dict(row, str(path)) for row in log_lines(path)]
    return TrainLog([r for r in rows if "loss" not in r.absent and not r.eval], [r for r in rows if r.eval])


@dataclass
class HeadData(Part):
    """head.json's `data` / `written_data` (distill.heads.data's stats): rows, tokens, generated tokens and how
    fast they were generated."""

    rows: int
    tokens: int
    new_tokens: int
    generate_tokens_per_s: float = 0.0


@dataclass
class HeadSettings(Part):
    """head.json's `config` (distill.heads.pipeline.HeadRunConfig): what the report states of the run."""

    temperature: float
    rows_per_step: int
    draft_vocab_size: int
    samples: int | None = None  # sampled continuations per training prompt (a docs/results summary drops it)
    written_samples: int = 1
    gen_dtype: str = "float32"
    train_dtype: str = "float32"


@dataclass
class HeadTrainSummary(Part):
    """head.json's `train_summary` (distill.heads.train's summary, its evals left out)."""

    steps: int
    tokens_seen: int
    seconds: float
    draft_vocab_coverage: float


@dataclass
class DataCap(Part):
    """head.json's `data_cap`: the data's share of a time budget and what it cut."""

    seconds: float | None = None
    left_out: list[str] = field(default_factory=list)
    cut_shards: int = 0
    skipped_shards: int = 0

    def cut(self) -> bool:
        return bool(self.cut_shards or self.skipped_shards or self.left_out)


@dataclass
class HeadResult(Record):
    """distill/head.json: an EAGLE-3-style head trained on the target's text and features; held-out agreement by
    depth before and after, and along training (`curve`: [{tokens, agreement_by_depth}])."""

    NESTED = {"config": ("one", HeadSettings), "train_summary": ("one", HeadTrainSummary),
              "data": ("one", HeadData), "written_data": ("one", HeadData), "data_cap": ("one", DataCap)}

    target: str
    aux_layers: list[int]
    config: HeadSettings
    train_summary: HeadTrainSummary
    data: HeadData
    train_prompts: int
    held_out_prompts: int
    agreement_after: list[float | None]
    curve: list[dict]
    kind: str = "head"
    head: str | None = None  # the best checkpoint's folder
    agreement_before: list[float | None] = field(default_factory=list)
    written_data: HeadData | None = None
    data_cap: DataCap | None = None


__all__ = ["DataCap", "DistillResult", "HeadData", "HeadResult", "HeadSettings",
           "HeadTrainSummary", "LogRow", "PromptStats", "RowStats", "TrainLog", "TrainSettings",
           "TrainSummary", "log_lines", "read_log"]
