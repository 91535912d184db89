"""Batched plain decoding: each row of a left-padded batch gets the very tokens that decoding it alone gives
(greedy and sampled, rows finishing at different steps, through the lean batch runner and through Hugging
Face's forward, and in a draft's int4 / int8 copy against that copy's single-sequence runner), the lean runner's
captured head features are the target's teacher-forced ones, and logits fitted to another vocabulary never let a
padded row be sampled."""

from __future__ import annotations

import pytest
import torch

from draftsmith.decode.batch import TargetVocab, decode_batch, generate_batch
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams, fit_vocab
from draftsmith.decode.speculative import generate
from tests import helpers

V, EOS = 12, 7  # a small vocabulary: sampled rows hit EOS at different steps


@pytest.fixture(scope="module")
def model():
    return helpers.tiny_llama(3, V, eos_id=EOS, layers=2)


PROMPTS = [[1], [4, 9, 11], [10, 3], [0, 1, 2, 3, 4], [2, 2]]  # different lengths: every batch is padded


def _alone(model, prompt: list[int], temperature: float, seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    return generate(make_runner(model, 64), prompt, max_new_tokens=n, sampling=SamplingParams(temperature),
                    eos_ids=[EOS], generator=gen).tokens


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_each_row_equals_its_decode_alone(model, temperature, lean) -> None:
    n = 20
    gens = [torch.Generator().manual_seed(100 + b) for b in range(len(PROMPTS))] if temperature else None
    rows = generate_batch(model, PROMPTS, max_new_tokens=n, sampling=SamplingParams(temperature), eos_ids=[EOS],
                          generators=gens, lean=lean)
    alone = [_alone(model, p, temperature, 100 + b, n) for b, p in enumerate(PROMPTS)]
    assert rows == alone
    assert all(1 <= len(r) <= n for r in rows)
    if temperature:  # the case that exercises rows leaving the batch: some stop at EOS, others run on
        assert min(len(r) for r in rows) < n == max(len(r) for r in rows)
        assert sum(r[-1] == EOS for r in rows) >= 1


def test_vocab_fit_cuts_or_pads_with_impossible_tokens() -> None:
    logits = torch.randn(2, 5, dtype=torch.float64)
    assert torch.equal(fit_vocab(logits, 5), logits)
    assert torch.equal(fit_vocab(logits, 3), logits[:, :3])
    padded = fit_vocab(logits, 8)
    assert padded.shape == (2, 8) and torch.equal(padded[:, :5], logits) and torch.isinf(padded[:, 5:]).all()
    assert torch.softmax(padded, -1)[:, 5:].sum() == 0  # padded rows have probability exactly 0

    runner = make_runner(helpers.tiny_llama(1, 12, eos_id=3), 16)
    wide = TargetVocab(runner, 15)
    out = wide.forward(torch.tensor([1, 2]), 0)
    assert out.shape[-1] == 15 and torch.isinf(out[..., 12:]).all()


def test_sampled_rows_stay_inside_a_smaller_target_vocabulary(model) -> None:
    gens = [torch.Generator().manual_seed(b) for b in range(3)]
    rows = generate_batch(model, PROMPTS[:3], max_new_tokens=30, sampling=SamplingParams(5.0), eos_ids=[EOS],
                          generators=gens, vocab_size=5)
    assert all(0 <= t < 5 for r in rows for t in r)


def test_bad_calls_are_refused(model) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(model, [[1], []], max_new_tokens=3, sampling=SamplingParams(0.0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_batch(model, [[1]], max_new_tokens=0, sampling=SamplingParams(0.0))
    with pytest.raises(ValueError, match="Generator"):
        generate_batch(model, [[1], [2]], max_new_tokens=3, sampling=SamplingParams(1.0))


def test_lean_batch_equals_alone_for_a_qwen2_with_biases() -> None:
    qwen = helpers.tiny_llama(5, V, eos_id=EOS, layers=2, arch="qwen2", dtype=torch.float64)
    gens = [torch.Generator().manual_seed(b) for b in range(len(PROMPTS))]
    rows = decode_batch(qwen, PROMPTS, max_new_tokens=12, sampling=SamplingParams(1.3), eos_ids=[EOS],
                        generators=gens).tokens
    assert rows == [_alone(qwen, p, 1.3, b, 12) for b, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("n", [1, 9])
def test_captured_features_are_the_targets_teacher_forced_ones(n) -> None:
    m = helpers.tiny_llama(4, V, eos_id=EOS, layers=3, dtype=torch.float64)
    gens = [torch.Generator().manual_seed(7 + b) for b in range(len(PROMPTS))]
    out = decode_batch(m, PROMPTS, max_new_tokens=n, sampling=SamplingParams(1.3), eos_ids=[EOS], generators=gens,
                       capture=(0, 2))
    assert len({len(t) for t in out.tokens}) > 1 or n == 1  # rows end at different steps: the batch compacts
    for b, p in enumerate(PROMPTS):
        seq = p + out.tokens[b]
        ref = m(input_ids=torch.tensor([seq]), output_hidden_states=True)
        hs = ref.hidden_states
        feats = torch.cat([hs[0][0], hs[2][0]], dim=-1)
        assert out.features[b].shape == feats.shape and out.final[b].shape == hs[-1][0].shape
        torch.testing.assert_close(out.features[b].double(), feats, rtol=2e-3, atol=2e-3)  # stored as float16
        torch.testing.assert_close(out.final[b].double(), hs[-1][0], rtol=2e-3, atol=2e-3)
        assert out.next[b].tolist() == ref.logits[0].argmax(-1).tolist()


class _Clock:
    """A fake `time` whose perf_counter reads 1, 2, 3, ... (one tick per call)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1
        return self.now


@pytest.mark.parametrize("capture", [(), (0, 2)])
def test_a_deadline_cuts_each_row_short_without_changing_a_token(monkeypatch, capture) -> None:
    """At the deadline the rows still sampling stop: each is a prefix of its row without one (rows ended by EOS
    before stay whole), and with capture the features are still the teacher-forced ones of what was kept."""
    import draftsmith.decode.batch as batch

    m = helpers.tiny_llama(4, V, eos_id=EOS, layers=3, dtype=torch.float64)

    def run(deadline):
        gens = [torch.Generator().manual_seed(7 + b) for b in range(len(PROMPTS))]
        return decode_batch(m, PROMPTS, max_new_tokens=12, sampling=SamplingParams(1.3), eos_ids=[EOS],
                            generators=gens, capture=capture, deadline=deadline)

    whole = run(None)
    assert not whole.halted and not run(float("inf")).halted and run(float("inf")).tokens == whole.tokens
    monkeypatch.setattr(batch, "time", _Clock())
    cut = run(3.0)  # the clock reaches 3 after the third token: rows still sampling then stop there
    assert cut.halted
    for full, short in zip(whole.tokens, cut.tokens):
        assert short == full[: len(short)] and len(short) == min(3, len(full))
    assert any(len(full) > 3 for full in whole.tokens)  # the deadline did cut something
    for b, p in enumerate(PROMPTS if capture else []):
        ref = m(input_ids=torch.tensor([p + cut.tokens[b]]), output_hidden_states=True)
        feats = torch.cat([ref.hidden_states[0][0], ref.hidden_states[2][0]], dim=-1)
        torch.testing.assert_close(cut.features[b].double(), feats, rtol=2e-3, atol=2e-3)
        assert cut.next[b].tolist() == ref.logits[0].argmax(-1).tolist()


def test_capture_layers_outside_the_model_are_refused(model) -> None:
    with pytest.raises(ValueError, match="capture layer 5"):
        decode_batch(model, [[1]], max_new_tokens=2, sampling=SamplingParams(0.0), capture=(0, 5))


SAMPLES = [[4, 9, 11], [1], [4, 9, 11], [0, 1, 2, 3, 4], [4, 9, 11], [1]]  # samples of one prompt share a prefill


def test_samples_of_one_prompt_share_its_prefill_and_each_equals_its_decode_alone(model) -> None:
    n = 20
    gens = [torch.Generator().manual_seed(300 + b) for b in range(len(SAMPLES))]
    rows = generate_batch(model, SAMPLES, max_new_tokens=n, sampling=SamplingParams(1.3), eos_ids=[EOS],
                          generators=gens, lean=True)
    assert rows == [_alone(model, p, 1.3, 300 + b, n) for b, p in enumerate(SAMPLES)]
    assert rows[0] != rows[2] or rows[2] != rows[4]  # the samples differ: each row drew with its own generator
    m = helpers.tiny_llama(4, V, eos_id=EOS, layers=3, dtype=torch.float64)
    gens = [torch.Generator().manual_seed(7 + b) for b in range(len(SAMPLES))]
    out = decode_batch(m, SAMPLES, max_new_tokens=6, sampling=SamplingParams(1.3), eos_ids=[EOS], generators=gens,
                       capture=(0, 2))
    for b, p in enumerate(SAMPLES):
        seq = p + out.tokens[b]
        ref = m(input_ids=torch.tensor([seq]), output_hidden_states=True)
        feats = torch.cat([ref.hidden_states[0][0], ref.hidden_states[2][0]], dim=-1)
        torch.testing.assert_close(out.features[b].double(), feats, rtol=2e-3, atol=2e-3)
        assert out.next[b].tolist() == ref.logits[0].argmax(-1).tolist()


def test_bfloat16_one_token_attention_matches_a_float64_reference_and_ignores_columns_past_the_end() -> None:
    from draftsmith.decode.batch import _attend

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, D, end = 5, 6, 2, 12, 16, 9
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    mask = torch.rand(B, 1, 1, end, generator=g) > 0.3
    mask[..., 0] = True  # every row sees at least one key
    ref = torch.nn.functional.scaled_dot_product_attention(  # float64, kv heads repeated as HF's repeat_kv does
        q.double(), k[:, :, :end].double().repeat_interleave(H // Hkv, 1),
        v[:, :, :end].double().repeat_interleave(H // Hkv, 1), attn_mask=mask)
    kb, vb = k.bfloat16(), v.bfloat16()
    got = _attend(q.bfloat16(), kb, vb, end, mask)
    torch.testing.assert_close(got.double(), ref, rtol=0.05, atol=0.05)
    kb[:, :, end:], vb[:, :, end:] = 1e4, -1e4  # what lies past the end cannot leak in
    torch.testing.assert_close(_attend(q.bfloat16(), kb, vb, end, mask), got, rtol=0, atol=0)
    wrong = _attend(q.bfloat16(), kb.flip(1), vb.flip(1), end, mask)  # kv heads paired with the wrong queries
    assert (wrong.double() - ref).abs().max() > 0.1


def _needs(quant: str) -> None:
    from draftsmith.decode.runtime import native
    from draftsmith.decode.runtime.quant import int4_ok

    if native.kernels() is None or (quant == "int4" and not int4_ok()):
        pytest.skip(f"no draftsmith {quant} kernel here: {native.why_not()}")


def _alone_quantized(model, quant: str, prompt: list[int], temperature: float, seed: int, n: int) -> list[int]:
    """The single-sequence runner of the same int4 / int8 copy decoding `prompt` alone. The int8 one runs its few-row
    forwards on draftsmith's kernel as the batch does (its row plan gives them to fbgemm on some machines, which
    quantises the inputs: another copy's numbers)."""
    runner = make_runner(model, 64, quantize=quant)
    if quant == "int8":
        runner.native_rows = frozenset(range(1, 13))
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    return generate(runner, prompt, max_new_tokens=n, sampling=SamplingParams(temperature), eos_ids=[EOS],
                    generator=gen).tokens


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_a_quantized_copys_rows_equal_that_copy_decoding_each_alone(model, quant, temperature) -> None:
    """The draft's int4 / int8 copy writing many rows at once (BatchLM on the copy's fused, quantised Linears):
    each row is what the single-sequence runner of that copy (`make_runner(..., quantize=...)`) decodes for it,
    with the same generator; rows finish at different steps and leave the batch."""
    from draftsmith.decode.batch import quantized_writer
    from draftsmith.decode.runtime.kernels import DYNAMIC_INT8
    from draftsmith.decode.runtime.quant import Int4Linear

    _needs(quant)
    n = 20
    writer = quantized_writer(model, quant, 64)
    kinds = {type(m) for m in [*writer.layers.modules(), writer.lm_head]}
    assert torch.nn.Linear not in kinds  # every Linear, the head's too, is the quantised copy's
    assert kinds & {Int4Linear, DYNAMIC_INT8} == {Int4Linear if quant == "int4" else DYNAMIC_INT8}
    gens = [torch.Generator().manual_seed(100 + b) for b in range(len(PROMPTS))] if temperature else None
    rows = generate_batch(writer, PROMPTS, max_new_tokens=n, sampling=SamplingParams(temperature), eos_ids=[EOS],
                          generators=gens)
    assert rows == [_alone_quantized(model, quant, p, temperature, 100 + b, n) for b, p in enumerate(PROMPTS)]
    if temperature:  # rows left the batch at different steps
        assert min(len(r) for r in rows) < n == max(len(r) for r in rows)
    samples = [torch.Generator().manual_seed(300 + b) for b in range(len(SAMPLES))] if temperature else None
    shared = generate_batch(writer, SAMPLES, max_new_tokens=8, sampling=SamplingParams(temperature), eos_ids=[EOS],
                            generators=samples)  # samples of one prompt share its prefill
    assert shared == [_alone_quantized(model, quant, p, temperature, 300 + b, 8) for b, p in enumerate(SAMPLES)]


def test_a_quantized_copy_is_made_once_per_model_and_weights(model) -> None:
    """The last copy made for a model is reused while its weights are unchanged and it holds the positions asked
    for; a changed weight (an optimizer step, in place) makes a new one."""
    from draftsmith.decode.batch import quantized_writer

    _needs("int4")
    m = helpers.tiny_llama(3, V, eos_id=EOS, layers=2)
    first = quantized_writer(m, "int4", 32)
    assert quantized_writer(m, "int4", 16) is first and quantized_writer(m, "int4", 32) is first
    longer = quantized_writer(m, "int4", 48)
    assert longer is not first and longer.max_seq_len == 48
    assert quantized_writer(m, "int8", 48) is not longer
    again = quantized_writer(m, "int4", 48)
    with torch.no_grad():
        m.lm_head.weight.add_(1.0)
    assert quantized_writer(m, "int4", 48) is not again
    with pytest.raises(ValueError, match="quantize must be"):
        quantized_writer(m, "int3", 48)


def test_which_copy_a_model_writes_in(model, monkeypatch) -> None:
    """int4 where draftsmith's int4 kernel runs (else int8), int8 only where its kernel is built (fbgemm would share one
    input scale across the batch's rows), never for a model the CPU kernels do not take (float64 here)."""
    from draftsmith.decode.batch import writer_quant
    from draftsmith.decode.runtime import native

    _needs("int4")
    assert writer_quant(model, "int4") == "int4" and writer_quant(model, "int8") == "int8"
    assert writer_quant(model, None) is None
    assert writer_quant(helpers.tiny_llama(3, V, eos_id=EOS, dtype=torch.float64), "int4") is None
    with pytest.raises(ValueError, match="quantisation"):
        writer_quant(model, "fp8")
    monkeypatch.setattr(native, "kernels", lambda: None)
    assert writer_quant(model, "int4") is None and writer_quant(model, "int8") is None


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_quantized_copys_logits_are_its_runners_bit_for_bit(model, quant, monkeypatch) -> None:
    """Every logit a row of the batch samples from has the very bits the copy's runner gives when it decodes that
    row alone (`decode.speculative.generate`'s feeding: the prompt but its last token, then a token a forward):
    prompts prefilled unpadded, one new token attending over its own row's keys, so no summation order differs
    and no int8 input rounds otherwise. Sampled rows of different lengths, so the batch pads and compacts."""
    import draftsmith.decode.batch as batch
    from draftsmith.decode.batch import decode_batch, quantized_writer

    _needs(quant)
    seen: dict[int, list[torch.Tensor]] = {b: [] for b in range(len(PROMPTS))}
    sample = batch._BatchDecode.sample

    def record(self, logits):
        for j, b in enumerate(self.rows):
            if self.alive[b]:
                seen[b].append(logits[j].clone())
        return sample(self, logits)

    monkeypatch.setattr(batch._BatchDecode, "sample", record)
    gens = [torch.Generator().manual_seed(40 + b) for b in range(len(PROMPTS))]
    out = decode_batch(quantized_writer(model, quant, 64), PROMPTS, max_new_tokens=12, sampling=SamplingParams(1.3),
                       eos_ids=[EOS], generators=gens)
    assert min(len(t) for t in out.tokens) < 12  # some rows left the batch early
    for b, p in enumerate(PROMPTS):
        runner = make_runner(model, 64, quantize=quant)
        runner.native_rows = frozenset(range(1, 13)) if quant == "int8" else runner.native_rows
        seq = p + out.tokens[b]
        with torch.inference_mode():
            if len(p) > 1:
                runner.forward(torch.tensor(p[:-1]), 0, keep=1)
            alone = [runner.forward(torch.tensor([seq[t]]), t)[-1] for t in range(len(p) - 1, len(seq) - 1)]
        assert len(alone) == len(seen[b]) and all(torch.equal(a, s) for a, s in zip(alone, seen[b])), b
