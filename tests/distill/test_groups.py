"""Training the int4 draft's own group pairs (`distill.groups`): gradients against autograd in float64, the student
at step 0 is the int4 draft bit for bit, a run leaves best/ whose int4 runner decodes with exactly the trained
groups (and refuses a groups file its weights no longer match)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import draftsmith.distill.train as train_mod
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.quant import GROUP, GROUPS_FILE, Int4Linear, groups_float, int4_float_weights
from draftsmith.distill.groups import GroupLinear, _GroupMatmul, group_student, plain_model
from draftsmith.distill.train import TrainConfig, train
from tests.distill.test_train import FAST, _int4_weights, setup  # noqa: F401 - the fixture


def test_group_matmul_gradients_are_autograds_in_float64() -> None:
    g = torch.Generator().manual_seed(0)
    n, k, t = 5, 2 * GROUP, 3
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    x = torch.randn(t, k, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(n, k // GROUP, generator=g, dtype=torch.float64).add(0.1).requires_grad_()
    minimum = torch.randn(n, k // GROUP, generator=g, dtype=torch.float64).requires_grad_()
    gy = torch.randn(t, n, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((_GroupMatmul.apply(x, q, scale, minimum) * gy).sum(), (x, scale, minimum))
    w = (q.double().reshape(n, -1, GROUP) * scale[..., None] + minimum[..., None]).reshape(n, k)  # brute force
    want = torch.autograd.grad(((x @ w.t()) * gy).sum(), (x, scale, minimum))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda s, m: _GroupMatmul.apply(x.detach(), q, s, m), (scale, minimum))


def test_a_group_student_is_the_int4_draft_and_trains_only_pairs_biases_norms(setup) -> None:  # noqa: F811
    """Every Linear the int4 draft rounds (the LM head too) is a GroupLinear whose weight is the int4 draft's bit
    for bit (`int4_float_weights`); trainable: u, v, biases and norm weights; the caller's draft is untouched."""
    _, draft, refs = setup
    before = {k: v.clone() for k, v in draft.model.state_dict().items()}
    want = int4_float_weights(draft.model)
    student = group_student(__import__("copy").deepcopy(draft.model))
    layers = {n: m for n, m in student.named_modules() if isinstance(m, GroupLinear)}
    assert set(layers) == set(want) and "lm_head" in layers
    for name, m in layers.items():
        assert torch.equal(groups_float(m.q, m.stored()), want[name])
    names = {n for n, p in student.named_parameters() if p.requires_grad}
    assert names and all(n.endswith((".u", ".v", ".bias")) or "norm" in n for n in names)
    assert not student.get_input_embeddings().weight.requires_grad
    assert all(torch.equal(v, draft.model.state_dict()[k]) for k, v in before.items())
    ids = torch.tensor([refs[0]["prompt_ids"] + refs[0]["continuation_ids"]])
    plain, _ = plain_model(student)
    with torch.no_grad():
        torch.testing.assert_close(student(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_a_groups_run_leaves_best_whose_int4_runner_has_the_trained_groups(setup, tmp_path, monkeypatch) -> None:  # noqa: F811
    """base_quant int4 with lora_r 0: the pairs move; best/ is a plain HF folder whose weights are the trained
    groups' floats and GROUPS_FILE holds those groups; an int4 runner of best/ decodes with exactly them (where
    rounding the folder's floats afresh would not give them all back); a groups file whose weights were edited
    is one line."""
    from transformers import AutoModelForCausalLM

    from draftsmith.decode.runtime import quant
    from draftsmith.decode.runtime.lean import LeanLM
    from draftsmith.decode.runtime.quant import _int4_copy, int4_chunk, stored_int4_groups
    from draftsmith.decode.runtime.runner import make_runner

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    target, draft, refs = setup
    cfg = TrainConfig(**{**FAST, "lr": 3e-2, "steps": 3, "base_quant": "int4"})
    out = tmp_path / "run"
    summary = train(target, draft, refs, None, out, cfg, progress=False)
    assert summary["best_step"] == 3 and not (out / train_mod.ADAPTER_DIR).exists()
    assert json.loads((out / "best" / train_mod.MARKER).read_text())["base_quant"] == "int4"
    saved = load_file(str(out / "best" / GROUPS_FILE))
    best = AutoModelForCausalLM.from_pretrained(out / "best").eval()
    stock = int4_float_weights(draft.model)

    def no_rounding(*args, **kwargs):
        raise AssertionError("rounded afresh: the folder's groups were not used")

    with monkeypatch.context() as m:
        m.setattr(quant, "quantize_groups", no_rounding)
        lean = LeanLM(best, 64, fast_head=False)
        runner = _int4_copy(lean, None, stored_int4_groups(best, lean))
        if int4_chunk():  # the public path reads the file too
            assert isinstance(make_runner(best, 64, quantize="int4").lm_head, Int4Linear)
    served = _int4_weights(runner, best)
    assert set(served) == set(stock) and "lm_head.sm" in saved
    moved = [n for n in served if not torch.equal(served[n], stock[n])]
    assert len(moved) == len(served)  # every layer's pairs trained
    for n, w in served.items():
        assert torch.equal(w, best.get_submodule(n).weight)
    assert isinstance(runner.lm_head, Int4Linear)
    with pytest.raises(AssertionError, match="rounded afresh"):  # control: without the file, it rounds
        with monkeypatch.context() as m:
            m.setattr(quant, "quantize_groups", no_rounding)
            _int4_copy(LeanLM(best, 64, fast_head=False), None)
    student = train_mod.student_from_checkpoint(draft, out / "checkpoints" / "step-3", cfg)
    ids = torch.tensor([refs[0]["prompt_ids"] + refs[0]["continuation_ids"]])
    with torch.no_grad():
        want, got, base = (m(input_ids=ids).logits for m in (student, best, draft.model))
    # best/ holds the pairs rounded to float16 as stored: close to the student, far closer than to the untrained draft
    assert (got - want).abs().max() < 0.1 * (want - base).abs().max()
    with torch.no_grad():
        best.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    with pytest.raises(DraftsmithError, match="down_proj are not its weights in this folder"):
        stored_int4_groups(best, LeanLM(best, 64, fast_head=False))
