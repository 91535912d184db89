"""Distil the target into the draft: a plain loop over `accelerate`, divergence on continuation tokens only.

    from distill.train import TrainConfig, train
    summary = train(load(target), load(draft), generate_data(...), reference_continuations(target, held_out),
                    Path("runs/x/distill"), TrainConfig(loss="fkl", lr=1e-4, steps=200, lora_r=16))

One optimizer step = `grad_accum` micro-batches of `batch_size` rows (prompt + continuation, right-padded).
The target scores every row online under no_grad (frozen, eval mode); the loss is the chosen divergence
(`distill.divergences`, named by direction: fkl = KL(p || q), rkl = KL(q || p), jsd, tvd = 1 - beta_t)
summed over the continuation positions of all micro-batches, divided by their GLOBAL token count, which is
counted before the first forward: accumulation equals one big batch exactly. AdamW, linear warm-up then
cosine / linear / constant, gradient-norm clipping, and a NaN/inf guard (the step is skipped and counted;
`max_bad_steps` of them stop the run). The student is a copy of the draft (train mode, dropout off), either
fully fine-tuned or, with `lora_r > 0`, through LoRA adapters on every Linear layer of the decoder.

Folder `out`:
- `log.jsonl`: one line per step {step, loss, <divergence name>, lr, grad_norm, tokens, skipped} and one per
  eval {step, alpha, alpha_by_domain, positions}. `loss` is the true divergence (nats per token).
- `checkpoints/step-N/` (only the latest is kept, written beside and renamed into place): `student.safetensors`
  (the trained parameters: all of them, or the LoRA adapters), `state.pt` (optimizer, scheduler, RNG states;
  read back with `torch.load(weights_only=True)`), `trainer.json` (step, data position, best alpha, config),
  `log.jsonl`. `resume=True` continues from the latest one and ends bit-for-bit where an uninterrupted run
  would (on CPU).
- `best/`: a Hugging Face folder of the student with the best alpha so far (LoRA merged), with the tokenizer.
  alpha is measured teacher-forced and greedy on `eval_refs` (held-out reference continuations) every
  `eval_every` steps and at step 0 (the untouched draft, which is also the first `best`). Without
  `eval_refs`, `best/` is the final student.
- `summary.json`: what `train` returns.

Data order: a torch.Generator seeded from `seed` draws one permutation per epoch; batches run through the
permutations back to back (a batch may straddle two epochs), and (epoch, index, generator state at the
epoch's start) is in every checkpoint.

Several processes: launch the same script with `accelerate launch`. Every micro-batch then draws
batch_size x processes rows and each process takes its share; the token count is summed over processes
and the loss scaled so that DDP's gradient average is still sum / global count. Only rank 0 writes files;
every rank evaluates (so all agree on early stopping).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from decode.errors import DraftsmithError
from decode.loading import Loaded
from decode.sampling import SamplingParams
from decode.textgen import check_vocab
from distill.divergences import DIVERGENCES, align_vocab, divergence_sum, token_mean
from pairing.acceptance import measure_acceptance

SCHEDULES = ("cosine", "linear", "constant")
MIXED_PRECISION = ("no", "fp16", "bf16")
WANDB_MODES = ("disabled", "offline", "online")
# fields a resumed run may change: they decide how long and how often, not what a step computes
RESUMABLE_CHANGES = {"steps", "eval_every", "early_stop_patience", "save_every", "max_bad_steps", "wandb"}
MARKER = "draftsmith_distill.json"


# -- configuration ------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Every training setting, typed and validated on construction (errors name the field)."""

    loss: str = "fkl"  # fkl | rkl | jsd | tvd (distill.divergences)
    jsd_beta: float = 0.5
    temperature: float = 1.0  # both distributions are softmax(logits / temperature)
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | linear | constant (after the warm-up)
    steps: int = 100  # optimizer steps
    batch_size: int = 4  # rows per micro-batch (per process)
    grad_accum: int = 1  # micro-batches per optimizer step
    max_grad_norm: float = 1.0  # 0 = no clipping
    lora_r: int = 0  # 0 = full fine-tuning; > 0 = LoRA rank (merged into best/)
    lora_alpha: int = 16
    eval_every: int = 25
    early_stop_patience: int = 0  # 0 = off; else stop after this many evals without an alpha gain
    save_every: int = 25
    max_bad_steps: int = 10  # steps with a non-finite loss or gradient before the run stops
    seed: int = 0
    mixed_precision: str = "no"  # no | fp16 | bf16 (accelerate)
    wandb: str = "disabled"  # disabled | offline | online

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                setattr(self, f.name, value)
            if not isinstance(value, kind) or isinstance(value, bool):
                _bad(f.name, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        _choice("loss", self.loss, tuple(DIVERGENCES))
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        _choice("wandb", self.wandb, WANDB_MODES)
        if not 0.0 < self.jsd_beta < 1.0:
            _bad("jsd_beta", f"must be in (0, 1), got {self.jsd_beta}")
        checks = {
            "temperature": self.temperature > 0, "lr": self.lr > 0, "weight_decay": self.weight_decay >= 0,
            "warmup_steps": self.warmup_steps >= 0, "steps": self.steps >= 1, "batch_size": self.batch_size >= 1,
            "grad_accum": self.grad_accum >= 1, "max_grad_norm": self.max_grad_norm >= 0,
            "lora_r": self.lora_r >= 0, "lora_alpha": self.lora_alpha >= 1, "eval_every": self.eval_every >= 1,
            "early_stop_patience": self.early_stop_patience >= 0, "save_every": self.save_every >= 1,
            "max_bad_steps": self.max_bad_steps >= 1, "seed": self.seed >= 0,
        }
        for name, ok in checks.items():
            if not (ok and math.isfinite(getattr(self, name))):
                _bad(name, f"out of range: {getattr(self, name)!r}")

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


def make_student(draft_model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """A trainable copy of the draft (the caller's model is left untouched): full, or wrapped with LoRA."""
    model = copy.deepcopy(draft_model)
    if cfg.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                          target_modules=lora_target_modules(model), task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    else:
        model.requires_grad_(True)
    model.train()
    _disable_dropout(model)
    return model


def _trainable(model: nn.Module) -> dict[str, Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def student_from_checkpoint(draft: Loaded, checkpoint: Path, cfg: TrainConfig) -> nn.Module:
    """The student saved in `checkpoint` (for LoRA: the draft with its adapters, not merged), in eval mode."""
    model = make_student(draft.model, cfg)
    _load_student(model, Path(checkpoint) / "student.safetensors")
    return model.eval()


def _load_student(model: nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(path))
    params = _trainable(model)
    if set(saved) != set(params):
        raise DraftsmithError(f"{path} does not match this draft and config (different parameters)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def merged_model(model: nn.Module) -> nn.Module:
    """The plain HF model of a student: LoRA adapters merged into a copy, a full student as it is."""
    if hasattr(model, "merge_and_unload"):  # a peft model
        return copy.deepcopy(model).merge_and_unload()
    return model


# -- data ---------------------------------------------------------------------------------------------------


def _rows(data: datasets.Dataset) -> list[tuple[list[int], list[int]]]:
    missing = {"prompt_ids", "continuation_ids"} - set(data.column_names)
    if missing:
        raise DraftsmithError(f"training data lacks column(s) {', '.join(sorted(missing))}")
    rows = [(list(p), list(c)) for p, c in zip(data["prompt_ids"], data["continuation_ids"]) if p and c]
    if not rows:
        raise DraftsmithError("the training data has no row with both prompt and continuation tokens")
    return rows


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


def _collate(rows: list[tuple[list[int], list[int]]], idx: list[int], device: torch.device):
    """Right-padded (input_ids, attention_mask, loss mask): the mask marks positions predicting continuation tokens."""
    seqs = [rows[i][0] + rows[i][1] for i in idx]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    attn = torch.zeros(len(idx), T, dtype=torch.long)
    mask = torch.zeros(len(idx), T, dtype=torch.bool)
    for b, i in enumerate(idx):
        P, C = len(rows[i][0]), len(rows[i][1])
        ids[b, : P + C] = torch.tensor(seqs[b])
        attn[b, : P + C] = 1
        mask[b, P - 1 : P + C - 1] = True  # logits at position t predict token t + 1
    return ids.to(device), attn.to(device), mask.to(device)


# -- files ----------------------------------------------------------------------------------------------------


def _replace_dir(tmp: Path, final: Path) -> None:
    """Put the finished folder `tmp` at `final`, replacing what was there (old one removed after the swap)."""
    for path in (tmp, *tmp.rglob("*")):  # mkdtemp (and safetensors) make owner-only files; runs are shared
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _checkpoints(out: Path) -> list[Path]:
    root = out / "checkpoints"
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit() and (p / "trainer.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _save_checkpoint(out: Path, step: int, model: nn.Module, optimizer, scheduler, scaler, order: DataOrder,
                     trainer: dict) -> Path:
    """Write checkpoints/step-N atomically, then drop the older ones."""
    from safetensors.torch import save_file

    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step}.", suffix=".tmp", dir=root))
    weights = {k: v.detach().contiguous().cpu() for k, v in _trainable(model).items()}
    save_file(weights, str(tmp / "student.safetensors"))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "data": order.epoch_rng}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    blob = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng}
    if scaler is not None:  # fp16's loss scale
        blob["scaler"] = scaler.state_dict()
    torch.save(blob, tmp / "state.pt")
    log = out / "log.jsonl"
    if log.is_file():
        shutil.copyfile(log, tmp / "log.jsonl")
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=2) + "\n", encoding="utf-8")
    final = root / f"step-{step}"
    _replace_dir(tmp, final)
    for old in _checkpoints(out):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def _no_hf_bars():
    """transformers' "Writing model shards" bar is noise inside a training bar."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _save_hf(model: nn.Module, tokenizer: Any, dest: Path, info: dict) -> None:
    """A Hugging Face folder of the student (LoRA merged) plus tokenizer, replacing `dest` atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        with _no_hf_bars():
            merged_model(model).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        _replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


# -- the loop -------------------------------------------------------------------------------------------------


def _evaluate(target: Loaded, student: nn.Module, draft: Loaded, refs: datasets.Dataset, batch_size: int) -> dict:
    """Greedy teacher-forced alpha of the current student on the reference rows."""
    student.eval()
    try:
        a = measure_acceptance(target, [Loaded(student, draft.tokenizer, draft.path, draft.name)], refs,
                               params=SamplingParams(0.0), batch_size=batch_size, progress=False)[0]
    finally:
        student.train()
    return {"alpha": a.alpha, "alpha_by_domain": a.alpha_by_domain, "positions": a.positions}


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
) -> dict:
    """Train a copy of `draft` towards `target` on `data` (see the module docstring); returns the summary."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    check_vocab(target, draft)
    rows = _rows(data)
    out = Path(out)
    try:
        accelerator = Accelerator(mixed_precision=cfg.mixed_precision)
    except (ValueError, RuntimeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DraftsmithError(f"TrainConfig.mixed_precision={cfg.mixed_precision!r}: {why}") from None
    main = accelerator.is_main_process
    nproc, rank = accelerator.num_processes, accelerator.process_index
    device = accelerator.device
    set_seed(cfg.seed)

    latest = _checkpoints(out)[-1] if resume and _checkpoints(out) else None
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if latest is None:  # a fresh start: nothing from an earlier run may survive into this one
            for stale in ("checkpoints", "best"):
                shutil.rmtree(out / stale, ignore_errors=True)
            (out / "log.jsonl").unlink(missing_ok=True)
    accelerator.wait_for_everyone()

    teacher = target.model.to(device).eval().requires_grad_(False)
    student = make_student(draft.model, cfg).to(device)
    params = list(_trainable(student).values())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps, cfg.schedule)
    )
    order = DataOrder(len(rows), cfg.seed)
    state = {"step": 0, "alpha_before": None, "best_alpha": None, "best_step": None, "evals_without_gain": 0,
             "skipped_steps": 0, "stopped_early": False}
    if latest is not None:
        state = _restore(latest, cfg, len(rows), student, optimizer, scheduler, accelerator.scaler, order)
        if main and (latest / "log.jsonl").is_file():  # drop lines the interrupted run wrote after the checkpoint
            shutil.copyfile(latest / "log.jsonl", out / "log.jsonl")
    model, optimizer = accelerator.prepare(student, optimizer)
    student = accelerator.unwrap_model(model)
    run = _wandb_run(cfg, out, main)
    log_path = out / "log.jsonl"

    def log(line: dict) -> None:
        if main:
            with log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
            run.log(line, step=line["step"])

    def evaluate_and_keep_best(step: int) -> None:
        result = _evaluate(target, student, draft, eval_refs, cfg.batch_size)
        log({"step": step, "eval": True, **result})
        if state["alpha_before"] is None:
            state["alpha_before"] = result["alpha"]
        if state["best_alpha"] is None or result["alpha"] > state["best_alpha"]:
            state["best_alpha"], state["best_step"], state["evals_without_gain"] = result["alpha"], step, 0
            if main:
                info = {"step": step, "alpha": result["alpha"], "config": cfg.to_dict()}
                _save_hf(student, draft.tokenizer, out / "best", info)
        else:
            state["evals_without_gain"] += 1

    def trainer_json() -> dict:
        return {**state, "epoch": order.epoch, "index": order.index, "rows": len(rows), "config": cfg.to_dict()}

    def checkpoint() -> None:
        if main:
            _save_checkpoint(out, state["step"], student, optimizer, scheduler, accelerator.scaler, order,
                             trainer_json())
        accelerator.wait_for_everyone()

    if eval_refs is not None and state["step"] == 0 and state["alpha_before"] is None:
        evaluate_and_keep_best(0)

    finished = state["step"] >= cfg.steps or state["stopped_early"]
    first_step = state["step"]
    bar = tqdm(total=cfg.steps, initial=state["step"], desc=f"distill ({cfg.loss})", unit="step",
               disable=not (progress and main))
    try:
        while not finished:
            loss, grad_norm, tokens = _step(cfg, rows, order, model, teacher, optimizer, accelerator, params, device,
                                            nproc, rank)
            bad = not (math.isfinite(loss) and math.isfinite(grad_norm))
            lr = scheduler.get_last_lr()[0]
            if bad and accelerator.scaler is None:
                state["skipped_steps"] += 1
            else:
                optimizer.step()  # under fp16 the grad scaler itself skips a step with inf/NaN gradients
                state["skipped_steps"] += int(bad)
            optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped step still advances the schedule (lr = f(step)),
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")  # so say nothing
                scheduler.step()
            state["step"] += 1
            step = state["step"]
            log({"step": step, "loss": loss, cfg.loss: loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                 "skipped": bad})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if state["skipped_steps"] >= cfg.max_bad_steps:
                checkpoint()
                raise DraftsmithError(
                    f"training stopped at step {step}: {state['skipped_steps']} steps had a non-finite loss or "
                    f"gradient (max_bad_steps={cfg.max_bad_steps}); lower lr or use mixed_precision='no'"
                )
            last = step >= cfg.steps
            if eval_refs is not None and (step % cfg.eval_every == 0 or last):
                evaluate_and_keep_best(step)
                if cfg.early_stop_patience and state["evals_without_gain"] >= cfg.early_stop_patience:
                    state["stopped_early"] = True
            finished = last or state["stopped_early"]
            if step % cfg.save_every == 0 or finished:
                checkpoint()
    finally:
        bar.close()
        run.finish()

    if eval_refs is None and main and (state["step"] > first_step or not (out / "best").is_dir()):
        info = {"step": state["step"], "alpha": None, "config": cfg.to_dict()}
        _save_hf(student, draft.tokenizer, out / "best", info)
    latest = _checkpoints(out)[-1] if _checkpoints(out) else None
    summary = {
        "alpha_before": state["alpha_before"],
        "alpha_after": state["best_alpha"],
        "best_step": state["best_step"] if eval_refs is not None else state["step"],
        "steps_done": state["step"],
        "stopped_early": state["stopped_early"],
        "skipped_steps": state["skipped_steps"],
        "loss": cfg.loss,
        "config": cfg.to_dict(),
        "paths": {"out": str(out), "best": str(out / "best"), "log": str(log_path),
                  "checkpoint": str(latest) if latest else None},
    }
    if main:
        _write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _step(cfg: TrainConfig, rows, order: DataOrder, model, teacher, optimizer, accelerator, params, device,
          nproc: int, rank: int) -> tuple[float, float, int]:
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
        ids, attn, mask = _collate(rows, mb, device)
        sync = contextlib.nullcontext() if j == len(micro) - 1 else accelerator.no_sync(model)
        with sync:
            with torch.no_grad():
                t_logits = teacher(input_ids=ids, attention_mask=attn, use_cache=False).logits
            with accelerator.autocast():
                s_logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
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


def _restore(checkpoint: Path, cfg: TrainConfig, n_rows: int, student: nn.Module, optimizer, scheduler, scaler,
             order: DataOrder) -> dict:
    """Load a checkpoint into the freshly built student, optimizer, scheduler, RNGs and data order."""
    trainer = json.loads((checkpoint / "trainer.json").read_text(encoding="utf-8"))
    saved = trainer.get("config", {})
    changed = sorted(k for k, v in cfg.to_dict().items() if saved.get(k) != v and k not in RESUMABLE_CHANGES)
    if changed:
        raise DraftsmithError(
            f"{checkpoint} was trained with other settings ({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}); "
            "use the same config, or start afresh (resume=False)"
        )
    if trainer.get("rows") != n_rows:
        raise DraftsmithError(f"{checkpoint} was trained on {trainer.get('rows')} rows, this data has {n_rows}")
    _load_student(student, checkpoint / "student.safetensors")
    blob = torch.load(checkpoint / "state.pt", weights_only=True)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    if scaler is not None and "scaler" in blob:
        scaler.load_state_dict(blob["scaler"])
    rng = blob["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(_as_tuple(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    order.restore(trainer["epoch"], trainer["index"], rng["data"])
    keys = ("step", "alpha_before", "best_alpha", "best_step", "evals_without_gain", "skipped_steps", "stopped_early")
    return {k: trainer[k] for k in keys}


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


__all__ = ["DataOrder", "TrainConfig", "lora_target_modules", "lr_factor", "make_student", "merged_model",
           "student_from_checkpoint", "train"]
