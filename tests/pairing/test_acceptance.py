"""Teacher-forced acceptance: beta against brute force, the batched path against one sequence at a time,
the cross-tokenizer path against the token-level one on a draft that only renumbers the vocabulary."""

import math
from pathlib import Path

import datasets
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from draftsmith.decode.runtime.loading import Loaded
from draftsmith.decode.sampling import SamplingParams, to_probs
from draftsmith.pairing.acceptance import THROUGH_TEXT, TOKEN_LEVEL, Acceptance, _TextRow, beta, expected_tau, measure_acceptance
from tests import helpers

WORDS = [f"w{i}" for i in range(48)]
EOS = len(WORDS)  # "<eos>" = 48; "[UNK]" = 49 lies outside the models' 49 rows, so no model emits it


def word_tokenizer(order: list[str] = WORDS) -> PreTrainedTokenizerFast:
    """Words split on whitespace, one id each (in `order`), then <eos> and [UNK]; no chat template."""
    return helpers.word_tokenizer([*order, "<eos>", "[UNK]"], eos="<eos>")


def tiny(seed: int, vocab: int = EOS + 1, layers: int = 2, dtype=torch.float64):
    """Head scaled by 8 (the helper's default): sharper distributions, so drafts visibly disagree."""
    return helpers.tiny_llama(seed, vocab, eos_id=EOS, layers=layers, dtype=dtype)


def loaded(model, name: str, tokenizer=None) -> Loaded:
    return Loaded(model=model, tokenizer=tokenizer or word_tokenizer(), path=Path("/nonexistent") / name, name=name)


def make_refs(lengths: list[tuple[int, int]], seed: int = 0) -> datasets.Dataset:
    """Rows of random ids with the given (prompt, continuation) lengths, two domains."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, (P, C) in enumerate(lengths):
        ids = torch.randint(0, EOS, (P + C,), generator=g).tolist()
        rows.append({"id": str(i), "domain": "code" if i % 2 else "chat", "prompt": "",
                     "prompt_ids": ids[:P], "continuation_ids": ids[P:], "text": ""})
    return datasets.Dataset.from_list(rows)


PARAMS = [
    SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.3, top_k=5),
    SamplingParams(1.0, top_p=0.8), SamplingParams(0.5, top_k=7, top_p=0.9),
]


def brute_beta(p_logits, q_logits, params) -> list[float]:
    p, q = to_probs(p_logits, params), to_probs(q_logits, params)
    return [sum(min(float(p[n, x]), float(q[n, x])) for x in range(p.shape[1])) for n in range(p.shape[0])]


@pytest.mark.parametrize("params", PARAMS)
def test_beta_matches_brute_force(params) -> None:
    g = torch.Generator().manual_seed(1)
    p_logits = torch.randn(6, 13, generator=g, dtype=torch.float64) * 2
    q_logits = torch.randn(6, 13, generator=g, dtype=torch.float64) * 2
    got = beta(p_logits, q_logits, params)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(brute_beta(p_logits, q_logits, params), abs=1e-12)
    assert ((got >= 0) & (got < 1)).all() and (got > 0).any()  # top-k/top-p may leave disjoint supports
    assert beta(p_logits, p_logits, params).tolist() == pytest.approx([1.0] * 6, abs=1e-12)


def test_beta_at_temperature_zero_is_argmax_match_with_lowest_id_ties() -> None:
    p = torch.tensor([[1.0, 3.0, 3.0, 0.0]] * 3)
    q = torch.tensor([[0.0, 3.0, 3.0, 1.0], [0.0, 2.0, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    assert beta(p, q, SamplingParams()).tolist() == [1.0, 0.0, 0.0]
    assert beta(q, q, SamplingParams()).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("params", [SamplingParams(), *PARAMS])
def test_beta_aligns_vocab_sizes_like_the_decoder(params) -> None:
    g = torch.Generator().manual_seed(2)
    p_logits = torch.randn(5, 11, generator=g, dtype=torch.float64) * 2
    q_logits = torch.randn(5, 11, generator=g, dtype=torch.float64) * 2
    # a larger draft vocab: its extra rows are dropped, however likely they are
    big = torch.cat([q_logits, torch.full((5, 3), 50.0, dtype=torch.float64)], dim=1)
    assert beta(p_logits, big, params).tolist() == pytest.approx(beta(p_logits, q_logits, params).tolist(), abs=1e-15)
    # a smaller draft vocab: the missing ids have probability 0 under q
    small = q_logits[:, :8]
    padded = torch.cat([small, torch.full((5, 3), -math.inf, dtype=torch.float64)], dim=1)
    assert beta(p_logits, small, params).tolist() == pytest.approx(brute_beta(p_logits, padded, params), abs=1e-12)


def test_expected_tau_hand_values() -> None:
    assert expected_tau(0.5, 1) == pytest.approx(1.5)
    assert expected_tau(0.8, 4) == pytest.approx(3.3616)
    assert expected_tau(0.0, 7) == 1.0
    for K in (1, 4, 16):
        assert expected_tau(1.0, K) == K + 1
        assert expected_tau(0.999999, K) == pytest.approx(K + 1, rel=1e-4)


def brute_acceptance(target, draft, refs, params) -> tuple[float, dict[str, float], list[float]]:
    """One sequence at a time, plain loops: the reference for the batched path."""
    total, per_domain, per_pos = [], {}, {}
    for r in refs:
        seq = torch.tensor([r["prompt_ids"] + r["continuation_ids"]])
        with torch.no_grad():
            p_all, q_all = target(seq).logits[0], draft(seq).logits[0]
        P = len(r["prompt_ids"])
        for t in range(len(r["continuation_ids"])):
            q_logits = q_all[P - 1 + t]
            V = p_all.shape[-1]
            if q_logits.shape[0] > V:
                q_logits = q_logits[:V]
            b = brute_beta(p_all[P - 1 + t][None], q_logits[None], params)[0]
            total.append(b)
            per_domain.setdefault(r["domain"], []).append(b)
            per_pos.setdefault(t, []).append(b)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return mean(total), {d: mean(v) for d, v in per_domain.items()}, [mean(per_pos[t]) for t in sorted(per_pos)]


LENGTHS = [(3, 9), (1, 4), (7, 12), (5, 1), (2, 7), (4, 10), (6, 3)]


def test_self_draft_has_alpha_one() -> None:
    target = tiny(0)
    refs = make_refs(LENGTHS)
    for params in (SamplingParams(), SamplingParams(1.0, top_k=5)):
        [a] = measure_acceptance(loaded(target, "t"), [loaded(target, "self")], refs, params=params, progress=False)
        assert a.method == TOKEN_LEVEL
        assert a.positions == sum(C for _, C in LENGTHS)
        assert a.alpha == pytest.approx(1.0, abs=1e-12)
        assert a.by_position == pytest.approx([1.0] * 12, abs=1e-12)
        assert a.expected_tau[4] == pytest.approx(5.0, abs=1e-9)
    [a] = measure_acceptance(loaded(target, "t"), [loaded(target, "self")], refs, progress=False)
    assert a.alpha == 1.0 and set(a.by_position) == {1.0}  # exactly, at temperature 0


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=6, top_p=0.95), SamplingParams()])
def test_batched_equals_one_sequence_at_a_time(params) -> None:
    target = tiny(0)
    others = [tiny(1, layers=1), tiny(2, vocab=EOS + 4)]  # the second has 3 padding rows, as Qwen drafts do
    refs = make_refs(LENGTHS, seed=3)
    results = measure_acceptance(
        loaded(target, "t"), [loaded(m, f"d{i}") for i, m in enumerate(others)], refs,
        params=params, batch_size=3, progress=False,
    )
    for model, a in zip(others, results):
        alpha, by_domain, by_pos = brute_acceptance(target, model, refs, params)
        assert a.alpha < 1.0
        assert a.alpha == pytest.approx(alpha, abs=1e-9)
        assert a.alpha_by_domain == pytest.approx(by_domain, abs=1e-9)
        assert a.by_position == pytest.approx(by_pos, abs=1e-9)
        assert a.positions_by_domain == {"chat": 9 + 12 + 7 + 3, "code": 4 + 1 + 10}
        assert a.expected_tau == pytest.approx({K: expected_tau(a.alpha, K) for K in range(1, 17)})
        d = a.to_dict()
        assert d["expected_tau"]["1"] == a.expected_tau[1] and "tau_definition" in d


def renumbered(model, tokenizer_perm: list[int]):
    """The same network over a renumbered vocabulary: new id perm[i] plays old id i."""
    import copy

    new = copy.deepcopy(model)
    perm = torch.tensor(tokenizer_perm)
    with torch.no_grad():
        new.model.embed_tokens.weight[perm] = model.model.embed_tokens.weight
        new.lm_head.weight[perm] = model.lm_head.weight
    return new


def test_through_text_matches_token_level_for_a_renumbered_vocabulary(tmp_path) -> None:
    from draftsmith.decode.prompts import Prompt
    from draftsmith.pairing.reference import reference_continuations

    target = loaded(tiny(0), "t")
    prompts = [Prompt(str(i), "chat" if i % 2 else "code", " ".join(WORDS[3 * i : 3 * i + 2 + i])) for i in range(6)]
    refs = reference_continuations(target, prompts, max_new_tokens=10, cache_root=tmp_path, progress=False)
    draft = tiny(1, layers=1)
    order = WORDS[::-1]  # word w gets id 47 - i; <eos> and [UNK] keep theirs
    perm = [order.index(w) for w in WORDS] + [EOS]
    text_draft = loaded(renumbered(draft, perm), "renumbered", word_tokenizer(order))
    twin = loaded(renumbered(target.model, perm), "twin", word_tokenizer(order))
    token, text, same = measure_acceptance(
        target, [loaded(draft, "d"), text_draft, twin], refs, batch_size=4, progress=False
    )
    assert (token.method, text.method) == (TOKEN_LEVEL, THROUGH_TEXT)
    assert text.positions == token.positions == sum(len(r["continuation_ids"]) for r in refs)
    assert 0.0 < token.alpha < 1.0
    assert text.alpha == token.alpha
    assert text.by_position == token.by_position and text.alpha_by_domain == token.alpha_by_domain
    assert same.alpha == 1.0


def test_through_text_rejects_positions_without_a_draft_boundary() -> None:
    target = loaded(tiny(0), "t")
    draft = loaded(tiny(1), "d", word_tokenizer([w for w in WORDS if w != "w5"]))  # w5 becomes [UNK]
    row = {"prompt": "w1 w2", "continuation_ids": [3, 4, 5, 6, 7]}
    x = _TextRow(row, target, draft, chat=True)
    assert x.text == "w3 w4 w5 w6 w7"
    # the draft's text loses w5, so only the prefixes before it line up with the target's tokens
    assert x.draft_at == [0, 1, 2, None, None]
    assert x.judge(target, draft, [3, 4, 7, 0, 0, 0], {EOS}, {EOS - 1}) == [1.0, 1.0, 0.0, 0.0, 0.0]


# -- acceptance as it happens: teacher-forced rows predict the decoder's own rounds --


def greedy_refs(target, prompts: list[list[int]], budget: int) -> datasets.Dataset:
    """The target's own greedy continuations (what `reference_continuations` stores), budget recorded."""
    import json

    from draftsmith.decode.runtime.runner import make_runner
    from draftsmith.decode.speculative import generate

    run = make_runner(target, 64)
    rows = []
    for i, ids in enumerate(prompts):
        out = generate(run, ids, max_new_tokens=budget, eos_ids=[EOS]).tokens
        rows.append({"id": str(i), "domain": "code" if i % 2 else "chat", "prompt": "", "prompt_ids": ids,
                     "continuation_ids": out, "text": ""})
    info = datasets.DatasetInfo(description=json.dumps({"draftsmith_reference": {"max_new_tokens": budget}}))
    return datasets.Dataset.from_list(rows, info=info)


def decoded_tokens_per_round(t_run, d_run, prompts: list[list[int]], refs, budget: int, K: int) -> float:
    """Tokens per target forward of the decoder over `prompts` at plain K, each output checked against `refs`."""
    from draftsmith.decode.speculative import KPolicy, generate

    forwards = tokens = 0
    for ids, ref in zip(prompts, refs):
        res = generate(t_run, ids, draft=d_run, max_new_tokens=budget, eos_ids=[EOS], policy=KPolicy(k=K))
        assert res.tokens == ref["continuation_ids"]
        forwards, tokens = forwards + res.stats.target_forwards, tokens + res.stats.new_tokens
    return tokens / forwards


def test_rows_predict_the_decoders_rounds_exactly_at_temperature_zero() -> None:
    from draftsmith.decode.runtime.runner import make_runner
    from draftsmith.decode.speculative import KPolicy, generate

    target, draft = tiny(0), tiny(0, layers=1)  # the draft: the target's first layer, so it half agrees
    draft.load_state_dict(target.state_dict(), strict=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, EOS, (n,), generator=g).tolist() for n in (3, 6, 4, 8)]
    budget = 14
    refs = greedy_refs(target, prompts, budget)
    [a] = measure_acceptance(loaded(target, "t"), [loaded(draft, "d")], refs, progress=False)
    assert a.budget == budget and len(a.rows) == len(prompts)
    assert 0.2 < a.alpha < 0.95  # neither trivial case
    t_run, d_run = make_runner(target, 64), make_runner(draft, 64)
    checked_iid = False
    for K in (1, 2, 3, 5):
        measured = decoded_tokens_per_round(t_run, d_run, prompts, refs, budget, K)
        assert a.tokens_per_round(K) == pytest.approx(measured, abs=1e-12)
        checked_iid |= abs(a.expected_tau[K] - measured) > 0.05  # the formula from alpha is not it
    assert checked_iid
    chat = [i for i, r in enumerate(refs) if r["domain"] == "chat"]
    assert a.tokens_per_round(2, "chat") == pytest.approx(
        sum(len(refs[i]["continuation_ids"]) for i in chat)
        / sum(generate(t_run, prompts[i], draft=d_run, max_new_tokens=budget, eos_ids=[EOS],
                       policy=KPolicy(k=2)).stats.target_forwards for i in chat), abs=1e-12)


def test_head_matrices_predict_the_decoders_rounds_exactly_at_temperature_zero() -> None:
    """A head's depths >= 2 read its own output: teacher-forced depth 1 alone would overstate them. The
    matrices from `measure_head_acceptance` walk to exactly the decoder's number of rounds at every K."""
    import json

    from draftsmith.decode.head import HeadDraft
    from draftsmith.decode.runtime.runner import make_runner
    from draftsmith.decode.speculative import KPolicy, generate
    from draftsmith.pairing.acceptance import HEAD, measure_head_acceptance
    from tests.decode.test_head import mimic_head, target_hf

    hf = target_hf(3, mix=0.3)
    head = mimic_head(hf, N=40, s=10.0)  # depth rates about 0.53, 0.23, 0.22, then 0
    run = make_runner(hf, 128)
    prompts, budget = [[1, 2, 3], [9, 9, 9, 1], [4, 7], [5, 6, 8, 10, 12]], 20
    rows = []
    for i, ids in enumerate(prompts):
        out = generate(run, ids, max_new_tokens=budget).tokens
        rows.append({"id": str(i), "domain": "code" if i % 2 else "chat", "prompt": "", "prompt_ids": ids,
                     "continuation_ids": out, "text": ""})
    info = datasets.DatasetInfo(description=json.dumps({"draftsmith_reference": {"max_new_tokens": budget}}))
    refs = datasets.Dataset.from_list(rows, info=info)
    a = measure_head_acceptance(Loaded(model=hf, tokenizer=None, path=Path("/x"), name="t"), head, refs, "head",
                                depth=6, progress=False)
    assert a.method == HEAD and a.matrices is not None and 0.2 < a.alpha < 1.0
    rates = a.depth_rates(6)
    assert rates[1] < rates[0] and rates[2] > 0  # later depths, fed by the head itself, agree less here
    for K in range(1, 7):
        forwards = tokens = 0
        for ids, ref in zip(prompts, rows):
            res = generate(run, ids, draft=HeadDraft(head, 128), max_new_tokens=budget, policy=KPolicy(k=K))
            assert res.tokens == ref["continuation_ids"]
            forwards, tokens = forwards + res.stats.target_forwards, tokens + res.stats.new_tokens
        assert a.tokens_per_round(K) == pytest.approx(tokens / forwards, abs=1e-12), K
    # the same rows read as a standalone draft's (depth j judged as depth 1 at s+j-1) would not predict it
    standalone = Acceptance(**{**a.__dict__, "matrices": None})
    assert any(abs(standalone.tokens_per_round(K) - a.tokens_per_round(K)) > 0.02 for K in range(2, 7))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_quantised_drafts_rows_read_through_its_runner_predict_its_rounds(quant: str) -> None:
    """A draft decodes with its int8 or int4 weights: read through that runner (`runners=`), its teacher-forced
    rows walk to exactly the decoder's rounds with it at every K. Int4 weights disagree with the float model's
    argmax somewhere on these rows, so its float rows (the negative control) do not predict its rounds; int8's
    per-row weights rarely flip one on a model this small (the leaderboard test's self-draft catches them)."""
    from draftsmith.decode.runtime.quant import int4_ok
    from draftsmith.decode.runtime.runner import make_runner

    if quant == "int4" and not int4_ok():
        pytest.skip("no int4 kernel on this CPU (AVX-512BW or AVX2)")
    target, draft = tiny(0, layers=2, dtype=torch.float32), tiny(0, layers=1, dtype=torch.float32)
    draft.load_state_dict(target.state_dict(), strict=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, EOS, (n,), generator=g).tolist() for n in (3, 6, 4, 8, 5, 7)]
    budget = 14
    refs = greedy_refs(target, prompts, budget)
    t, d = loaded(target, "t"), loaded(draft, "d")
    d_run = make_runner(draft, 64, quantize=quant)
    [a] = measure_acceptance(t, [d], refs, progress=False, runners=[make_runner(draft, 64, quantize=quant)])
    [as_float] = measure_acceptance(t, [d], refs, progress=False)
    t_run = make_runner(target, 64)
    float_off = False
    for K in (1, 2, 3, 5):
        measured = decoded_tokens_per_round(t_run, d_run, prompts, refs, budget, K)
        assert a.tokens_per_round(K) == pytest.approx(measured, abs=1e-12), K
        float_off |= abs(as_float.tokens_per_round(K) - measured) > 1e-9
    if quant == "int4":
        assert float_off


def test_runners_are_one_per_draft() -> None:
    refs = make_refs([(3, 4)])
    with pytest.raises(Exception, match="runners: one entry per draft"):
        measure_acceptance(loaded(tiny(0), "t"), [loaded(tiny(1), "d")], refs, progress=False, runners=[])
