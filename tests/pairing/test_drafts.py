"""From an `int4:MODEL[:calib=FILE]:lora=FOLDER` spec (pruned or not) to the runner the decoder drafts with:
`pairing.drafts` opens it as int4 plus the adapter unmerged, checks the adapter before loading a model, and the
decoder with it keeps the target's greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import draftsmith.pairing.drafts as drafts_mod
from draftsmith.decode.pruned import PrunedRunner
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.lora import LoraLinear, read_adapter, with_lora
from draftsmith.decode.runtime.quant import Int4Linear, int4_chunk, read_calib, write_calib
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.speculative import KPolicy, generate
from draftsmith.distill.train import TrainConfig, make_student
from draftsmith.pairing.drafts import adapter, load_draft, open_draft, spec_runner
from tests.pairing.test_leaderboard import WORDS, setup  # noqa: F401,F811 (a fixture)
from tests.pairing.test_prune import vocab_file

needs_int4 = pytest.mark.skipif(not int4_chunk(), reason="no int4 kernel on this CPU (AVX-512BW or AVX2)")


def save_adapter(model, folder: Path, calib: str | None = None) -> Path:
    """A student over `model`'s int4 weights with random adapters, saved as peft saves them."""
    student = make_student(model, TrainConfig(lora_r=4, lora_alpha=8, base_quant="int4", base_calib=calib))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    student.save_pretrained(folder, save_embedding_layers=False)
    return folder


@needs_int4
def test_an_int4_lora_spec_opens_as_int4_plus_the_adapter(setup, tmp_path: Path) -> None:
    target_dir, other, _ = setup
    target, draft = load(target_dir), load(other)
    calib = write_calib(tmp_path / "c.json", [[3, 4, 5, 6, 7, 8], [9, 10, 11]])
    folder = save_adapter(draft.model, tmp_path / "adapter", str(calib))
    spec = f"int4:{other}:calib={calib}:lora={folder}"
    opened = open_draft(spec, target, 64, None)
    assert opened.quant == "int4"
    mods = list(opened.runner.modules())
    assert any(isinstance(m, LoraLinear) for m in mods) and any(isinstance(m, Int4Linear) for m in mods)
    want = with_lora(make_runner(draft.model, 64, quantize="int4", calib=read_calib(calib)), read_adapter(folder))
    ids = torch.tensor([3, 4, 5, 6, 7])
    assert torch.equal(opened.runner.forward(ids, 0), want.forward(ids, 0))  # the same weights, the same bits
    plain = spec_runner(draft.model, 64, "int4", f"int4:{other}:calib={calib}")
    assert not any(isinstance(m, LoraLinear) for m in plain.modules()) and adapter(f"int4:{other}") is None

    kept = vocab_file(tmp_path / "v.json", vocab_size=len(WORDS) + 3, ids=list(range(2, 20)), n=18)
    pruned = open_draft(f"prune:int4:{other}:lora={folder}:vocab={kept}", target, 64, None).runner
    assert isinstance(pruned, PrunedRunner) and any(isinstance(m, LoraLinear) for m in pruned.inner.modules())
    t_runner = make_runner(target.model, 64)
    for draft_runner in (opened.runner, pruned):
        for k in (1, 3):
            prompt = [3, 4, 5]
            ref = generate(t_runner, prompt, max_new_tokens=20).tokens
            assert generate(t_runner, prompt, draft=draft_runner, max_new_tokens=20,
                            policy=KPolicy(k=k)).tokens == ref


def test_a_bad_adapter_fails_before_a_model_loads(setup, tmp_path: Path, monkeypatch) -> None:
    target_dir, other, _ = setup
    target = load(target_dir)

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(drafts_mod, "load", no_load)
    (tmp_path / "empty").mkdir()
    for spec, needle in ((f"int4:{other}:lora={tmp_path / 'empty'}", "no LoRA adapter"),
                         (f"prune:int4:{other}:lora={tmp_path / 'none'}:vocab=v.json", "no LoRA adapter")):
        with pytest.raises(DraftsmithError, match=needle) as e:
            load_draft(spec, target)
        assert "\n" not in str(e.value)
