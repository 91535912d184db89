"""Distil the target into the draft: a plain loop over `accelerate`, divergence on continuation tokens only.

    from draftsmith.distill.train import TrainConfig, train
    summary = train(load(target), load(draft), generate_data(...), reference_continuations(target, held_out),
                    Path("runs/x/distill"), TrainConfig(loss="fkl", lr=1e-4, steps=200, lora_r=16))

One optimizer step = `grad_accum` micro-batches of `batch_size` rows (prompt + continuation, right-padded).
The target scores every row online under no_grad (frozen, eval mode), or, with `teacher="cache"`, its top
`teacher_topk` log-probs are computed once into a cache on disk (`distill.teacher_cache`; next to the data
when the data is a `distill.data` folder, else in `out/teacher-topk`) and the rest of the vocabulary is
-inf (at k = V the loss is the online one). The loss is the chosen divergence
(`distill.divergences`, named by direction: fkl = KL(p || q), rkl = KL(q || p), jsd, tvd = 1 - beta_t)
summed over the continuation positions of all micro-batches, divided by their GLOBAL token count, which is
counted before the first forward: accumulation equals one big batch exactly. AdamW, linear warm-up then
cosine / linear / constant, gradient-norm clipping, and a NaN/inf guard (the step is skipped and counted;
`max_bad_steps` of them stop the run). The student is a copy of the draft (train mode, dropout off), either
fully fine-tuned or, with `lora_r > 0`, through LoRA adapters on every Linear layer of the decoder.

Training the draft that is served (`base_quant="int4"`, with `lora_r > 0`; QLoRA-style): before the adapters go
on, every Linear the int4 draft quantises (the decoder's and the LM head) takes the exact float weights that draft
decodes with (`decode.runtime.quant.int4_float_weights`: the same rounding, GPTQ on `base_calib`'s sequences where
one is named, bit for bit), frozen; a tied LM head is untied first (the int4 draft rounds a copy of the head; the
input embedding stays float). The float32 adapters then train over that base with the losses as ever; the step-0
alpha (`alpha_before`) is then the int4 draft's own, the baseline training wins back from. Both forms
it serves in come out of the run: `best-adapter/` (the adapter, unmerged: `int4:MODEL[:calib=FILE]:lora=FOLDER`)
and `best/` (merged into float weights: a plain HF folder that exports as any draft and that `int4:best`
re-quantises); `distill.served` measures which decodes faster at equal agreement.

Folder `out` (files: `distill.checkpoint`):
- `log.jsonl`: one line per step {step, loss, <divergence name>, lr, grad_norm, tokens, skipped} and one per
  eval {step, alpha, alpha_by_domain, positions}. `loss` is the true divergence (nats per token).
- `checkpoints/step-N/` (only the latest is kept, written beside and renamed into place): `student.safetensors`
  (the trained parameters: all of them, or the LoRA adapters), `state.pt` (optimizer, scheduler, RNG states;
  read back with `torch.load(weights_only=True)`), `trainer.json` (step, data position, best alpha, config),
  `log.jsonl`. `resume=True` continues from the latest one and ends bit-for-bit where an uninterrupted run
  would (on CPU).
- `best/`: a Hugging Face folder of the student with the best alpha so far (LoRA merged), with the tokenizer;
  with `base_quant`, also `best-adapter/`: the same student's adapter unmerged (peft's adapter_config.json and
  adapter_model.safetensors, plus MARKER naming the base quantisation and calibration).
  alpha is measured teacher-forced and greedy on `eval_refs` (held-out reference continuations) every
  `eval_every` steps and at step 0 (the untouched draft, which is also the first `best`). Without
  `eval_refs`, `best/` is the final student.
- `summary.json`: what `train` returns.

Data order: a torch.Generator seeded from `seed` draws one permutation per epoch; batches run through the
permutations back to back (a batch may straddle two epochs), and (epoch, index, generator state at the
epoch's start) is in every checkpoint.

Several processes: launch the same script with `accelerate launch` (on CPUs:
`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 script.py`, which starts the processes
through torchrun and joins them with gloo; `--cpu` alone starts one process unless mpirun is set up, see
tests/distill/test_multiprocess.py). Every micro-batch then draws
batch_size x processes rows and each process takes its share; the token count is summed over processes
and the loss scaled so that DDP's gradient average is still sum / global count. Only rank 0 writes files;
every rank evaluates (so all agree on early stopping); a teacher cache is built shard by shard across ranks.
With the same global batch (batch_size x processes) a run matches a one-process run up to float rounding:
the same rows per step, the same sum over tokens, only added up in another order.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_dir, atomic_write_json
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.decode.runtime.pair import check_vocab
from draftsmith.decode.sampling import SamplingParams
from draftsmith.distill.checkpoint import (MARKER, list_checkpoints, load_student, restore_checkpoint, save_checkpoint, save_hf,
                                trainable)
from draftsmith.distill.data import collate, training_rows
from draftsmith.distill.divergences import DIVERGENCES, align_vocab, divergence_sum, token_mean
from draftsmith.distill.teacher_cache import DTYPES as TEACHER_DTYPES
from draftsmith.distill.teacher_cache import TeacherTopK, build_teacher_cache
from draftsmith.pairing.acceptance import measure_acceptance

SCHEDULES = ("cosine", "linear", "constant")
MIXED_PRECISION = ("no", "fp16", "bf16")
WANDB_MODES = ("disabled", "offline", "online")
TEACHERS = ("online", "cache")
# fields a resumed run may change: they decide how long and how often, not what a step computes
RESUMABLE_CHANGES = {"steps", "eval_every", "early_stop_patience", "save_every", "max_bad_steps", "wandb"}
TEACHER_CACHE_DIR = "teacher-topk"
BASE_QUANTS = ("int4",)  # TrainConfig.base_quant: the served draft's quantisation the adapters train over
ADAPTER_DIR = "best-adapter"  # beside best/: the adapter unmerged, with base_quant


# -- configuration ------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Every training setting, typed and validated on construction (errors name the field)."""

    loss: str = "fkl"  # fkl | rkl | jsd | tvd (distill.divergences)
    jsd_beta: float = 0.5  # the mixture weight of jsd (0.5 = the symmetric Jensen-Shannon divergence)
    temperature: float = 1.0  # both distributions are softmax(logits / temperature)
    lr: float = 1e-4  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 10  # linear warm-up steps before the schedule
    schedule: str = "cosine"  # cosine | linear | constant (after the warm-up)
    steps: int = 100  # optimizer steps
    batch_size: int = 4  # rows per micro-batch (per process)
    grad_accum: int = 1  # micro-batches per optimizer step
    max_grad_norm: float = 1.0  # 0 = no clipping
    lora_r: int = 0  # 0 = full fine-tuning; > 0 = LoRA rank (merged into best/)
    lora_alpha: int = 16  # LoRA scaling (alpha / r)
    eval_every: int = 25  # steps between held-out alpha measurements (best/ follows the best)
    early_stop_patience: int = 0  # 0 = off; else stop after this many evals without an alpha gain
    save_every: int = 25  # steps between checkpoints (a resume loses at most these)
    max_bad_steps: int = 10  # steps with a non-finite loss or gradient before the run stops
    seed: int = 0  # data order, data sampling and initialisation
    mixed_precision: str = "no"  # no | fp16 | bf16 (accelerate)
    wandb: str = "disabled"  # disabled | offline | online
    teacher: str = "online"  # online (the target scores every batch) | cache (its top-k, computed once to disk)
    teacher_topk: int = 64  # k of the cache (capped at the vocabulary; k = V is exact)
    teacher_cache_dtype: str = "float32"  # float32 | float16: the cached log-probs
    refresh_every: int = 0  # > 0: every N steps the on-policy (draft) rows are resampled from the current student
    base_quant: str | None = None  # "int4": LoRA over the int4 draft's own weights, frozen (lora_r > 0), or
    # with lora_r = 0 the int4 draft's group pairs themselves (`distill.groups`: served at no cost a step)
    base_calib: str | None = None  # with base_quant: the int4 draft's calibration file (`int4:MODEL:calib=FILE`)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if str(f.type).endswith(" | None") and value is None:
                continue
            kind = {"int": int, "float": float, "str": str}[str(f.type).removesuffix(" | None")]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                setattr(self, f.name, value)
            if not isinstance(value, kind) or isinstance(value, bool):
                _bad(f.name, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        _choice("loss", self.loss, tuple(DIVERGENCES))
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        _choice("wandb", self.wandb, WANDB_MODES)
        _choice("teacher", self.teacher, TEACHERS)
        _choice("teacher_cache_dtype", self.teacher_cache_dtype, tuple(TEACHER_DTYPES))
        if not 0.0 < self.jsd_beta < 1.0:
            _bad("jsd_beta", f"must be in (0, 1), got {self.jsd_beta}")
        checks = {
            "temperature": self.temperature > 0, "lr": self.lr > 0, "weight_decay": self.weight_decay >= 0,
            "warmup_steps": self.warmup_steps >= 0, "steps": self.steps >= 1, "batch_size": self.batch_size >= 1,
            "grad_accum": self.grad_accum >= 1, "max_grad_norm": self.max_grad_norm >= 0,
            "lora_r": self.lora_r >= 0, "lora_alpha": self.lora_alpha >= 1, "eval_every": self.eval_every >= 1,
            "early_stop_patience": self.early_stop_patience >= 0, "save_every": self.save_every >= 1,
            "max_bad_steps": self.max_bad_steps >= 1, "seed": self.seed >= 0, "teacher_topk": self.teacher_topk >= 1,
            "refresh_every": self.refresh_every >= 0,
        }
        for name, ok in checks.items():
            if not (ok and math.isfinite(getattr(self, name))):
                _bad(name, f"out of range: {getattr(self, name)!r}")
        if self.refresh_every and self.teacher == "cache":
            _bad("refresh_every", "resampled rows need the online teacher (teacher: online): a cache holds fixed rows")
        if self.base_quant is not None:
            _choice("base_quant", self.base_quant, BASE_QUANTS)
        if self.base_calib is not None and self.base_quant is None:
            _bad("base_calib", "a calibration rounds the int4 base: set base_quant: int4")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """From YAML / CLI key=value pairs; an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DraftsmithError(f"TrainConfig: unknown field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bad(name: str, why: str) -> None:
    raise DraftsmithError(f"TrainConfig.{name}: {why}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _bad(name, f"{value!r} is not one of {', '.join(allowed)}")


def lr_factor(step: int, warmup_steps: int, steps: int, schedule: str) -> float:
    """Learning-rate multiplier for update `step` (0-based): linear warm-up, then the schedule's decay.

    No update runs at lr 0: warm-up starts at 1/(warmup+1), and the decay reaches 0 only after the last step.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# -- the student ------------------------------------------------------------------------------------------


def lora_target_modules(model: nn.Module) -> list[str]:
    """Names (last component) of every Linear layer of the decoder, the LM head excluded."""
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not head})


def _disable_dropout(model: nn.Module) -> None:
    """Train mode without dropout: the targets are exact distributions, noise only slows the fit."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def quantized_base(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """`model` (in place) with the weights its `cfg.base_quant` draft decodes with on every Linear that draft
    quantises (`decode.runtime.quant.int4_float_weights`, calibrated on `cfg.base_calib`), its LM head untied from
    the input embedding first, in float32; returns it. The int4 draft is rounded from the weights as given: load
    the draft in float32 (as a CPU int4 draft loads) so that they are the served draft's."""
    from draftsmith.decode.runtime.quant import int4_float_weights, read_calib
    from draftsmith.distill.groups import untie_head

    calib = read_calib(cfg.base_calib) if cfg.base_calib else None
    weights = int4_float_weights(model, calib)
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        model.float()  # the int4 weights are exact in float32 (the dtype an int4 draft decodes from)
    untie_head(model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, w in weights.items():
            modules[name].weight.copy_(w)
    return model


def make_student(draft_model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """A trainable copy of the draft (the caller's model is left untouched): full, or wrapped with LoRA; with
    `cfg.base_quant`, the LoRA adapters sit over the served int4 draft's own weights (`quantized_base`), frozen,
    or with `lora_r = 0` the int4 draft's group pairs train (`distill.groups.group_student`)."""
    model = copy.deepcopy(draft_model)
    if cfg.base_quant is not None and cfg.lora_r == 0:  # the int4 draft's own group pairs (`distill.groups`)
        from draftsmith.decode.runtime.quant import read_calib
        from draftsmith.distill.groups import group_student

        model = group_student(model, read_calib(cfg.base_calib) if cfg.base_calib else None)
    elif cfg.base_quant is not None:
        quantized_base(model, cfg)
    if cfg.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                          target_modules=lora_target_modules(model), task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    elif cfg.base_quant is None:  # full fine-tuning (group_student chose what trains)
        model.requires_grad_(True)
    model.train()
    _disable_dropout(model)
    return model


def student_from_checkpoint(draft: Loaded, checkpoint: Path, cfg: TrainConfig) -> nn.Module:
    """The student saved in `checkpoint` (for LoRA: the draft with its adapters, not merged), in eval mode."""
    model = make_student(draft.model, cfg)
    load_student(model, Path(checkpoint) / "student.safetensors")
    return model.eval()


def merged_model(model: nn.Module) -> nn.Module:
    """The plain HF model of a student: LoRA adapters merged into a copy, a full student as it is."""
    if hasattr(model, "merge_and_unload"):  # a peft model
        return copy.deepcopy(model).merge_and_unload()
    from draftsmith.distill.groups import is_group_student, plain_model

    return plain_model(model)[0] if is_group_student(model) else model


def save_best(student: nn.Module, tokenizer, out: Path, info: dict, cfg: TrainConfig) -> None:
    """`out/best/`: the student merged into a plain HF folder (`merged_model`, `save_hf`); with `cfg.base_quant`,
    also `out/best-adapter/`: its adapter unmerged as peft saves it (over the int4 base: `int4:MODEL:lora=FOLDER`),
    with MARKER (`info` and the base's quantisation and calibration), written beside and renamed into place."""
    from draftsmith.distill.groups import is_group_student, plain_model

    if is_group_student(student):  # the int4 draft's trained groups: best/ decodes as `int4:best` with them
        model, groups = plain_model(student)
        save_hf(model, tokenizer, Path(out) / "best", {**info, "base_quant": cfg.base_quant,
                                                       "base_calib": cfg.base_calib}, groups)
        return
    save_hf(merged_model(student), tokenizer, Path(out) / "best", info)
    if cfg.base_quant is None or not hasattr(student, "peft_config"):
        return
    with atomic_dir(Path(out) / ADAPTER_DIR) as tmp:
        student.save_pretrained(tmp, save_embedding_layers=False)  # (never asks the Hub about the base)
        base = {"base_quant": cfg.base_quant, "base_calib": cfg.base_calib}
        (tmp / MARKER).write_text(json.dumps({**info, **base}, indent=2) + "\n", encoding="utf-8")


# -- data ---------------------------------------------------------------------------------------------------


class DataOrder:
    """An endless stream of row indices: one seeded permutation per epoch, back to back."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch, self.index = 0, 0
        self._new_perm()

    def _new_perm(self) -> None:
        self.epoch_rng = self.gen.get_state()  # enough to redraw this epoch's permutation on resume
        self.perm = torch.randperm(self.n, generator=self.gen).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
                self._new_perm()
            out.append(self.perm[self.index])
            self.index += 1
        return out

    def restore(self, epoch: int, index: int, epoch_rng: Tensor) -> None:
        self.gen.set_state(epoch_rng)
        self._new_perm()
        self.epoch, self.index = epoch, index


# -- outside the loop ----------------------------------------------------------------------------------------------------


def _teacher_cache_root(data: datasets.Dataset, out: Path) -> Path:
    """Next to the data when it is a distill.data folder (<data>/dataset/*.arrow beside <data>/settings.json),
    so every training run on that data shares one cache; else inside the run's folder."""
    files = getattr(data, "cache_files", None) or []
    if files:
        folder = Path(files[0]["filename"]).parent.parent
        if (folder / "settings.json").is_file():
            return folder / TEACHER_CACHE_DIR
    return out / TEACHER_CACHE_DIR


class _NoRun:
    """wandb's interface when it is disabled."""

    def log(self, *args, **kwargs) -> None:
        pass

    def finish(self) -> None:
        pass


def _wandb_run(cfg: TrainConfig, out: Path, main: bool):
    if cfg.wandb == "disabled" or not main:
        return _NoRun()
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    return wandb.init(mode=cfg.wandb, project="draftsmith", dir=str(out), config=cfg.to_dict())


# -- training ---------------------------------------------------------------------------------------------------


def train(
    target: Loaded,
    draft: Loaded,
    data: datasets.Dataset,
    eval_refs: datasets.Dataset | None,
    out: Path,
    cfg: TrainConfig,
    *,
    resume: bool = True,
    progress: bool = True,
    teacher_cache_dir: Path | None = None,
) -> dict:
    """Train a copy of `draft` towards `target` on `data` (see the module docstring); returns the summary.

    `teacher_cache_dir` replaces the default place of the teacher cache (with `cfg.teacher == "cache"`)."""
    from accelerate.utils import set_seed

    check_vocab(target, draft)
    rows = training_rows(data)
    onpolicy = onpolicy_rows(data) if cfg.refresh_every else []
    if cfg.refresh_every and not onpolicy:
        raise DraftsmithError("refresh_every: the data has no on-policy rows (source 'draft'); generate it with "
                              "data: draft or mixed")
    out = Path(out)
    accelerator = _accelerator(cfg)
    set_seed(cfg.seed)
    latest = _prepare_folder(out, resume, accelerator)
    teacher = target.model.to(accelerator.device).eval().requires_grad_(False)
    cache = None
    if cfg.teacher == "cache":
        cache = build_teacher_cache(target, rows, teacher_cache_dir or _teacher_cache_root(data, out),
                                    k=cfg.teacher_topk, dtype=cfg.teacher_cache_dtype, batch_size=cfg.batch_size,
                                    rank=accelerator.process_index, processes=accelerator.num_processes,
                                    wait=accelerator.wait_for_everyone,
                                    progress=progress and accelerator.is_main_process)
    run = _start_run(cfg, target, draft, eval_refs, out, accelerator, rows, latest)
    if eval_refs is not None and run.state["step"] == 0 and run.state["alpha_before"] is None:
        run.evaluate_and_keep_best(0)
    first_step = run.state["step"]
    _train_loop(run, teacher, cache, onpolicy, progress)
    if eval_refs is None and run.main and (run.state["step"] > first_step or not (out / "best").is_dir()):
        run.save_best({"step": run.state["step"], "alpha": None, "config": cfg.to_dict()})
    accelerator.wait_for_everyone()  # every rank returns once best/ is in place
    summary = _summary(run, cache)
    if run.main:
        atomic_write_json(out / "summary.json", summary)
    return summary


# -- setting up a run ----------------------------------------------------------------------------------------


def _accelerator(cfg: TrainConfig):
    from accelerate import Accelerator

    try:
        return Accelerator(mixed_precision=cfg.mixed_precision)
    except (ValueError, RuntimeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DraftsmithError(f"TrainConfig.mixed_precision={cfg.mixed_precision!r}: {why}") from None


def _prepare_folder(out: Path, resume: bool, accelerator) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start, which clears what an earlier run left in `out`."""
    latest = list_checkpoints(out)[-1] if resume and list_checkpoints(out) else None
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if latest is None:  # a fresh start: nothing from an earlier run may survive into this one
            for stale in ("checkpoints", "best", ADAPTER_DIR):
                shutil.rmtree(out / stale, ignore_errors=True)
            (out / "log.jsonl").unlink(missing_ok=True)
    accelerator.wait_for_everyone()
    return latest


@dataclass
class _Run:
    """One training run's moving parts and bookkeeping (`state`, saved in every checkpoint)."""

    cfg: TrainConfig
    target: Loaded
    draft: Loaded
    eval_refs: datasets.Dataset | None
    out: Path
    accelerator: Any
    rows: list
    order: DataOrder
    model: nn.Module  # as accelerate prepared it: what the steps train
    student: nn.Module  # the same, unwrapped: what is evaluated and saved
    params: list
    optimizer: Any
    scheduler: Any
    state: dict
    wandb: Any

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def log_path(self) -> Path:
        return self.out / "log.jsonl"

    def log(self, line: dict) -> None:
        if self.main:
            with self.log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
            self.wandb.log(line, step=line["step"])

    def save_best(self, info: dict) -> None:
        save_best(self.student, self.draft.tokenizer, self.out, info, self.cfg)

    def evaluate_and_keep_best(self, step: int) -> None:
        state = self.state
        result = _evaluate(self.target, self.student, self.draft, self.eval_refs, self.cfg.batch_size)
        self.log({"step": step, "eval": True, **result})
        if state["alpha_before"] is None:
            state["alpha_before"] = result["alpha"]
        if state["best_alpha"] is None or result["alpha"] > state["best_alpha"]:
            state["best_alpha"], state["best_step"], state["evals_without_gain"] = result["alpha"], step, 0
            if self.main:
                self.save_best({"step": step, "alpha": result["alpha"], "config": self.cfg.to_dict()})
        else:
            state["evals_without_gain"] += 1

    def checkpoint(self) -> None:
        if self.main:
            trainer_json = {**self.state, "epoch": self.order.epoch, "index": self.order.index, "rows": len(self.rows),
                            "config": self.cfg.to_dict()}
            save_checkpoint(self.out, self.state["step"], self.student, self.optimizer, self.scheduler,
                            self.accelerator.scaler, self.order, trainer_json)
        self.accelerator.wait_for_everyone()


def _start_run(cfg: TrainConfig, target: Loaded, draft: Loaded, eval_refs: datasets.Dataset | None, out: Path,
               accelerator, rows: list, latest: Path | None) -> _Run:
    """The student, optimizer, schedule and data order, fresh or as the checkpoint `latest` left them."""
    student = make_student(draft.model, cfg).to(accelerator.device)
    params = list(trainable(student).values())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps, cfg.schedule)
    )
    order = DataOrder(len(rows), cfg.seed)
    state = {"step": 0, "alpha_before": None, "best_alpha": None, "best_step": None, "evals_without_gain": 0,
             "skipped_steps": 0, "stopped_early": False}
    if latest is not None:
        state = restore_checkpoint(latest, cfg.to_dict(), len(rows), student, optimizer, scheduler,
                                   accelerator.scaler, order, resumable=RESUMABLE_CHANGES,
                                   defaults=TrainConfig().to_dict())
        if accelerator.is_main_process and (latest / "log.jsonl").is_file():
            shutil.copyfile(latest / "log.jsonl", out / "log.jsonl")  # drop lines written after the checkpoint
        for i, cont in (state.get("refresh") or {}).get("rows", {}).items():  # the resampled rows it trained on
            rows[int(i)] = (rows[int(i)][0], cont)
    model, optimizer = accelerator.prepare(student, optimizer)
    return _Run(cfg, target, draft, eval_refs, out, accelerator, rows, order, model, accelerator.unwrap_model(model),
                params, optimizer, scheduler, state, _wandb_run(cfg, out, accelerator.is_main_process))


def _summary(run: _Run, cache: TeacherTopK | None) -> dict:
    state, out = run.state, run.out
    latest = list_checkpoints(out)[-1] if list_checkpoints(out) else None
    summary = {
        "alpha_before": state["alpha_before"],
        "alpha_after": state["best_alpha"],
        "best_step": state["best_step"] if run.eval_refs is not None else state["step"],
        "steps_done": state["step"],
        "stopped_early": state["stopped_early"],
        "skipped_steps": state["skipped_steps"],
        "loss": run.cfg.loss,
        "config": run.cfg.to_dict(),
        "paths": {"out": str(out), "best": str(out / "best"), "log": str(run.log_path),
                  "checkpoint": str(latest) if latest else None},
    }
    if run.cfg.base_quant is not None:
        summary["paths"]["best_adapter"] = str(out / ADAPTER_DIR)
    if cache is not None:
        summary["paths"]["teacher_cache"] = str(cache.folder)
    return summary


# -- the steps --------------------------------------------------------------------------------------------------


def _evaluate(target: Loaded, student: nn.Module, draft: Loaded, refs: datasets.Dataset, batch_size: int) -> dict:
    """Greedy teacher-forced alpha of the current student on the reference rows."""
    student.eval()
    try:
        a = measure_acceptance(target, [Loaded(student, draft.tokenizer, draft.path, draft.name)], refs,
                               params=SamplingParams(0.0), batch_size=batch_size, progress=False)[0]
    finally:
        student.train()
    return {"alpha": a.alpha, "alpha_by_domain": a.alpha_by_domain, "positions": a.positions}


def onpolicy_rows(data: datasets.Dataset) -> list[int]:
    """Indices (into `training_rows(data)`) of the rows the draft wrote (source 'draft')."""
    if "source" not in data.column_names:
        return []
    kept = [s for p, c, s in zip(data["prompt_ids"], data["continuation_ids"], data["source"]) if p and c]
    return [i for i, s in enumerate(kept) if s == "draft"]


@torch.no_grad()
def refresh_onpolicy(student: nn.Module, rows: list, onpolicy: list[int], round_: int, seed: int, draft: Loaded,
                     target: Loaded, device) -> dict:
    """Resample the on-policy rows from the current student (temperature 1, at most as long as the longest of
    them was; row i seeded from (seed, round, i)), in place; returns {round, rows} for the checkpoint, so that a
    resumed run trains on the same rows."""
    from draftsmith.decode.batch import generate_batch
    from draftsmith.decode.runtime.loading import eos_ids
    from draftsmith.distill.data import target_vocab
    from draftsmith.pairing.reference import prompt_seed

    max_new = max(len(rows[i][1]) for i in onpolicy)
    was_training = student.training
    student.eval()
    new: dict[str, list[int]] = {}
    try:
        for a in range(0, len(onpolicy), 16):
            chunk = onpolicy[a : a + 16]
            gens = [torch.Generator(device=device).manual_seed(prompt_seed(seed + 1_000_003 * round_, i)) for i in chunk]
            outs = generate_batch(student, [rows[i][0] for i in chunk], max_new_tokens=max_new,
                                  sampling=SamplingParams(1.0), eos_ids=eos_ids(draft), generators=gens,
                                  vocab_size=target_vocab(target), lean=False)
            for i, cont in zip(chunk, outs):
                if cont:  # a row that ended at once keeps its old text (a row needs a continuation token)
                    rows[i] = (rows[i][0], list(cont))
                new[str(i)] = rows[i][1]
    finally:
        student.train(was_training)
    return {"round": round_, "rows": new}


def _train_loop(run: _Run, teacher, cache: TeacherTopK | None, onpolicy: list[int], progress: bool) -> None:
    """Optimizer steps until `cfg.steps`, an early stop or too many bad steps."""
    cfg, state = run.cfg, run.state
    finished = state["step"] >= cfg.steps or state["stopped_early"]
    bar = tqdm(total=cfg.steps, initial=state["step"], desc=f"distill ({cfg.loss})", unit="step",
               disable=not (progress and run.main))
    try:
        while not finished:
            loss = _optimizer_step(run, teacher, cache)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            finished = _after_step(run, onpolicy)
    finally:
        bar.close()
        run.wandb.finish()


def _optimizer_step(run: _Run, teacher, cache: TeacherTopK | None) -> float:
    """One optimizer step, logged; a step whose loss or gradient is not finite is skipped and counted. Returns
    the loss."""
    cfg, acc, state = run.cfg, run.accelerator, run.state
    loss, grad_norm, tokens = _step(cfg, run.rows, run.order, run.model, teacher, cache, acc, run.params, acc.device,
                                    acc.num_processes, acc.process_index)
    bad = not (math.isfinite(loss) and math.isfinite(grad_norm))
    lr = run.scheduler.get_last_lr()[0]
    if bad and acc.scaler is None:
        state["skipped_steps"] += 1
    else:
        run.optimizer.step()  # under fp16 the grad scaler itself skips a step with inf/NaN gradients
        state["skipped_steps"] += int(bad)
    run.optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped step still advances the schedule (lr = f(step)),
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")  # so say nothing
        run.scheduler.step()
    state["step"] += 1
    run.log({"step": state["step"], "loss": loss, cfg.loss: loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
             "skipped": bad})
    return loss


def _after_step(run: _Run, onpolicy: list[int]) -> bool:
    """What follows a step: stop on too many bad steps, evaluate (and maybe stop early), resample the on-policy
    rows, checkpoint. Returns whether the run is finished."""
    cfg, state = run.cfg, run.state
    step = state["step"]
    if state["skipped_steps"] >= cfg.max_bad_steps:
        run.checkpoint()
        raise DraftsmithError(
            f"training stopped at step {step}: {state['skipped_steps']} steps had a non-finite loss or "
            f"gradient (max_bad_steps={cfg.max_bad_steps}); lower lr or use mixed_precision='no'"
        )
    last = step >= cfg.steps
    if run.eval_refs is not None and (step % cfg.eval_every == 0 or last):
        run.evaluate_and_keep_best(step)
        if cfg.early_stop_patience and state["evals_without_gain"] >= cfg.early_stop_patience:
            state["stopped_early"] = True
    finished = last or state["stopped_early"]
    if cfg.refresh_every and step % cfg.refresh_every == 0 and not finished:
        state["refresh"] = refresh_onpolicy(run.student, run.rows, onpolicy, step // cfg.refresh_every, cfg.seed,
                                            run.draft, run.target, run.accelerator.device)
        run.log({"step": step, "refresh": state["refresh"]["round"], "rows": len(onpolicy),
                 "new_tokens": sum(len(c) for c in state["refresh"]["rows"].values())})
    if step % cfg.save_every == 0 or finished:
        run.checkpoint()
    return finished


def first_scored(mask: Tensor) -> int:
    """The first position (column) of a collated batch's loss mask that any row scores (0 for an empty mask)."""
    cols = mask.any(0).nonzero()
    return int(cols[0]) if len(cols) else 0


def _step(cfg: TrainConfig, rows, order: DataOrder, model, teacher, cache: TeacherTopK | None, accelerator, params,
          device, nproc: int, rank: int) -> tuple[float, float, int]:
    """Forward/backward over one optimizer step's micro-batches; returns (loss, grad norm, global tokens)."""
    micro = [order.take(cfg.batch_size * nproc)[rank * cfg.batch_size : (rank + 1) * cfg.batch_size]
             for _ in range(cfg.grad_accum)]
    # the normaliser comes first: every micro-batch's total is divided by the whole step's token count
    tokens = torch.tensor(float(sum(len(rows[i][1]) for mb in micro for i in mb)), device=device)
    if nproc > 1:
        tokens = accelerator.reduce(tokens, reduction="sum")
    kw = {"temperature": cfg.temperature}
    if cfg.loss == "jsd":
        kw["beta"] = cfg.jsd_beta
    total = torch.zeros((), dtype=torch.float64, device=device)
    for j, mb in enumerate(micro):
        ids, attn, mask = collate(rows, mb, device)
        # logits only from the batch's first scored position on: the LM head over prompt positions no loss reads
        # was up to half a small draft's step (a 151,936-row head)
        lo = first_scored(mask)
        keep, mask = ids.shape[1] - lo, mask[:, lo:]
        sync = contextlib.nullcontext() if j == len(micro) - 1 else accelerator.no_sync(model)
        with sync:
            if cache is not None:
                t_logits = cache.logits(mb, mask)
            else:
                with torch.no_grad():  # as log-probs at T = 1, as the cache stores them: both paths round alike
                    t_logits = teacher(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=keep).logits
                    t_logits = torch.log_softmax(t_logits.float(), dim=-1)
            with accelerator.autocast():
                s_logits = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=keep).logits
            s_logits, t_logits = align_vocab(s_logits, t_logits)
            part, _ = divergence_sum(cfg.loss, s_logits, t_logits, mask, **kw)
            # DDP averages gradients over processes: scale back up so the result is sum / global count
            accelerator.backward(token_mean(part, tokens) * nproc)
            total += part.detach().to(torch.float64)
    if nproc > 1:
        total = accelerator.reduce(total, reduction="sum")
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    grad_norm = accelerator.clip_grad_norm_(params, max_norm)
    return float(token_mean(total, tokens)), float(grad_norm), int(tokens.item())


__all__ = ["ADAPTER_DIR", "BASE_QUANTS", "MARKER", "DataOrder", "TrainConfig", "lora_target_modules", "lr_factor",
           "make_student", "merged_model", "onpolicy_rows", "quantized_base", "refresh_onpolicy", "save_best",
           "student_from_checkpoint", "train"]
