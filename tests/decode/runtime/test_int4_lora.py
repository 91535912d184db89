"""An int4 draft with float LoRA adapters served unmerged (`decode.runtime.lora`): the adapter read from peft's
folder onto the lean runner's (fused) Linears, its logits the float reference's (int4 `weight_float` + B A) for
1, 3 and 12 rows and a prefill, and the decoder exact with it: greedy-equal to the target alone (whole and pruned),
the target's law at temperature > 0, and a verify that always accepts caught by the same law test."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

import draftsmith.decode.speculative as speculative
from draftsmith.decode.pruned import PrunedRunner
from draftsmith.decode.runtime import native
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.lora import LoraLinear, read_adapter, with_lora
from draftsmith.decode.runtime.quant import Int4Linear, int4_chunk
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams, sample
from draftsmith.decode.speculative import KPolicy, generate
from draftsmith.distill.train import TrainConfig, make_student
from tests import helpers
from tests.decode.test_speculative import chi2_pvalue, sample_counts, target_sequence_law

needs_int4 = pytest.mark.skipif(not int4_chunk(), reason="no int4 kernel on this CPU (AVX-512BW or AVX2)")


def adapted(hf, folder, *, r: int = 4, b_scale: float = 0.3, seed: int = 0):
    """`hf`'s student over its int4 weights (`distill.train.make_student` with base_quant) with random adapters
    (peft starts B at 0), saved as peft saves them in `folder`; -> the student, in eval mode."""
    student = make_student(hf, TrainConfig(lora_r=r, lora_alpha=2 * r, base_quant="int4"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_scale)
    student.save_pretrained(folder, save_embedding_layers=False)
    return student.eval()


def lora_draft(hf, folder, max_len: int = 128):
    return with_lora(make_runner(hf, max_len, quantize="int4"), read_adapter(folder))


@needs_int4
@pytest.mark.parametrize("rows", [1, 3, 12, 30])
def test_lora_linear_adds_b_a_on_each_part_of_a_fused_int4_linear(rows: int) -> None:
    """Two adapters on slices of one Int4Linear's rows (a fused q|k|v): the output is the int4 kernel's, plus
    (x A^T) B^T on each slice and nothing elsewhere, within float32 rounding of a float64 reference."""
    torch.manual_seed(rows)
    base = Int4Linear(nn.Linear(64, 96))
    a1, b1, a2, b2 = torch.randn(4, 64), torch.randn(32, 4), torch.randn(2, 64), torch.randn(16, 2)
    layer = LoraLinear(base, [(0, a1, b1), (64, a2, b2)])
    x = torch.randn(rows, 64)
    added = (layer(x) - base(x)).double()
    want = torch.zeros(rows, 96, dtype=torch.float64)
    want[:, :32] = x.double() @ a1.double().t() @ b1.double().t()
    want[:, 64:80] = x.double() @ a2.double().t() @ b2.double().t()
    assert (added - want).abs().max() <= 1e-5 * want.abs().max()
    assert float(added[:, 32:64].abs().max()) == 0.0 and float(added[:, 80:].abs().max()) == 0.0
    assert layer(x.reshape(1, rows, 64)).shape == (1, rows, 96)  # batched rows too


@needs_int4
def test_unmerged_logits_equal_the_float_reference_for_1_3_and_12_rows(tmp_path, monkeypatch) -> None:
    """The runner's logits (a prefill of 5, then steps of 1, 3 and 12 rows) against the student's own forward in
    float (int4 `weight_float` + scale B A: what the adapters trained on): equal within float32 tolerance where
    Int4Linear computes in float (the kernel switched off), and within the kernel's int8-input rounding with it.
    Negative control: the int4 runner without the adapter is far from the reference."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    V = 61
    hf = helpers.tiny_llama(3, V, hidden=64, layers=2, max_positions=256, tied=True)
    student = adapted(hf, tmp_path / "adapter")
    seq = torch.randint(0, V, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = student(input_ids=seq[None]).logits[0].double()

    def steps(runner) -> torch.Tensor:
        out, pos = [], 0
        for n in (5, 1, 3, 12):
            out.append(runner.forward(seq[pos:pos + n], pos))
            pos += n
        return torch.cat(out).double()

    kernel = steps(lora_draft(hf, tmp_path / "adapter"))
    plain = steps(make_runner(hf, 128, quantize="int4"))
    runner = lora_draft(hf, tmp_path / "adapter")
    assert sum(isinstance(m, LoraLinear) for m in runner.modules()) == 2 * 4  # qkv, o, gate_up, down a layer
    for m in runner.modules():
        if isinstance(m, Int4Linear):
            m._many_ok = False  # no fbgemm copy: weight_float itself
    monkeypatch.setattr(native, "kernels", lambda: None)
    floated = steps(runner)
    scale = float(ref.abs().max())
    assert (floated - ref).abs().max() <= 1e-5 * scale
    assert (kernel - ref).abs().max() <= 0.05 * scale and bool((kernel.argmax(-1) == ref.argmax(-1)).all())
    assert (plain - ref).abs().max() > 0.1 * scale


def test_a_bad_adapter_is_one_line(tmp_path) -> None:
    from safetensors.torch import save_file

    with pytest.raises(DraftsmithError, match="no LoRA adapter"):
        read_adapter(tmp_path / "none")
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    save_file({key.format(0, "A"): torch.ones(2, 32), key.format(0, "B"): torch.ones(32, 2)},
              str(folder / "adapter_model.safetensors"))
    adapter = read_adapter(folder)
    assert torch.equal(adapter.delta(0, "q"), torch.full((32, 32), 4.0))  # scale alpha / r = 2, times B A = 2
    runner = make_runner(helpers.tiny_llama(0, 40, layers=1), 32)
    assert isinstance(with_lora(runner, adapter).layers[0].q, LoraLinear)  # the float runner's own q
    for tensors, needle in (({key.format(0, "A"): torch.ones(2, 32)}, "needs lora_A"),
                            ({"base_model.model.lm_head.lora_A.weight": torch.ones(2, 32)}, "not on a decoder"),
                            ({key.format(5, "A"): torch.ones(2, 32), key.format(5, "B"): torch.ones(32, 2)},
                             "has layer 5"),
                            ({key.format(0, "A"): torch.ones(2, 64), key.format(0, "B"): torch.ones(32, 2)},
                             "(32, 64) in the adapter")):
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        with pytest.raises(DraftsmithError, match=re.escape(needle)) as e:
            with_lora(make_runner(helpers.tiny_llama(0, 40, layers=1), 32), read_adapter(folder))
        assert "\n" not in str(e.value)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(DraftsmithError, match="use_dora"):
        read_adapter(folder)


@needs_int4
@pytest.mark.parametrize("pruned", [False, True])
def test_greedy_with_an_int4_lora_draft_equals_the_target_alone(pruned: bool, tmp_path, monkeypatch) -> None:
    """Temperature 0: the target alone's tokens, at several K, with the int4 + LoRA draft of itself (mostly right)
    and of another model (mostly wrong), whole or pruned to 40 ids with context ids."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    V = 61
    hf = helpers.tiny_llama(9, V, hidden=64, max_positions=512)
    other = helpers.tiny_llama(10, V, hidden=64, layers=1, max_positions=512)
    adapted(hf, tmp_path / "self", b_scale=0.005)
    adapted(other, tmp_path / "other")
    target = make_runner(hf, 128)
    for prompt in ([5, 6], [1, 2, 3, 4, 9]):
        ref = generate(target, prompt, max_new_tokens=40).tokens
        for name, model in (("self", hf), ("other", other)):
            for k in (1, 3, 6):
                draft = lora_draft(model, tmp_path / name)
                if pruned:
                    draft = PrunedRunner(draft, torch.arange(40), context=True)
                out = generate(target, prompt, draft=draft, max_new_tokens=40, policy=KPolicy(k=k))
                assert out.tokens == ref, (name, prompt, k)
                if name == "self":
                    assert out.stats.accepted > out.stats.drafted / 4


LAW_V = 4  # tests.decode.test_speculative's law: every 3-token continuation over 4 ids
LAW_PARAMS = SamplingParams(0.9, top_k=3)  # drafted 3 at a time


def law_pair(tmp_path):
    target = helpers.tiny_llama(20, LAW_V, hidden=32, layers=1, head_scale=4.0)
    draft_hf = helpers.tiny_llama(21, LAW_V, hidden=32, layers=1, head_scale=4.0)
    adapted(draft_hf, tmp_path / "law")
    return target, make_runner(target, 32), lora_draft(draft_hf, tmp_path / "law", 32)


@needs_int4
def test_sampled_law_with_an_int4_lora_draft_is_the_targets(tmp_path, monkeypatch) -> None:
    """Chi-square over all 64 continuations, n = 3000 draws (the power is stated in tests.decode.test_speculative);
    the next test's control is the same test failing."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    hf, target, draft = law_pair(tmp_path)
    law, n = target_sequence_law(hf, [1, 3], LAW_PARAMS), 3000
    assert chi2_pvalue(sample_counts(target, draft, [1, 3], LAW_PARAMS, 3, n, seed=0), law, n) > 1e-3


@needs_int4
def test_a_verify_that_always_accepts_fails_the_law_test(tmp_path, monkeypatch) -> None:
    """Negative control: every drafted token kept (then the target's own next token) is the draft's law, not the
    target's, and the same chi-square test says so."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    hf, target, draft = law_pair(tmp_path)
    n, law = 1000, target_sequence_law(hf, [1, 3], LAW_PARAMS)
    monkeypatch.setattr(speculative, "verify", lambda p, q, drafts, g: (len(drafts), int(sample(p[len(drafts)], g))))
    assert chi2_pvalue(sample_counts(target, draft, [1, 3], LAW_PARAMS, 3, n, seed=0), law, n) < 1e-6
