"""Which form of a draft trained over its int4 base serves (`distill.served`): the picking rule as a pure function,
the two specs a run serves in, how much of the adapter re-quantisation keeps, a smoke of the measuring, and the
merged best/ of such a run exported (HF folder and GGUF) as any standalone draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.quant import int4_chunk
from draftsmith.decode.spec import DraftSpec
from draftsmith.distill.served import (AGREEMENT_TIE, adapter_student, compare_served, pick_served, requant_survival,
                                       served_specs)
from draftsmith.distill.train import ADAPTER_DIR, MARKER, TrainConfig, make_student, save_best
from draftsmith.pairing.reference import reference_continuations
from tests import helpers
from tests.distill.test_data import EOS, WORDS, make_prompts

needs_int4 = pytest.mark.skipif(not int4_chunk(), reason="no int4 kernel on this CPU (AVX-512BW or AVX2)")
CFG = TrainConfig(lora_r=4, lora_alpha=8, base_quant="int4")


def randomised(student, scale: float, seed: int = 0):
    """The student with random adapters (peft starts B at 0), B ~ N(0, scale^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return student.eval()


@pytest.mark.parametrize("forms,pick", [
    ({"unmerged": (0.800, 9.0), "merged": (0.797, 7.0)}, "merged"),  # within the tie: faster wins
    ({"unmerged": (0.800, 9.0), "merged": (0.795, 7.0)}, "merged"),  # exactly the tie still counts as equal
    ({"unmerged": (0.800, 9.0), "merged": (0.790, 7.0)}, "unmerged"),  # beyond it: the higher agreement
    ({"unmerged": (0.700, 5.0), "merged": (0.790, 7.0)}, "merged"),
    ({"unmerged": (0.800, 7.0), "merged": (0.800, 7.0)}, "unmerged"),  # a full tie: the first given
    ({"unmerged": (0.800, 6.0), "merged": (0.802, 7.0)}, "unmerged"),
])
def test_the_faster_form_serves_at_equal_agreement(forms: dict, pick: str) -> None:
    assert AGREEMENT_TIE == 0.005
    assert pick_served({n: {"agreement": a, "step_ms": t} for n, (a, t) in forms.items()}) == pick


def test_pick_needs_forms_and_the_specs_name_both_forms(tmp_path: Path) -> None:
    with pytest.raises(DraftsmithError, match="no forms"):
        pick_served({})
    specs = served_specs("m", tmp_path / "run", "c.json")
    assert specs == {"unmerged": f"int4:m:calib=c.json:lora={tmp_path / 'run' / ADAPTER_DIR}",
                     "merged": f"int4:{tmp_path / 'run' / 'best'}:calib=c.json"}
    assert all(DraftSpec.parse(s).quant == "int4" for s in specs.values())
    assert DraftSpec.parse(specs["unmerged"]).adapter == tmp_path / "run" / ADAPTER_DIR


def test_requant_survival_keeps_a_large_change_and_loses_a_tiny_one() -> None:
    """An adapter change the size of the weights survives re-quantisation (kept near 1, small error); one far
    below an int4 step is rounded away (kept near 0): the reason the unmerged form can agree more. The LM head,
    with no adapter, rounds again to (nearly) itself."""
    hf = helpers.tiny_llama(2, 61, hidden=64, layers=1, tied=True)
    large = requant_survival(randomised(make_student(hf, CFG), 0.3))
    tiny = requant_survival(randomised(make_student(hf, CFG), 1e-5))
    assert large["kept"] > 0.8 and large["error"] < 0.5, large
    assert tiny["kept"] < 0.5 and tiny["error"] > 0.5, tiny
    assert set(large["layers"]) == {f"model.layers.0.{b}.{p}" for b, ps in
                                    (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                     ("mlp", ("gate_proj", "up_proj", "down_proj"))) for p in ps}
    assert large["delta_max_abs"] > tiny["delta_max_abs"] > 0
    assert large["untouched_max"] < 0.05 * float(hf.lm_head.weight.detach().abs().max())
    with pytest.raises(DraftsmithError, match="no LoRA layers"):
        requant_survival(hf)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A target and a draft saved as HF folders (the specs load them), references, and a base_quant run's
    best/ and best-adapter/ (random adapters) written as training writes them."""
    root = tmp_path_factory.mktemp("served")
    tok = helpers.word_tokenizer([*WORDS, "<eos>", "[UNK]"], eos="<eos>")
    t_dir = helpers.save_tiny(root / "target", tok, 0, vocab_size=EOS + 1, eos_id=EOS, layers=2)
    d_dir = helpers.save_tiny(root / "draft", tok, 1, vocab_size=EOS + 1, eos_id=EOS, layers=1)
    target, draft = load(t_dir), load(d_dir)
    refs = reference_continuations(target, make_prompts(4), max_new_tokens=8, cache_root=root / "refs",
                                   progress=False)
    student = randomised(make_student(draft.model, CFG), 0.05)
    save_best(student, draft.tokenizer, root / "run", {"step": 0, "alpha": None}, CFG)
    return {"root": root, "target": target, "draft": draft, "d_dir": d_dir, "refs": refs, "student": student}


@needs_int4
def test_compare_served_measures_both_forms(world, monkeypatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(world["root"] / "cache"))
    run = world["root"] / "run"
    assert json.loads((run / ADAPTER_DIR / MARKER).read_text())["base_quant"] == "int4"
    assert (run / "best" / "config.json").is_file() and not (run / "best" / "adapter_config.json").exists()
    loaded = adapter_student(world["draft"].model, run / ADAPTER_DIR, CFG)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, world["student"](input_ids=ids).logits)
    specs = served_specs(str(world["d_dir"]), run)
    result = compare_served(world["target"], specs, world["refs"], reps=1)
    assert set(result["forms"]) == {"unmerged", "merged"} and result["pick"] in result["forms"]
    for name, form in result["forms"].items():
        assert form["spec"] == specs[name] and form["quant"] == "int4"
        assert 0.0 <= form["agreement"] <= 1.0 and form["positions"] > 0 and form["step_ms"] > 0
    assert result["pick"] == pick_served(result["forms"])
    kept = world["root"] / "kept.json"
    kept.write_text(json.dumps({"format": "draftsmith-kept-vocab", "version": 1, "vocab_size": EOS + 1, "n": 30,
                                "ids": list(range(30))}))
    pruned = compare_served(world["target"], {"pruned": DraftSpec.pruned(specs["unmerged"], kept).text},
                            world["refs"], reps=1)
    assert pruned["forms"]["pruned"]["agreement"] <= 1.0 and pruned["pick"] == "pruned"


def test_a_base_quant_runs_best_exports_as_any_draft(tmp_path: Path) -> None:
    """best/ of a base_quant run (adapters merged into the int4 weights, its tied head untied) is a plain HF
    folder: distill.export writes and checks its HF folder and an f16 GGUF (reload, assisted greedy, GGUF logits)."""
    from draftsmith.distill.export import ExportConfig, export
    from tests.distill.export.test_export import bpe_tokenizer, save, target_vocab_gguf, tiny_model

    tok = bpe_tokenizer()
    t_gguf = target_vocab_gguf(tmp_path / "target.gguf", tok)
    target = save(tiny_model("llama", 0, 2), tok, tmp_path / "target")
    draft = tiny_model("llama", 1, 1)
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
    save_best(randomised(make_student(draft, CFG), 0.05), tok, tmp_path / "run", {"step": 0, "alpha": None}, CFG)
    best = tmp_path / "run" / "best"
    assert not json.loads((best / "config.json").read_text()).get("tie_word_embeddings", True)
    s = export(str(best), str(target), tmp_path / "out", ExportConfig(gguf_types=["f16"], target_gguf=str(t_gguf)),
               n_prompts=1, max_new_tokens=8, progress=False)
    assert s["ok"] and s["hf"]["checks"]["reload"]["max_abs_diff"] == 0.0
    assert s["hf"]["checks"]["assisted_greedy"]["equal"] and (tmp_path / "out" / "draft-f16.gguf").is_file()
