"""Batched plain decoding: each row of a left-padded batch gets the very tokens that decoding it alone gives
(greedy and sampled, rows finishing at different steps), and logits fitted to another vocabulary never let a
padded row be sampled."""

from __future__ import annotations

import pytest
import torch

from decode.batch import TargetVocab, generate_batch
from decode.model import make_runner
from decode.sampling import SamplingParams, fit_vocab
from decode.speculative import generate
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


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_each_row_equals_its_decode_alone(model, temperature) -> None:
    n = 20
    gens = [torch.Generator().manual_seed(100 + b) for b in range(len(PROMPTS))] if temperature else None
    rows = generate_batch(model, PROMPTS, max_new_tokens=n, sampling=SamplingParams(temperature), eos_ids=[EOS],
                          generators=gens)
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
