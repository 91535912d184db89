"""Training state on disk: checkpoints written beside and renamed into place, listed, and read back bit-for-bit.

    from draftsmith.distill.checkpoint import list_checkpoints, save_checkpoint, restore_checkpoint

`checkpoints/step-N/` (only the latest is kept): `student.safetensors` (the trainable parameters: all of them,
or the LoRA adapters), `state.pt` (optimizer, scheduler, grad scaler, RNG states; read back with
`torch.load(weights_only=True)`), `trainer.json` (step, data position, best alpha, config), `log.jsonl`
(the log up to this step). A folder under its final name is always complete: it is built under a temporary
name in the same directory and swapped in by `os.replace` (`decode.runtime.io.atomic_dir`). `save_hf` writes a Hugging Face
folder the same way.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_dir, read_json

MARKER = "draftsmith_distill.json"  # in every best/ folder: which step and alpha it holds, and the config


def trainable(model: nn.Module) -> dict[str, Tensor]:
    """The parameters a checkpoint holds: those that train (all of a full student, a LoRA student's adapters)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def list_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints under `out/checkpoints`, oldest first."""
    root = Path(out) / "checkpoints"
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit() and (p / "trainer.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(out: Path, step: int, model: nn.Module, optimizer, scheduler, scaler, order,
                    trainer: dict) -> Path:
    """Write checkpoints/step-N atomically, then drop the older ones. `order` is the run's DataOrder."""
    from safetensors.torch import save_file

    final = out / "checkpoints" / f"step-{step}"
    with atomic_dir(final) as tmp:
        weights = {k: v.detach().contiguous().cpu() for k, v in trainable(model).items()}
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
    for old in list_checkpoints(out):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_student(model: nn.Module, path: Path) -> None:
    """Copy the weights saved in `path` (a student.safetensors) into the trainable parameters of `model`."""
    from safetensors.torch import load_file

    saved = load_file(str(path))
    params = trainable(model)
    if set(saved) != set(params):
        raise DraftsmithError(f"{path} does not match this draft and config (different parameters)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def restore_checkpoint(checkpoint: Path, config: dict[str, Any], n_rows: int, student: nn.Module, optimizer,
                       scheduler, scaler, order, *, resumable: set[str], defaults: dict[str, Any]) -> dict:
    """Load a checkpoint into the freshly built student, optimizer, scheduler, RNGs and data order.

    The saved config must equal `config` but for the `resumable` fields; a field the checkpoint predates
    counts as its default (`defaults`), so adding a setting does not orphan older checkpoints.
    Returns the trainer state (step, alphas, counters)."""
    trainer = read_json(checkpoint / "trainer.json", what="checkpoint state")
    saved = {**defaults, **trainer.get("config", {})}
    changed = sorted(k for k, v in config.items() if saved.get(k) != v and k not in resumable)
    if changed:
        raise DraftsmithError(
            f"{checkpoint} was trained with other settings ({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}); "
            "use the same config, or start afresh (resume=False)"
        )
    if trainer.get("rows") != n_rows:
        raise DraftsmithError(f"{checkpoint} was trained on {trainer.get('rows')} rows, this data has {n_rows}")
    load_student(student, checkpoint / "student.safetensors")
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
    return {**{k: trainer[k] for k in keys}, **({"refresh": trainer["refresh"]} if "refresh" in trainer else {})}


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


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


def save_hf(model: nn.Module, tokenizer: Any, dest: Path, info: dict, groups: dict | None = None) -> None:
    """A Hugging Face folder of `model` (a plain HF model: merge LoRA first) plus tokenizer and MARKER, and with
    `groups` the int4 groups its weights are (`decode.runtime.quant.save_int4_groups`), replacing `dest`
    atomically."""
    with atomic_dir(dest) as tmp:
        with _no_hf_bars():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if groups:
            from draftsmith.decode.runtime.quant import save_int4_groups

            save_int4_groups(tmp, groups)
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


__all__ = ["MARKER", "list_checkpoints", "load_student", "restore_checkpoint", "save_checkpoint", "save_hf",
           "trainable"]
