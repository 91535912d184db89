"""Which form of a draft trained over its int4 base to serve: the adapter unmerged, or merged and re-quantised.

    specs = served_specs("qwen2.5-coder-0.5b-instruct", Path("runs/x/distill"))
    # {"unmerged": "int4:qwen2.5-coder-0.5b-instruct:lora=runs/x/distill/best-adapter",
    #  "merged": "int4:runs/x/distill/best"}
    result = compare_served(target, specs, refs)   # result["pick"]: the form to serve
    report = requant_survival(student)            # how much of the adapter's change re-quantisation keeps

A run with `distill.train.TrainConfig.base_quant` ("int4") trains float LoRA adapters over the very int4 weights
its draft decodes with and leaves both forms: `best-adapter/` (served unmerged: the int4 kernel plus B A in
float, `decode.runtime.lora`) and `best/` (merged into float weights; `int4:best` rounds them to int4 again,
which can lose the part of B A smaller than an int4 step). `compare_served` measures, for each form, the
teacher-forced greedy agreement with the target on reference rows (`pairing.validate.greedy_agreement`
through the runner the form decodes with) and the time of one draft step; `pick_served` keeps the faster form
unless the other agrees more often by more than AGREEMENT_TIE. Either form is exact: the target verifies.
"""

from __future__ import annotations

import copy
from pathlib import Path

import datasets
import torch
from torch import nn

from draftsmith.decode.pruned import PrunedRunner
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.kernels import best_time
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.decode.runtime.quant import Calibration, int4_float_weights
from draftsmith.decode.spec import DraftSpec
from draftsmith.distill.train import ADAPTER_DIR, TrainConfig, merged_model, quantized_base
from draftsmith.pairing.drafts import Draft, standalone_runner
from draftsmith.pairing.validate import greedy_agreement

AGREEMENT_TIE = 0.005  # agreements this close are equal: the faster form serves


def served_specs(base: str, out: str | Path, calib: str | Path | None = None, adapter: bool = True) -> dict[str, str]:
    """The draft specs a `base_quant` run in `out` serves in: its adapter over `base` (the draft spec it trained,
    calibrated on `calib` as it trained) unmerged, and its merged best/ re-quantised (on the same calibration);
    without an `adapter` (the int4 draft's group pairs trained: `distill.groups`), best/ alone, as `int4:best`
    (its folder carries the trained groups, which serve as they are)."""
    out = Path(out)
    if not adapter:
        return {"groups": DraftSpec.int4(str(out / "best")).text}
    return {"unmerged": DraftSpec.int4(base, calib, out / ADAPTER_DIR).text,
            "merged": DraftSpec.int4(str(out / "best"), calib).text}


def pick_served(forms: dict[str, dict]) -> str:
    """The form to serve, by its `agreement` and `step_ms`: of the forms whose agreement is within AGREEMENT_TIE
    of the highest, the fastest (the first given where they tie)."""
    if not forms:
        raise DraftsmithError("pick_served: no forms to choose from")
    top = max(f["agreement"] for f in forms.values())
    near = [name for name, f in forms.items() if f["agreement"] >= top - AGREEMENT_TIE - 1e-12]
    return min(near, key=lambda name: forms[name]["step_ms"])


def step_ms(runner, prompt: list[int], reps: int = 5) -> float:
    """The best of `reps` one-token draft steps (ms) of `runner` after a prefill of `prompt`: each step the same
    token at the same position (its cache slot written again)."""
    runner.forward(torch.tensor(prompt, dtype=torch.long), 0)
    token, pos = torch.tensor(prompt[-1:], dtype=torch.long), len(prompt)
    return 1000.0 * best_time(lambda: runner.forward(token, pos), reps)


def measure_served(target: Loaded, draft: Draft, runner, refs: datasets.Dataset, *, reps: int = 5,
                   batch_size: int = 4) -> dict:
    """A form's teacher-forced greedy agreement with the target on `refs` (through `runner`, unpruned: a pruned
    draft's kept ids restrict it as it decodes) and its draft step's time (`step_ms`, pruned as it decodes, on the
    first reference prompt). -> {agreement, positions, step_ms}. The runner of a pruned draft is cut in place."""
    kept = draft.kept
    acc = greedy_agreement(target, draft, runner, refs, batch_size=batch_size)
    timed = runner if kept is None else PrunedRunner(runner, kept.ids, context=kept.context)
    prompt = [int(t) for t in refs[0]["prompt_ids"]]
    return {"agreement": acc.alpha, "positions": acc.positions, "step_ms": step_ms(timed, prompt, reps)}


def compare_served(target: Loaded, specs: dict[str, str], refs: datasets.Dataset, *, quant: str | None = None,
                   max_len: int | None = None, reps: int = 5, device: str = "cpu") -> dict:
    """Each named draft spec (`served_specs`) opened as the decoder runs it (`pairing.drafts`), measured
    (`measure_served`) one after the other, and the one to serve (`pick_served`). -> {"forms": {name: {spec,
    quant, agreement, positions, step_ms}}, "pick": name, "tie": AGREEMENT_TIE}."""
    if not specs:
        raise DraftsmithError("compare_served: no draft specs to compare")
    longest = max(len(p) + len(c) for p, c in zip(refs["prompt_ids"], refs["continuation_ids"]))
    max_len = max_len or longest + 2
    forms: dict[str, dict] = {}
    for name, spec in specs.items():
        d, q, runner = standalone_runner(spec, target, max_len, quant, device, what="compare_served")
        forms[name] = {"spec": spec, "quant": q, **measure_served(target, d, runner, refs, reps=reps)}
        del d, runner
    return {"forms": forms, "pick": pick_served(forms), "tie": AGREEMENT_TIE}


def adapter_student(draft_model: nn.Module, folder: str | Path, cfg: TrainConfig) -> nn.Module:
    """The student a `base_quant` run saved in `folder` (best-adapter/): a copy of the draft over its int4 base
    (`quantized_base`, with `cfg`'s calibration) with the adapter loaded, unmerged, in eval mode."""
    from peft import PeftModel

    if cfg.base_quant is None:
        raise DraftsmithError("adapter_student: the config has no base_quant (the adapter's base is the float draft)")
    base = quantized_base(copy.deepcopy(draft_model), cfg)
    return PeftModel.from_pretrained(base, str(Path(folder))).eval()


def _lora_layers(student: nn.Module) -> dict[str, tuple]:
    """{HF module name: (its base weight, the adapters' change scale * B @ A)} for every LoRA layer of a peft
    student, in float64."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, m in student.named_modules():
        if isinstance(m, LoraLayer):
            delta = sum(m.get_delta_weight(a) for a in m.active_adapters)
            out[name.removeprefix("base_model.model.")] = (m.get_base_layer().weight.detach().double(),
                                                           delta.detach().double())
    return out


@torch.no_grad()
def requant_survival(student: nn.Module, calib: Calibration | None = None) -> dict:
    """How much of a `base_quant` student's adapter change survives merging and re-quantising to int4 (what
    `int4:best` decodes with: `int4_float_weights` of the merged model, GPTQ on `calib` as `int4:best:calib=FILE`
    does). Per LoRA layer and in all, with W the int4 base, D = scale * B A and C = requant(W + D) - W:
    `kept` = <C, D> / <D, D> (the share of D kept, 1 = all of it), `error` = |C - D| / |D| (Frobenius), and the
    mean and max of |C| and |D|; `untouched_max` is the largest change re-quantising made to a Linear without an
    adapter (the LM head), which rounds again to itself as far as the format allows."""
    layers = _lora_layers(student)
    if not layers:
        raise DraftsmithError("requant_survival: the student has no LoRA layers")
    merged = merged_model(student)
    requant = int4_float_weights(merged, calib)
    per, dots, dd, err2 = {}, 0.0, 0.0, 0.0
    for name, (w, d) in layers.items():
        c = requant[name].double() - w
        dot, dn, en = float((c * d).sum()), float((d * d).sum()), float(((c - d) ** 2).sum())
        per[name] = {"kept": dot / dn if dn else 0.0, "error": (en / dn) ** 0.5 if dn else 0.0,
                     "change_mean_abs": float(c.abs().mean()), "change_max_abs": float(c.abs().max()),
                     "delta_mean_abs": float(d.abs().mean()), "delta_max_abs": float(d.abs().max())}
        dots, dd, err2 = dots + dot, dd + dn, err2 + en
    base = dict(merged.named_modules())
    untouched = [float((requant[n].double() - base[n].weight.double()).abs().max()) for n in requant if n not in layers]
    return {"kept": dots / dd if dd else 0.0, "error": (err2 / dd) ** 0.5 if dd else 0.0,
            "change_max_abs": max(p["change_max_abs"] for p in per.values()),
            "delta_max_abs": max(p["delta_max_abs"] for p in per.values()),
            "untouched_max": max(untouched, default=0.0), "layers": per}


__all__ = ["AGREEMENT_TIE", "adapter_student", "compare_served", "measure_served", "pick_served",
           "requant_survival", "served_specs", "step_ms"]
