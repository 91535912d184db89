"""The decoder's contract on tiny random-init models: exact greedy, exact distribution, rollback."""

import itertools

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.lean import LeanLM
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.speculative import KPolicy, Stats, generate
from tests import helpers

SLOW = pytest.mark.slow  # the default suite keeps one case of each law; `pytest -m slow` runs the rest


def tiny_hf(seed: int, vocab: int = 61, layers: int = 2, dtype=torch.float64, arch: str = "llama", scale: float = 1.0):
    """`scale` > 1 sharpens the distributions: more structure for the tests to see."""
    return helpers.tiny_llama(seed, vocab, layers=layers, max_positions=512, head_scale=scale, arch=arch, dtype=dtype)


class Disagree:
    """A draft whose argmax is never the target's: wraps a copy of the target and shifts its logits by one id."""

    def __init__(self, runner) -> None:
        self.runner, self.vocab_size, self.max_seq_len = runner, runner.vocab_size, runner.max_seq_len

    def forward(self, tokens, pos, keep=0):
        return torch.roll(self.runner.forward(tokens, pos, keep), 1, dims=-1)


PROMPTS = [[1, 5, 7, 9], [3], [2, 2, 2, 2, 2, 2, 8]]


@pytest.mark.parametrize("seed,vocab", [(0, 61), (1, 7), (2, 300)])
def test_greedy_equals_target_greedy_for_every_k(seed: int, vocab: int) -> None:
    target_hf = tiny_hf(seed, vocab)
    target = make_runner(target_hf, 128)
    drafts = {
        "other": make_runner(tiny_hf(seed + 100, vocab, layers=1), 128),
        "same": make_runner(target_hf, 128),
        "disagree": Disagree(make_runner(target_hf, 128)),
    }
    for prompt in PROMPTS:
        prompt = [t % vocab for t in prompt]
        ref = generate(target, prompt, max_new_tokens=30).tokens
        assert len(ref) == 30
        for (name, draft), k in itertools.product(drafts.items(), range(1, 9)):
            out = generate(target, prompt, draft=draft, max_new_tokens=30, policy=KPolicy(k=k))
            assert out.tokens == ref, (name, k, prompt)
            if name == "same":
                assert out.stats.acceptance_rate == 1.0
            if name == "disagree":
                assert out.stats.accepted == 0
        for policy in (KPolicy(k=2, dynamic=True), KPolicy(k=4, dynamic=True, confidence=0.5)):
            assert generate(target, prompt, draft=drafts["other"], max_new_tokens=30, policy=policy).tokens == ref


def test_full_acceptance_gives_tau_k_plus_1() -> None:
    hf = tiny_hf(3)
    out = generate(make_runner(hf, 128), [1, 2], draft=make_runner(hf, 128), max_new_tokens=41, policy=KPolicy(k=4))
    assert out.stats.tau_hist == {5: 8, 1: 1} or out.stats.tau_hist == {1: 1, 5: 8}
    assert out.stats.mean_tau == pytest.approx(41 / 9)


def test_dynamic_k_grows_on_full_acceptance() -> None:
    hf = tiny_hf(4)
    out = generate(make_runner(hf, 256), [1], draft=make_runner(hf, 256), max_new_tokens=60,
                   policy=KPolicy(k=1, dynamic=True, k_max=9))
    assert max(out.stats.tau_hist) == 10  # grew 1 -> 3 -> 5 -> 7 -> 9


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_runner_and_lean_runner_agree_and_mix(arch: str) -> None:
    t_hf, d_hf = tiny_hf(5, arch=arch), tiny_hf(6, arch=arch, layers=1)
    ref = generate(make_runner(t_hf, 128, lean=False), [4, 4, 1], max_new_tokens=30).tokens
    assert generate(make_runner(t_hf, 128), [4, 4, 1], max_new_tokens=30).tokens == ref
    for t_lean, d_lean in itertools.product([True, False], repeat=2):
        out = generate(make_runner(t_hf, 128, lean=t_lean), [4, 4, 1], draft=make_runner(d_hf, 128, lean=d_lean),
                       max_new_tokens=30, policy=KPolicy(k=3))
        assert out.tokens == ref


def test_vocab_padding_rows_either_way() -> None:
    target_hf = tiny_hf(7, vocab=61)
    target = make_runner(target_hf, 128)
    ref = generate(target, [1, 2, 3], max_new_tokens=30).tokens
    for v in (64, 59):
        draft = make_runner(tiny_hf(8, vocab=v), 128)
        assert generate(target, [1, 2, 3], draft=draft, max_new_tokens=30, policy=KPolicy(k=3)).tokens == ref


def test_int8_draft_stays_exact() -> None:
    target = make_runner(tiny_hf(9, dtype=torch.float32), 128)
    draft = make_runner(tiny_hf(9, dtype=torch.float32), 128, quantize="int8")
    ref = generate(target, [5, 6], max_new_tokens=40).tokens
    out = generate(target, [5, 6], draft=draft, max_new_tokens=40, policy=KPolicy(k=4))
    assert out.tokens == ref
    assert out.stats.accepted > 0


def test_eos_and_budget_truncate_like_the_target() -> None:
    t_hf = tiny_hf(10)
    target, draft = make_runner(t_hf, 128), make_runner(tiny_hf(11, layers=1), 128)
    ref = generate(target, [1, 9], max_new_tokens=40).tokens
    eos = ref[17]
    cut = ref[: ref.index(eos) + 1]
    assert generate(target, [1, 9], max_new_tokens=40, eos_ids=[eos]).tokens == cut
    for k in (1, 3, 8):
        assert generate(target, [1, 9], draft=draft, max_new_tokens=40, eos_ids=[eos], policy=KPolicy(k=k)).tokens == cut
        assert generate(target, [1, 9], draft=draft, max_new_tokens=7, policy=KPolicy(k=k)).tokens == ref[:7]


def test_rollback_caches_equal_a_fresh_forward_over_the_accepted_prefix() -> None:
    t_hf, d_hf = tiny_hf(12), tiny_hf(12)
    with torch.no_grad():  # a draft that agrees often but not always
        d_hf.lm_head.weight.add_(torch.randn_like(d_hf.lm_head.weight) * 0.02)
    target, draft = LeanLM(t_hf, 128), LeanLM(d_hf, 128)
    prompt = [1, 2, 3]
    out = generate(target, prompt, draft=draft, max_new_tokens=50, policy=KPolicy(k=6))
    assert 0 < out.stats.accepted < out.stats.drafted  # there were rejections to roll back
    seq = prompt + out.tokens
    for runner, hf in ((target, t_hf), (draft, d_hf)):
        fresh = LeanLM(hf, 128)
        fresh.forward(torch.tensor(seq[:-1]), 0)
        n = len(seq) - 2  # both caches hold at least seq[:-2] (the draft may lag one token)
        assert torch.allclose(runner.cache.k[:, :, :n], fresh.cache.k[:, :, :n], atol=1e-12, rtol=0)
        assert torch.allclose(runner.cache.v[:, :, :n], fresh.cache.v[:, :, :n], atol=1e-12, rtol=0)


def test_static_forward_equals_dynamic_forward() -> None:
    hf = tiny_hf(14)
    a, b = LeanLM(hf, 64), LeanLM(hf, 64)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    la = torch.cat([a.forward(ids[:5], 0), a.forward(ids[5:], 5)])
    lb = torch.cat([b.forward_static(ids[:5], torch.arange(5)), b.forward_static(ids[5:], torch.arange(5, 8))])
    assert torch.allclose(la, lb, atol=1e-12)


# --- temperature > 0: the output distribution is the target's -------------------------------------

V, N_NEW = 4, 3


def target_sequence_law(hf, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact probability of every length-3 continuation under the target, by enumeration."""
    from draftsmith.decode.sampling import to_probs

    law = {}
    for seq in itertools.product(range(V), repeat=N_NEW):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            logits = hf(ids).logits[0]
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= float(to_probs(logits[len(prompt) - 1 + i], params)[tok])
        law[seq] = prob
    return law


def chi2_pvalue(counts: dict, law: dict, n: int) -> float:
    if any(counts.get(s, 0) for s, p in law.items() if p == 0.0) or set(counts) - set(law):
        return 0.0  # a continuation the target can never produce: certainly wrong
    cells = [(counts.get(s, 0), p * n) for s, p in law.items() if p > 0.0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def sample_counts(target, draft, prompt, params, k, n, seed) -> dict:
    g = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(n):
        out = generate(target, prompt, draft=draft, max_new_tokens=N_NEW, sampling=params, policy=KPolicy(k=k), generator=g)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    return counts


@pytest.mark.parametrize("params,k", [(SamplingParams(1.0), 2), pytest.param(SamplingParams(0.8, top_k=3), 3, marks=SLOW),
                                      pytest.param(SamplingParams(1.2, top_p=0.9), 1, marks=SLOW)])
def test_sampled_output_law_equals_target_law(params: SamplingParams, k: int) -> None:
    """Chi-square over all 64 continuations, n = 3000 draws.

    Power, stated: with 64 cells and n = 3000 the test at level 1e-3 detects a total-variation error of
    0.1 with power > 0.99; the negative control below (the draft's own samples, always accepted) is
    off by far more and must be rejected by the same test, so this test can fail.
    """
    t_hf, d_hf = tiny_hf(20, vocab=V, layers=1, scale=8.0), tiny_hf(21, vocab=V, layers=1, scale=8.0)
    target, draft = make_runner(t_hf, 32), make_runner(d_hf, 32)
    prompt = [1, 3]
    law = target_sequence_law(t_hf, prompt, params)
    n = 3000
    assert chi2_pvalue(sample_counts(target, draft, prompt, params, k, n, seed=0), law, n) > 1e-3
    # negative control: sampling the draft alone (what a decoder that never rejects would emit)
    bad = sample_counts(draft, None, prompt, params, k, n, seed=0)
    assert chi2_pvalue(bad, law, n) < 1e-6


def test_same_seed_same_output_and_greedy_ignores_the_seed() -> None:
    target, draft = make_runner(tiny_hf(30), 128), make_runner(tiny_hf(31, layers=1), 128)
    params = SamplingParams(1.0)
    runs = [generate(target, [1, 2], draft=draft, max_new_tokens=30, sampling=params,
                     generator=torch.Generator().manual_seed(s)).tokens for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]
    g = torch.Generator().manual_seed(5)
    state = g.get_state().clone()
    greedy = generate(target, [1, 2], draft=draft, max_new_tokens=30, generator=g).tokens
    assert torch.equal(g.get_state(), state)  # temperature 0 drew no random number
    assert greedy == generate(target, [1, 2], max_new_tokens=30).tokens


def test_stats_merge_and_dict() -> None:
    a = Stats({1: 2, 3: 1}, drafted=6, accepted=2, new_tokens=5, seconds=1.0)
    b = Stats({3: 1}, drafted=2, accepted=2, new_tokens=3, seconds=1.0)
    m = a.merge(b)
    assert m.tau_hist == {1: 2, 3: 2} and m.new_tokens == 8 and m.tokens_per_s == 4.0
    assert m.mean_tau == pytest.approx(2.0) and m.acceptance_rate == pytest.approx(0.5)
    assert "tau_definition" in m.to_dict()


def test_bad_arguments() -> None:
    target = make_runner(tiny_hf(40), 16)
    with pytest.raises(ValueError, match="at least one token"):
        generate(target, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="cache holds"):
        generate(target, [1] * 10, max_new_tokens=10)
    with pytest.raises(ValueError, match="Generator"):
        generate(target, [1], max_new_tokens=4, sampling=SamplingParams(1.0))
    with pytest.raises(ValueError):
        KPolicy(k=0)


def test_bad_arguments_are_one_line_draftsmith_errors() -> None:
    """What the user gives wrong (prompt, budget, cache, sampling, policy) is the project's error, in one line."""
    target = make_runner(tiny_hf(40), 16)
    calls = {
        "at least one token": lambda: generate(target, [], max_new_tokens=4),
        "max_new_tokens must be >= 1, got 0": lambda: generate(target, [1], max_new_tokens=0),
        "target cache holds 16 positions, this call needs 20": lambda: generate(target, [1] * 10, max_new_tokens=10),
        "Generator": lambda: generate(target, [1], max_new_tokens=4, sampling=SamplingParams(1.0)),
        "k_min <= k": lambda: KPolicy(k=0),
        "confidence must be": lambda: KPolicy(confidence=1.0),
        "siblings must be 0": lambda: KPolicy(confidence=0.5, siblings=1),
        "needs a confidence threshold": lambda: KPolicy(siblings=2),
        "sibling_depth must be": lambda: KPolicy(sibling_depth=2),
    }
    for needle, call in calls.items():
        with pytest.raises(DraftsmithError, match=needle) as e:
            call()
        assert "\n" not in str(e.value), needle
