"""Distillation training on tiny models: it learns (loss down, alpha up), resumes bit-for-bit, merges LoRA
exactly, accumulates gradients exactly, skips and counts non-finite steps, names a bad config field, and with
base_quant trains LoRA over the int4 draft's own weights (bit for bit) and leaves best/ and best-adapter/."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import draftsmith.distill.train as train_mod
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.distill.train import TrainConfig, lr_factor, student_from_checkpoint, train
from draftsmith.pairing.reference import reference_continuations
from tests.distill.test_data import EOS, make_prompts, tiny_loaded


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Target (2 layers), draft (1 layer, another seed), and the target's greedy text on 8 prompts."""
    root = tmp_path_factory.mktemp("train")
    target, draft = tiny_loaded(0, root / "target", layers=2), tiny_loaded(1, root / "draft", layers=1)
    refs = reference_continuations(target, make_prompts(8), max_new_tokens=12, cache_root=root / "refs",
                                   progress=False)
    return target, draft, refs


def _log(out: Path, kind: str = "step") -> list[dict]:
    lines = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    return [x for x in lines if ("eval" in x) == (kind == "eval")]


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step-{step}" / "student.safetensors"))


FAST = dict(warmup_steps=0, batch_size=4, save_every=100, eval_every=100)


class Crash(Exception):
    pass


def crash_after_saving(monkeypatch):
    """The next checkpoint is written, then the run crashes; returns the real save for the resume."""
    save = train_mod.save_checkpoint

    def save_then_crash(*args, **kwargs):
        save(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(train_mod, "save_checkpoint", save_then_crash)
    return save


def test_training_lowers_the_divergence_and_raises_alpha(setup, tmp_path) -> None:
    target, draft, refs = setup
    before = [p.clone() for p in draft.model.parameters()]
    cfg = TrainConfig(**{**FAST, "lr": 1e-2, "steps": 20, "eval_every": 10, "save_every": 10})
    summary = train(target, draft, refs, refs, tmp_path, cfg, progress=False)

    assert summary["steps_done"] == 20 and not summary["stopped_early"] and summary["skipped_steps"] == 0
    assert summary["alpha_after"] > summary["alpha_before"] + 0.1
    steps = _log(tmp_path)
    assert [x["step"] for x in steps] == list(range(1, 21))
    assert {"step", "loss", "fkl", "lr", "grad_norm", "tokens", "skipped"} <= set(steps[0])
    first, last = (sum(x["loss"] for x in part) / 5 for part in (steps[:5], steps[-5:]))
    assert last < 0.5 * first
    evals = _log(tmp_path, "eval")
    assert [x["step"] for x in evals] == [0, 10, 20] and set(evals[0]["alpha_by_domain"]) == {"code", "chat"}
    assert summary["alpha_after"] == max(x["alpha"] for x in evals)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-20"]  # only the latest is kept
    assert all(torch.equal(a, b) for a, b in zip(before, draft.model.parameters()))  # the caller's draft is intact

    # best/ is a plain HF folder whose alpha is the best one
    best = AutoModelForCausalLM.from_pretrained(tmp_path / "best")
    marker = json.loads((tmp_path / "best" / train_mod.MARKER).read_text())
    assert marker["step"] == summary["best_step"] and (tmp_path / "best" / "tokenizer.json").is_file()
    from draftsmith.decode.runtime.loading import Loaded
    from draftsmith.pairing.acceptance import measure_acceptance

    [a] = measure_acceptance(target, [Loaded(best, draft.tokenizer, tmp_path / "best", "best")], refs, progress=False)
    assert a.alpha == pytest.approx(summary["alpha_after"])


def test_resume_after_a_crash_equals_an_uninterrupted_run(setup, tmp_path, monkeypatch) -> None:
    target, draft, refs = setup
    cfg = TrainConfig(**{**FAST, "lr": 1e-2, "steps": 6, "save_every": 3, "eval_every": 2, "warmup_steps": 2})
    whole = train(target, draft, refs, refs, tmp_path / "a", cfg, progress=False)

    save = crash_after_saving(monkeypatch)
    with pytest.raises(Crash):
        train(target, draft, refs, refs, tmp_path / "b", cfg, progress=False)
    with (tmp_path / "b" / "log.jsonl").open("a") as f:  # the crash came later: lines past the checkpoint
        f.write(json.dumps({"step": 4, "loss": 0.0}) + "\n")
    trainer = tmp_path / "b" / "checkpoints" / "step-3" / "trainer.json"  # written before the teacher fields existed:
    saved = json.loads(trainer.read_text())  # a field the checkpoint lacks counts as its default
    saved["config"] = {k: v for k, v in saved["config"].items() if not k.startswith("teacher")}
    trainer.write_text(json.dumps(saved))
    monkeypatch.setattr(train_mod, "save_checkpoint", save)
    resumed = train(target, draft, refs, refs, tmp_path / "b", cfg, progress=False)

    a, b = _weights(tmp_path / "a", 6), _weights(tmp_path / "b", 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "log.jsonl").read_text() == (tmp_path / "b" / "log.jsonl").read_text()
    assert {k: v for k, v in resumed.items() if k != "paths"} == {k: v for k, v in whole.items() if k != "paths"}

    again = train(target, draft, refs, refs, tmp_path / "b", cfg, progress=False)  # finished: nothing to do
    assert again["steps_done"] == 6 and len(_log(tmp_path / "b")) == 6
    with pytest.raises(DraftsmithError, match="lr="):
        train(target, draft, refs, refs, tmp_path / "b", TrainConfig(**{**cfg.to_dict(), "lr": 0.5}), progress=False)


def test_early_stop_after_evals_without_gain(setup, tmp_path) -> None:
    target, draft, refs = setup
    cfg = TrainConfig(**{**FAST, "lr": 1e-9, "steps": 10, "eval_every": 1, "early_stop_patience": 2})
    summary = train(target, draft, refs, refs, tmp_path, cfg, progress=False)
    assert summary["stopped_early"] and summary["steps_done"] == 2 and summary["best_step"] == 0
    assert summary["alpha_after"] == summary["alpha_before"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-2"]
    assert train(target, draft, refs, refs, tmp_path, cfg, progress=False)["steps_done"] == 2  # stays stopped


def test_lora_merged_folder_equals_the_adapter(setup, tmp_path) -> None:
    target, draft, refs = setup
    cfg = TrainConfig(**{**FAST, "lr": 1e-2, "steps": 3, "lora_r": 4, "lora_alpha": 8})
    summary = train(target, draft, refs, None, tmp_path, cfg, progress=False)
    assert summary["best_step"] == 3 and summary["alpha_after"] is None
    saved = _weights(tmp_path, 3)
    assert saved and all("lora_" in k for k in saved)  # checkpoints hold only the adapters
    assert set(train_mod.lora_target_modules(draft.model)) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    adapter = student_from_checkpoint(draft, tmp_path / "checkpoints" / "step-3", cfg)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "best").eval()
    ids = torch.tensor([refs[0]["prompt_ids"] + refs[0]["continuation_ids"]])
    with torch.no_grad():
        want, got, base = (m(input_ids=ids).logits for m in (adapter, merged, draft.model))
    assert not torch.allclose(want, base, atol=1e-3)  # the adapters did learn something
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_gradient_accumulation_equals_one_big_batch(tmp_path) -> None:
    target = tiny_loaded(0, tmp_path / "t64", layers=2, dtype=torch.float64)
    draft = tiny_loaded(1, tmp_path / "d64", layers=1, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    lengths = [(3, 1), (2, 7), (5, 2), (1, 9), (4, 4), (2, 3)]  # unequal: a mean of means would differ
    rows = {"prompt_ids": [torch.randint(0, EOS, (p,), generator=g).tolist() for p, _ in lengths],
            "continuation_ids": [torch.randint(0, EOS + 1, (c,), generator=g).tolist() for _, c in lengths]}
    data = datasets.Dataset.from_dict(rows)
    runs = {}
    for batch, accum in ((4, 1), (2, 2)):
        out = tmp_path / f"b{batch}a{accum}"
        cfg = TrainConfig(**{**FAST, "lr": 1e-3, "steps": 1, "batch_size": batch, "grad_accum": accum,
                             "max_grad_norm": 0.0})
        train(target, draft, data, None, out, cfg, progress=False)
        runs[batch] = (_log(out)[0], _weights(out, 1))
    (log4, w4), (log2, w2) = runs[4], runs[2]
    assert log4["tokens"] == log2["tokens"] > 4
    assert log2["loss"] == pytest.approx(log4["loss"], rel=1e-12)
    assert log2["grad_norm"] == pytest.approx(log4["grad_norm"], rel=1e-10)
    for k in w4:
        torch.testing.assert_close(w2[k], w4[k], rtol=0, atol=1e-6)


def test_non_finite_steps_are_skipped_and_counted(setup, tmp_path, monkeypatch) -> None:
    target, draft, refs = setup
    real, calls = train_mod.divergence_sum, [0]

    def poisoned(*args, **kwargs):
        total, n = real(*args, **kwargs)
        calls[0] += 1
        return (total * float("nan"), n) if calls[0] in poison else (total, n)

    monkeypatch.setattr(train_mod, "divergence_sum", poisoned)
    poison = {2}
    summary = train(target, draft, refs, None, tmp_path / "a", TrainConfig(**{**FAST, "steps": 4}), progress=False)
    assert summary["skipped_steps"] == 1 and summary["steps_done"] == 4
    assert [x["skipped"] for x in _log(tmp_path / "a")] == [False, True, False, False]
    assert all(torch.isfinite(w).all() for w in _weights(tmp_path / "a", 4).values())

    poison, calls[0] = set(range(100)), 0
    with pytest.raises(DraftsmithError, match="non-finite"):
        train(target, draft, refs, None, tmp_path / "b", TrainConfig(**{**FAST, "steps": 10, "max_bad_steps": 2}),
              progress=False)


def test_config_errors_name_the_field() -> None:
    for bad, field in (({"lr": -1.0}, "lr"), ({"loss": "kl"}, "loss"), ({"steps": 2.5}, "steps"),
                       ({"batch_size": True}, "batch_size"), ({"jsd_beta": 1.0}, "jsd_beta"),
                       ({"schedule": "step"}, "schedule"), ({"wandb": "on"}, "wandb"),
                       ({"mixed_precision": "fp64"}, "mixed_precision"), ({"grad_accum": 0}, "grad_accum")):
        with pytest.raises(DraftsmithError, match=rf"TrainConfig\.{field}\b"):
            TrainConfig(**bad)
    with pytest.raises(DraftsmithError, match="'lrr'"):
        TrainConfig.from_dict({"lrr": 1e-3})
    assert TrainConfig(lr=1).lr == 1.0 and isinstance(TrainConfig(lr=1).lr, float)


def test_schedule_warms_up_then_decays_without_a_zero_lr_step() -> None:
    assert [lr_factor(s, 3, 10, "constant") for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = [lr_factor(s, 0, 10, "cosine") for s in range(10)]
    assert cos[0] == 1.0 and all(a > b > 0 for a, b in zip(cos, cos[1:]))
    lin = [lr_factor(s, 2, 12, "linear") for s in range(12)]
    assert lin[2] == 1.0 and lin[-1] == pytest.approx(0.1) and math.isclose(lin[7], 0.5)


def test_on_policy_rows_are_resampled_from_the_student_and_a_resume_trains_on_the_same(setup, tmp_path,
                                                                                       monkeypatch) -> None:
    """refresh_every=2: after steps 2 and 4 the draft's rows are resampled from the student of that step (checked
    against a sample from the checkpointed student); a run that crashes after its step-2 checkpoint resumes with
    the resampled rows and ends with the uninterrupted run's weights."""
    from draftsmith.distill.data import training_rows
    from draftsmith.distill.train import onpolicy_rows, refresh_onpolicy

    target, draft, refs = setup
    data = refs.add_column("source", ["draft", "target"] * (len(refs) // 2))
    cfg = TrainConfig(**{**FAST, "lr": 1e-2, "steps": 5, "save_every": 2, "eval_every": 5, "refresh_every": 2})
    whole = train(target, draft, data, refs, tmp_path / "a", cfg, progress=False)
    assert [(x["step"], x["refresh"]) for x in _log(tmp_path / "a") if "refresh" in x] == [(2, 1), (4, 2)]

    save = crash_after_saving(monkeypatch)
    with pytest.raises(Crash):
        train(target, draft, data, refs, tmp_path / "b", cfg, progress=False)
    ckpt = tmp_path / "b" / "checkpoints" / "step-2"
    saved = json.loads((ckpt / "trainer.json").read_text())["refresh"]
    onpolicy = onpolicy_rows(data)
    assert saved["round"] == 1 and sorted(map(int, saved["rows"])) == onpolicy == [0, 2, 4, 6]
    rows = training_rows(data)
    student = student_from_checkpoint(draft, ckpt, cfg)
    again = refresh_onpolicy(student, rows, onpolicy, 1, cfg.seed, draft, target, "cpu")
    assert again["rows"] == saved["rows"]  # what the step-2 student samples
    assert any(saved["rows"][str(i)] != list(data[i]["continuation_ids"]) for i in onpolicy)
    monkeypatch.setattr(train_mod, "save_checkpoint", save)
    resumed = train(target, draft, data, refs, tmp_path / "b", cfg, progress=False)
    a, b = _weights(tmp_path / "a", 5), _weights(tmp_path / "b", 5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert {k: v for k, v in resumed.items() if k != "paths"} == {k: v for k, v in whole.items() if k != "paths"}
    with pytest.raises(DraftsmithError, match="no on-policy rows"):
        train(target, draft, refs, refs, tmp_path / "c", cfg, progress=False)
    with pytest.raises(DraftsmithError, match="refresh_every"):
        TrainConfig(refresh_every=2, teacher="cache")


# -- training the draft that is served: LoRA over the int4 draft's own weights ------------------------------------


def _int4_weights(runner, model) -> dict[str, torch.Tensor]:
    """{HF module name: weight_float()} of an int4 runner's Linears, its fused q|k|v and gate|up rows split back."""
    out = {"lm_head": runner.lm_head.weight_float()}
    for i, layer in enumerate(runner.layers):
        hf = model.model.layers[i]
        parts = {"qkv": [("self_attn", p) for p in ("q_proj", "k_proj", "v_proj")], "o": [("self_attn", "o_proj")],
                 "gate_up": [("mlp", "gate_proj"), ("mlp", "up_proj")], "down": [("mlp", "down_proj")]}
        for attr, names in parts.items():
            sizes = [getattr(getattr(hf, block), n).out_features for block, n in names]
            for (block, n), w in zip(names, getattr(layer, attr).weight_float().split(sizes)):
                out[f"model.layers.{i}.{block}.{n}"] = w
    return out


def test_base_quant_student_sits_on_the_int4_drafts_weights_bit_for_bit(setup, tmp_path, monkeypatch) -> None:
    """After make_student with base_quant, every frozen Linear weight (the LM head too) is the int4 runner's
    weight_float(), bit for bit, plain or GPTQ-calibrated (each computed afresh, no cache between them); only the
    adapters train; the input embedding stays the float one; the caller's draft is intact."""
    from draftsmith.decode.runtime.quant import int4_chunk, read_calib, write_calib
    from draftsmith.decode.runtime.runner import make_runner

    if not int4_chunk():
        pytest.skip("no int4 kernel on this CPU (AVX-512BW or AVX2)")
    _, draft, refs = setup
    before = {k: v.clone() for k, v in draft.model.state_dict().items()}
    calib = write_calib(tmp_path / "c.json", [refs[i]["prompt_ids"] + refs[i]["continuation_ids"] for i in range(4)])
    students = {}
    for path in (None, str(calib)):
        monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / f"cache-{path is None}-s"))
        student = train_mod.make_student(draft.model, TrainConfig(lora_r=4, base_quant="int4", base_calib=path))
        monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / f"cache-{path is None}-r"))  # GPTQ again, not read
        runner = make_runner(draft.model, 64, quantize="int4", calib=read_calib(path) if path else None)
        want = _int4_weights(runner, draft.model)
        frozen = {n.removeprefix("base_model.model.").removesuffix(".base_layer.weight").removesuffix(".weight"): p
                  for n, p in student.named_parameters() if not p.requires_grad}
        assert set(want) <= set(frozen) and all(torch.equal(frozen[n], w) for n, w in want.items())
        assert torch.equal(frozen["model.embed_tokens"], before["model.embed_tokens.weight"])
        assert all("lora_" in n for n, p in student.named_parameters() if p.requires_grad)
        students[path] = frozen
    plain, gptq = students[None], students[str(calib)]
    assert any(not torch.equal(plain[n], gptq[n]) for n in plain)  # GPTQ rounds otherwise
    assert not torch.equal(plain["model.layers.0.self_attn.q_proj"], before["model.layers.0.self_attn.q_proj.weight"])
    assert all(torch.equal(v, draft.model.state_dict()[k]) for k, v in before.items())


def test_base_quant_config_errors_name_the_field() -> None:
    for bad, field, why in (({"base_quant": "int3", "lora_r": 4}, "base_quant", "not one of int4"),
                            ({"base_calib": "c.json", "lora_r": 4}, "base_calib", "base_quant: int4"),
                            ({"base_quant": 4, "lora_r": 4}, "base_quant", "expected str")):
        with pytest.raises(DraftsmithError, match=rf"TrainConfig\.{field}: .*{why}"):
            TrainConfig(**bad)
    assert TrainConfig().base_quant is None and TrainConfig(lora_r=4, base_quant="int4").base_calib is None
    assert TrainConfig(base_quant="int4").lora_r == 0  # the int4 draft's group pairs train (tests/distill/test_groups)


def test_a_base_quant_run_leaves_the_merged_best_and_the_adapter(setup, tmp_path, monkeypatch) -> None:
    """best/ is a plain HF folder equal to the student (adapters merged into the int4 weights); best-adapter/ is
    peft's adapter, which the int4 runner serves unmerged close to the student (int8 inputs aside)."""
    from draftsmith.decode.runtime.lora import read_adapter, with_lora
    from draftsmith.decode.runtime.quant import int4_chunk
    from draftsmith.decode.runtime.runner import make_runner

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    target, draft, refs = setup
    cfg = TrainConfig(**{**FAST, "lr": 1e-2, "steps": 3, "lora_r": 4, "lora_alpha": 8, "base_quant": "int4"})
    summary = train(target, draft, refs, None, tmp_path, cfg, progress=False)  # best/: the final student
    assert summary["paths"]["best_adapter"] == str(tmp_path / train_mod.ADAPTER_DIR) and summary["best_step"] == 3
    marker = json.loads((tmp_path / train_mod.ADAPTER_DIR / train_mod.MARKER).read_text())
    assert marker["base_quant"] == "int4" and marker["step"] == 3
    student = student_from_checkpoint(draft, tmp_path / "checkpoints" / "step-3", cfg)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "best").eval()
    ids = torch.tensor([refs[0]["prompt_ids"] + refs[0]["continuation_ids"]])
    with torch.no_grad():
        want, got, base = (m(input_ids=ids).logits for m in (student, merged, draft.model))
    assert not torch.allclose(want, base, atol=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    if int4_chunk():
        runner = with_lora(make_runner(draft.model, 64, quantize="int4"), read_adapter(tmp_path / "best-adapter"))
        served = runner.forward(ids[0], 0)
        assert (served - want[0]).abs().max() <= 0.05 * want.abs().max()
    train(target, draft, refs, None, tmp_path, TrainConfig(**{**cfg.to_dict(), "base_quant": None}), resume=False,
          progress=False)
    assert not (tmp_path / train_mod.ADAPTER_DIR).exists()  # a fresh run clears what the last one left


def test_a_base_quant_student_of_a_bfloat16_draft_is_float32_on_its_int4_weights() -> None:
    """A draft loaded in bfloat16 (as on a GPU): the student is float32 and its frozen weights are the int4 weights
    of the draft's float32 copy (what an int4 draft loaded from those weights decodes with), bit for bit."""
    import copy

    from draftsmith.decode.runtime.quant import int4_float_weights
    from tests import helpers

    bf16 = helpers.tiny_llama(4, 41, hidden=64, layers=1).to(torch.bfloat16)
    student = train_mod.make_student(bf16, TrainConfig(lora_r=2, base_quant="int4"))
    want = int4_float_weights(copy.deepcopy(bf16).float())
    got = {n.removeprefix("base_model.model.").removesuffix(".base_layer.weight").removesuffix(".weight"): p
           for n, p in student.named_parameters()}
    assert all(p.dtype == torch.float32 for p in got.values()) and next(bf16.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(got[n], w) for n, w in want.items())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_from_the_first_scored_position_give_the_same_loss_and_gradients(arch: str) -> None:
    """A step computes the LM head only from the batch's first scored position on (`first_scored`): the loss and
    every gradient equal those of the full logits (float64 of both paths). The control: cut one position further
    and the loss changes (that position is scored)."""
    from draftsmith.distill.data import collate
    from draftsmith.distill.divergences import divergence_sum
    from tests.helpers import tiny_llama

    torch.manual_seed(0)
    student, teacher = tiny_llama(0, 40, arch=arch).double(), tiny_llama(1, 40, arch=arch).double()
    rows = [([1, 2, 3, 4, 5, 6], [7, 8, 9]), ([3, 4, 5, 6, 7, 8, 9, 10], [11, 12]), ([5, 6, 7, 8, 9], [10, 11, 12, 13])]
    ids, attn, mask = collate(rows, [0, 1, 2])
    lo = train_mod.first_scored(mask)
    assert lo == 4 and not mask[:, :lo].any() and mask[:, lo].any()

    def loss(keep: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        student.zero_grad()
        s = student(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=keep).logits
        with torch.no_grad():
            t = torch.log_softmax(teacher(input_ids=ids, attention_mask=attn, use_cache=False,
                                          logits_to_keep=keep).logits, dim=-1)
        value, _ = divergence_sum("fkl", s, t, mask[:, ids.shape[1] - keep:])
        value.backward()
        return value.detach(), [p.grad.clone() for p in student.parameters()]

    full, g_full = loss(ids.shape[1])
    cut, g_cut = loss(ids.shape[1] - lo)
    assert torch.allclose(full, cut, rtol=1e-12, atol=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(g_full, g_cut))
    too_far, _ = loss(ids.shape[1] - lo - 1)
    assert not torch.allclose(full, too_far)
    assert train_mod.first_scored(torch.zeros(2, 3, dtype=torch.bool)) == 0
