"""Vocabulary-pruned drafts on tiny random-init models: the cut head computes N rows and gives the whole head's
logits on them; decoding with a pruned draft stays exact (greedy token for token, the sampled law by exact
enumeration and by a chi-square test), and broken variants fail the same checks."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import draftsmith.decode.sampling
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.head import vocab_map
from draftsmith.decode.pruned import PrunedRunner, coverage_size, restrict_logits, seen_ids, vocab_ids
from draftsmith.decode.runtime.runner import HFRunner, make_runner
from draftsmith.decode.sampling import SamplingParams, accept_probability, residual, to_probs
from draftsmith.decode.speculative import KPolicy, generate
from tests.decode.test_speculative import chi2_pvalue, sample_counts, target_sequence_law, tiny_hf

SLOW = pytest.mark.slow  # the default suite keeps one case of each law; `pytest -m slow` runs the rest

# --- choosing N: coverage against brute force -------------------------------------------------------------------


def brute_coverage_size(counts: list[int], coverage: float) -> int:
    """The smallest n whose n largest counts hold `coverage` of the total, by trying every n (float64)."""
    ranked, total = sorted(counts, reverse=True), sum(counts)
    return next(n for n in range(1, len(counts) + 1) if sum(ranked[:n]) / total >= coverage)


@pytest.mark.parametrize("seed", range(6))
def test_coverage_size_equals_brute_force(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    V = int(torch.randint(1, 60, (1,), generator=g))
    counts = torch.randint(0, 6, (V,), generator=g) ** 2  # zeros and ties
    counts[int(torch.randint(0, V, (1,), generator=g))] += 1  # never all zero
    for coverage in (1e-9, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 0.999999, 1.0):
        assert coverage_size(counts, coverage) == brute_coverage_size(counts.tolist(), coverage), coverage


def test_coverage_size_at_exact_shares_and_its_errors() -> None:
    counts = torch.tensor([1, 3, 0, 6])  # shares 0.6, 0.9, 1.0
    assert [coverage_size(counts, c) for c in (0.6, 0.61, 0.9, 0.91, 1.0)] == [1, 2, 2, 3, 3]
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(DraftsmithError, match="coverage must be in"):
            coverage_size(counts, bad)
    for bad in (torch.zeros(5), torch.tensor([1, -2, 3])):
        with pytest.raises(DraftsmithError, match="token counts"):
            coverage_size(bad, 0.5)


def test_vocab_ids_are_the_heads_vocab_map() -> None:
    counts = torch.tensor([5, 9, 9, 0, 2, 9, 1])
    d2t, t2d = vocab_map(counts, 4)
    assert vocab_ids(counts, 4).tolist() == [0, 1, 2, 5] == (d2t + torch.arange(4)).tolist()
    assert t2d.nonzero().flatten().tolist() == [0, 1, 2, 5]


# --- the cut head -----------------------------------------------------------------------------------------------

KEPT = torch.tensor([0, 3, 5, 9, 10, 20, 33, 60])


def runners(hf, quantize=None, lean=None):
    """(the whole draft, the pruned draft) over one HF model."""
    return (make_runner(hf, 64, lean=lean, quantize=quantize),
            PrunedRunner(make_runner(hf, 64, lean=lean, quantize=quantize), KEPT))


@pytest.mark.parametrize("dtype,lean,quantize", [(torch.float64, True, None), (torch.float64, False, None),
                                                 (torch.float32, True, None), (torch.float32, True, "int8"),
                                                 (torch.float32, False, None)])
def test_pruned_logits_are_the_whole_heads_on_the_kept_ids(dtype, lean: bool, quantize) -> None:
    hf = tiny_hf(0, vocab=61, dtype=dtype)
    whole, pruned = runners(hf, quantize, lean)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for tokens, pos, keep in ((torch.tensor([1, 2, 3, 4]), 0, 0), (torch.tensor([7]), 4, 1),
                              (torch.tensor([8, 9]), 2, 1)):  # the last one rolls the cache back
        a, b = whole.forward(tokens, pos, keep), pruned.forward(tokens, pos, keep)
        assert b.shape == a.shape and b.dtype == a.dtype
        assert torch.allclose(b[:, KEPT], a[:, KEPT], atol=tol, rtol=0)
        assert torch.equal(torch.isinf(b), restrict_logits(a, KEPT).isinf()) and bool((b[:, KEPT] > -1e30).all())
    assert hf.get_output_embeddings().weight.shape[0] == 61  # the model itself keeps its whole head


def test_a_soft_capped_model_on_the_generic_runner_keeps_minus_inf_outside() -> None:
    """Gemma soft-caps its logits after the head: the cut head runs inside the model's own forward, and the
    scatter comes after it, so q stays 0 outside the kept ids."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                           final_logit_softcapping=0.5, sliding_window=16)
    hf = Gemma3ForCausalLM(cfg).eval()
    whole, pruned = runners(hf)
    assert isinstance(whole, HFRunner)
    a, b = whole.forward(torch.tensor([1, 2, 3]), 0), pruned.forward(torch.tensor([1, 2, 3]), 0)
    assert a.abs().max() <= 0.5  # capped
    assert torch.allclose(b[:, KEPT], a[:, KEPT], atol=1e-6, rtol=0) and int(b.isinf().sum()) == 3 * (61 - 8)


# --- context ids: the kept ids and every id the draft has read ----------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_seen_ids_and_restrict_with_context_equal_brute_force(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    V, L, T = 23, 17, 6
    context = torch.randint(0, V, (L,), generator=g)
    ids = torch.randperm(V, generator=g)[:5].sort().values
    extra, first = seen_ids(context, ids)
    brute = {}
    for i, t in enumerate(context.tolist()):
        if t not in ids.tolist() and t not in brute:
            brute[t] = i
    assert extra.tolist() == sorted(brute) and first.tolist() == [brute[t] for t in sorted(brute)]
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    at = torch.randint(0, L, (T,), generator=g)
    out = restrict_logits(logits, ids, context=context, at=at)
    for t in range(T):
        allowed = set(ids.tolist()) | set(context[: int(at[t]) + 1].tolist())
        for v in range(V):
            assert out[t, v] == (logits[t, v] if v in allowed else float("-inf"))


@pytest.mark.parametrize("lean,quantize", [(True, None), (False, None), (True, "int8")])
def test_context_logits_are_the_whole_heads_on_what_each_row_has_read(lean: bool, quantize) -> None:
    """Forwards of 4, 1 and 2 tokens (the last rolls back): row t's logits are the whole head's on the kept ids
    and the ids of the tokens read up to it, -inf elsewhere; rolled-back tokens are forgotten."""
    dtype = torch.float32 if quantize else torch.float64
    hf = tiny_hf(7, vocab=61, dtype=dtype)
    whole = make_runner(hf, 64, lean=lean, quantize=quantize)
    pruned = PrunedRunner(make_runner(hf, 64, lean=lean, quantize=quantize), KEPT, context=True)
    # int8: the kept logits come from the int8 kernel in both; the context ones from dequantised rows (float h)
    tol = 0.05 if quantize else 1e-12
    seq = torch.zeros(64, dtype=torch.long)
    for tokens, pos, keep in ((torch.tensor([1, 2, 3, 40]), 0, 0), (torch.tensor([7]), 4, 1),
                              (torch.tensor([8, 50]), 2, 0)):
        a, b = whole.forward(tokens, pos, keep), pruned.forward(tokens, pos, keep)
        seq[pos : pos + len(tokens)] = tokens
        end = pos + len(tokens)
        want = restrict_logits(a, KEPT, context=seq[:end], at=torch.arange(end - a.shape[0], end))
        assert torch.equal(b.isinf(), want.isinf())
        assert torch.allclose(b[~b.isinf()], want[~want.isinf()], atol=tol, rtol=0)
    assert not b[:, 3].isinf().any() and b[0, 50].isinf() and not b[1, 50].isinf()  # 3 read at 2, 50 at 3
    assert b[:, 40].isinf().all()  # 40 was read at 3, then rolled back


@pytest.mark.parametrize("seed", range(3))
def test_context_ids_kept_step_by_step_equal_recounting_the_sequence(seed: int) -> None:
    """The ids read so far are kept up to date forward by forward (`_seen`): over random forwards that go on, roll
    back a few positions or rewrite from the start, each row proposes exactly what `restrict_logits` allows given
    everything read up to it (ids first read in rolled-back positions forgotten, read again when rewritten)."""
    g = torch.Generator().manual_seed(seed)
    hf = tiny_hf(7, vocab=61, dtype=torch.float64)
    whole = make_runner(hf, 64, lean=True)
    pruned = PrunedRunner(make_runner(hf, 64, lean=True), KEPT, context=True)
    seq, end = torch.zeros(64, dtype=torch.long), 0
    for step in range(40):
        pos = 0 if step == 25 else max(0, end - int(torch.randint(0, 4, (1,), generator=g)))
        tokens = torch.randint(0, 61, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
        if pos + len(tokens) > 60:
            pos = 0
        a, b = whole.forward(tokens, pos), pruned.forward(tokens, pos)
        seq[pos : pos + len(tokens)] = tokens
        end = pos + len(tokens)
        want = restrict_logits(a, KEPT, context=seq[:end], at=torch.arange(pos, end))
        assert torch.equal(b.isinf(), want.isinf()), step


def head_shape(head) -> tuple[int, ...]:
    return tuple((head.weight() if callable(head.weight) else head.weight).shape)


@pytest.mark.parametrize("lean,quantize", [(True, None), (True, "int8"), (False, None)])
def test_the_cut_head_has_n_rows(lean: bool, quantize) -> None:
    hf = tiny_hf(1, vocab=61, dtype=torch.float32)
    _, pruned = runners(hf, quantize, lean)
    assert head_shape(pruned.head) == (len(KEPT), 32)
    assert pruned.inner.vocab_size == len(KEPT) and pruned.vocab_size == 61


@pytest.mark.parametrize("lean", [True, False])
def test_a_pruned_step_saves_exactly_the_cut_rows_flops(lean: bool) -> None:
    """Counted matmul FLOPs of one forward (float64: plain matmuls, which the counter sees): the pruned draft does
    2 * d * (V - N) * T fewer, the cut rows and nothing else."""
    V, d, T = 300, 32, 3
    hf = tiny_hf(2, vocab=V)
    whole, pruned = runners(hf, lean=lean)
    flops = []
    for runner in (whole, pruned):
        with FlopCounterMode(display=False) as counter:
            runner.forward(torch.tensor([1, 2, 3]), 0)
        flops.append(counter.get_total_flops())
    assert flops[0] - flops[1] == 2 * d * (V - len(KEPT)) * T


def test_pruned_runner_refuses_bad_ids_and_runners() -> None:
    hf = tiny_hf(3, vocab=61)
    for ids, needle in ((torch.tensor([], dtype=torch.long), "at least one"), (torch.tensor([0, 61]), r"\[0, 61\)"),
                        (torch.tensor([-1, 2]), r"\[0, 61\)"), (torch.tensor([4, 4]), "distinct")):
        with pytest.raises(DraftsmithError, match=needle):
            PrunedRunner(make_runner(hf, 16), ids)

    class Other:
        vocab_size, max_seq_len = 61, 16

    with pytest.raises(DraftsmithError, match="cannot prune the vocabulary of a Other draft"):
        PrunedRunner(Other(), KEPT)


# --- temperature 0: the target's own greedy tokens --------------------------------------------------------------


def test_greedy_equals_the_target_even_where_its_token_is_outside_the_kept_ids() -> None:
    """The draft is the target itself, pruned to the ids the target writes most often less two it does write:
    where the target's token is outside the kept ids the draft is always wrong, and the output must still be the
    target's own greedy decode, token for token, at every K."""
    V = 61
    t_hf = tiny_hf(4, vocab=V)
    target = make_runner(t_hf, 128)
    prompts = [[1, 5, 7, 9], [3], [2, 2, 2, 2, 2, 2, 8]]
    refs = [generate(target, p, max_new_tokens=30).tokens for p in prompts]
    counts = torch.bincount(torch.tensor(sum(refs, [])), minlength=V)
    written = counts.nonzero().flatten()
    dropped = written[torch.argsort(counts[written], descending=True, stable=True)[:2]]  # the two most written
    kept = torch.tensor([i for i in range(V) if i not in set(dropped.tolist())][:40])
    assert set(dropped.tolist()) & set(sum(refs, []))  # the target writes ids the draft cannot propose
    runners = {"self": lambda: make_runner(t_hf, 128),
               "self-int8": lambda: make_runner(tiny_hf(4, vocab=V, dtype=torch.float32), 128, quantize="int8"),
               "other": lambda: make_runner(tiny_hf(5, vocab=V, layers=1), 128, lean=False)}
    drafts = {name + ("-context" if context else ""): (lambda make=make, context=context:
                                                       PrunedRunner(make(), kept, context=context))
              for (name, make), context in itertools.product(runners.items(), (False, True))}
    accepted = {}
    for (name, make), (prompt, ref), k in itertools.product(drafts.items(), zip(prompts, refs), (1, 3, 6)):
        out = generate(target, prompt, draft=make(), max_new_tokens=30, policy=KPolicy(k=k))
        assert out.tokens == ref, (name, prompt, k)
        accepted[name] = accepted.get(name, 0) + out.stats.accepted
        if name == "self":  # right wherever the target's token is kept, wrong wherever it is not
            assert 0 < out.stats.accepted < out.stats.drafted
    assert accepted["self-context"] > accepted["self"]  # once read, the dropped ids are proposed, and right
    for policy in (KPolicy(k=2, dynamic=True), KPolicy(k=4, confidence=0.5)):
        assert generate(target, prompts[0], draft=drafts["self"](), max_new_tokens=30, policy=policy).tokens == refs[0]


def test_a_draft_pruned_to_a_single_id_is_still_exact() -> None:
    t_hf = tiny_hf(6, vocab=61)
    target = make_runner(t_hf, 64)
    ref = generate(target, [1, 2], max_new_tokens=20).tokens
    out = generate(target, [1, 2], draft=PrunedRunner(make_runner(t_hf, 64), torch.tensor([ref[0]])),
                   max_new_tokens=20, policy=KPolicy(k=3))
    assert out.tokens == ref


# --- temperature > 0: the target's law -------------------------------------------------------------------------

V_LAW, PROMPT, S_LAW = 5, [1, 3], torch.tensor([0, 2, 4])


def next_laws(last_logits, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """p after the prompt (V,) and after the prompt and each token x (V, V); `last_logits(context)` -> (V,)."""
    first = to_probs(last_logits(PROMPT), params)
    second = torch.stack([to_probs(last_logits(PROMPT + [x]), params) for x in range(V_LAW)])
    return first.double(), second.double()


def hf_last(hf):
    return lambda ctx: hf(torch.tensor([ctx])).logits[0, -1].detach()


def runner_last(runner):
    return lambda ctx: runner.forward(torch.tensor(ctx), 0)[-1]


def round_law(p1, P2, q1, Q2, r1=None, R2=None, resid=residual) -> torch.Tensor:
    """The exact joint law (V, V) of the first two tokens a K = 2 round emits, summed over every path: drafts from
    q1 and Q2[d0]; the ratio and the residual from r1, R2 (the same q unless a broken variant says otherwise).
    After a rejection at depth 1 the second token is the next round's first, whose law at that context is
    P2[x1] when the round is exact (the first-token marginal below checks exactly that)."""
    r1, R2 = (q1, Q2) if r1 is None else (r1, R2)
    law = torch.zeros(V_LAW, V_LAW, dtype=torch.float64)
    for d0 in range(V_LAW):
        a0 = accept_probability(p1[d0], r1[d0]) if q1[d0] > 0 else 0.0
        law += q1[d0] * (1 - a0) * resid(p1, r1)[:, None] * P2
        for d1 in range(V_LAW):
            if q1[d0] > 0 and Q2[d0, d1] > 0:
                a1 = accept_probability(P2[d0, d1], R2[d0, d1])
                law[d0] += q1[d0] * a0 * Q2[d0, d1] * (1 - a1) * resid(P2[d0], R2[d0])
                law[d0, d1] += q1[d0] * a0 * Q2[d0, d1] * a1
    return law


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3)])
@pytest.mark.parametrize("seeds", [(20, 21), (24, 25)])
def test_a_round_with_a_pruned_draft_samples_the_target_exactly(params: SamplingParams, seeds) -> None:
    """Exact enumeration over V = 5 with the draft pruned to 3 ids (q = 0 on two of them), p and q from the tiny
    models themselves, acceptance and residual from `decode.sampling`: the round's law equals the target's to
    rounding. Two broken variants fail the same check: the residual replaced by p, and the pruned q sampled
    from but the whole draft's q (renormalised over every id) in the ratio and the residual."""
    t_hf, d_hf = (tiny_hf(s, vocab=V_LAW, layers=1, scale=8.0) for s in seeds)
    p1, P2 = next_laws(hf_last(t_hf), params)
    q1, Q2 = next_laws(runner_last(PrunedRunner(make_runner(d_hf, 16), S_LAW)), params)
    assert float(q1[[1, 3]].sum()) == 0.0 and float(Q2[:, [1, 3]].sum()) == 0.0
    target = p1[:, None] * P2
    law = round_law(p1, P2, q1, Q2)
    assert torch.allclose(law.sum(1), p1, atol=1e-12, rtol=0)  # the first token: p itself
    assert torch.allclose(law, target, atol=1e-12, rtol=0)
    no_residual = round_law(p1, P2, q1, Q2, resid=lambda p, q: p)
    f1, F2 = next_laws(runner_last(make_runner(d_hf, 16)), SamplingParams(params.temperature))  # > 0 everywhere
    renormalised = round_law(p1, P2, q1, Q2, f1, F2)
    for broken in (no_residual, renormalised):
        assert 0.5 * float((broken - target).abs().sum()) > 0.05  # total variation


def law_setup(params: SamplingParams, context: bool = False):
    """V = 4, a draft pruned to ids 0 and 2 (with context ids: and 1, read in the prompt, and 3 once written), the
    target's exact law of 3-token continuations of the prompt."""
    t_hf, d_hf = tiny_hf(20, vocab=4, layers=1, scale=8.0), tiny_hf(21, vocab=4, layers=1, scale=8.0)
    draft = PrunedRunner(make_runner(d_hf, 32), torch.tensor([0, 2]), context=context)
    prompt = [1, 1] if context else [1, 3]
    return make_runner(t_hf, 32), draft, prompt, target_sequence_law(t_hf, prompt, params)


@pytest.mark.parametrize("context", [pytest.param(False, marks=SLOW), True])
def test_sampled_output_with_a_pruned_draft_follows_the_target_law(context: bool) -> None:
    """The decoder end to end: chi-square over all 64 continuations, n = 3000 draws (power stated in
    tests/decode/test_speculative.py)."""
    params, n = SamplingParams(1.0), 3000
    target, draft, prompt, law = law_setup(params, context)
    assert chi2_pvalue(sample_counts(target, draft, prompt, params, 2, n, seed=0), law, n) > 1e-3


@pytest.mark.parametrize("context", [pytest.param(False, marks=SLOW), True])
def test_the_law_test_rejects_a_decoder_without_the_residual(monkeypatch, context: bool) -> None:
    """Negative control: after a rejection, sample p instead of max(0, p - q) normalised. With a pruned draft
    that over-weights the kept ids; the same test must reject it."""
    params, n = SamplingParams(1.0), 3000
    target, draft, prompt, law = law_setup(params, context)
    monkeypatch.setattr(draftsmith.decode.sampling, "residual", lambda p, q: p)
    assert chi2_pvalue(sample_counts(target, draft, prompt, params, 2, n, seed=0), law, n) < 1e-6
