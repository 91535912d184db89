"""EAGLE-3 draft heads on tiny random-init Llamas: vocabulary map, captured features, rollback, exactness."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

import draftsmith.decode.speculative
from draftsmith.decode.head import Eagle3Head, HeadConfig, HeadDraft, default_aux_layers, load_head, save_head, vocab_map
from draftsmith.decode.runtime.lean import LeanLM
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams, sample, to_probs, verify
from draftsmith.decode.speculative import KPolicy, generate
from tests import helpers
from tests.decode.test_speculative import V as LAW_V, chi2_pvalue, sample_counts, target_sequence_law

SLOW = pytest.mark.slow  # the default suite keeps one case of each law; `pytest -m slow` runs the rest

PROMPTS = [[1, 5, 7, 9], [3], [2, 2, 2, 2, 2, 2, 8]]


def target_hf(seed: int, vocab: int = 61, layers: int = 4, scale: float = 8.0, mix: float = 1.0):
    """A float64 random Llama; `mix` scales what each layer adds to the residual (0: a bigram model)."""
    hf = helpers.tiny_llama(seed, vocab, layers=layers, max_positions=512, head_scale=scale, dtype=torch.float64)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(mix)
            layer.mlp.down_proj.weight.mul_(mix)
    return hf


def with_vocab(head: Eagle3Head, seed: int) -> Eagle3Head:
    """A draft vocabulary that is not the first N ids (from random counts)."""
    c = head.config
    if c.draft_vocab_size < c.vocab_size:
        head.set_vocab(*vocab_map(torch.rand(c.vocab_size, generator=torch.Generator().manual_seed(seed)),
                                  c.draft_vocab_size))
    return head


def random_head(hf, N: int | None = None, seed: int = 0, scale: float = 1.0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = with_vocab(Eagle3Head(HeadConfig.for_target(hf.config, draft_vocab_size=N), hf.get_input_embeddings()), seed)
    with torch.no_grad():
        head.lm_head.weight.mul_(scale)
    return head


def mimic_head(hf, N: int | None = None, s: float = 10.0) -> Eagle3Head:
    """A head built to agree with the target often: its attention copies the normalised embedding of the
    token it reads (q = s k = s v = that embedding, one KV head per query head), and it ends in the target's
    own norm and LM head, so depth 1 predicts what a bigram model of the target would; depths >= 2 add their
    own hidden on the residual and agree less. Exercises accepted runs, rejections and rollback."""
    c = HeadConfig.for_target(hf.config, draft_vocab_size=N)
    c = HeadConfig(**{**c.__dict__, "num_key_value_heads": c.num_attention_heads})
    head = with_vocab(Eagle3Head(c, hf.get_input_embeddings()), 0)
    eye = torch.eye(c.hidden_size, dtype=torch.float64)
    zero = torch.zeros_like(eye)
    a = head.midlayer.self_attn
    with torch.no_grad():
        head.fc.weight.zero_()
        a.q_proj.weight.copy_(torch.cat([s * eye, zero], 1))
        a.k_proj.weight.copy_(torch.cat([eye, zero], 1))
        a.v_proj.weight.copy_(torch.cat([eye, zero], 1))
        a.o_proj.weight.copy_(eye)
        head.midlayer.mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(hf.model.norm.weight)
        head.lm_head.weight.copy_(hf.lm_head.weight[head.draft_ids])
    return head


# --- vocabulary map ------------------------------------------------------------------------------------


@pytest.mark.parametrize("V,N,seed", [(7, 3, 0), (50, 17, 1), (50, 50, 2), (9, 1, 3), (12, 6, 4)])
def test_vocab_map_brute_force(V: int, N: int, seed: int) -> None:
    counts = torch.randint(0, 5, (V,), generator=torch.Generator().manual_seed(seed))  # many ties
    d2t, t2d = vocab_map(counts, N)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and d2t.shape == (N,) and t2d.shape == (V,)
    by_rank = sorted(range(V), key=lambda i: (-int(counts[i]), i))  # most frequent first, ties -> lower id
    expected = sorted(by_rank[:N])
    ids = [d + int(d2t[d]) for d in range(N)]
    assert ids == expected  # draft ids in target id order
    assert [i for i in range(V) if t2d[i]] == expected
    assert all(t2d[d + d2t[d]] for d in range(N))  # round trip: every draft id lands on a marked target id
    inverse = {t: d for d, t in enumerate(ids)}
    assert all(ids[inverse[t]] == t for t in range(V) if t2d[t])
    if N == V:
        assert not d2t.any() and t2d.all()  # the identity
    with pytest.raises(ValueError):
        vocab_map(counts, V + 1)
    with pytest.raises(ValueError):
        vocab_map(counts, 0)


def test_set_vocab_refuses_maps_that_disagree() -> None:
    head = random_head(target_hf(0, vocab=11, layers=2), N=4)
    d2t, t2d = vocab_map(torch.arange(11), 4)
    head.set_vocab(d2t, t2d)
    bad = t2d.clone()
    bad[0] = True
    for args in ((d2t, bad), (torch.zeros(4, dtype=torch.long), t2d), (d2t[:3], t2d), (d2t + 100, t2d)):
        with pytest.raises(ValueError):
            head.set_vocab(*args)


def test_logits_are_minus_inf_outside_the_draft_vocab_and_q_normalises_over_it() -> None:
    hf = target_hf(1, vocab=23, layers=3)
    head = random_head(hf, N=9, scale=30.0)
    draft = HeadDraft(head, 32)
    target = make_runner(hf, 32)
    target.capture_layers = head.config.aux_layers
    ids = torch.tensor([3, 1, 4, 1, 5, 9])
    target.forward(ids[:-1], 0)
    draft.observe(target.last_hidden, ids[:-1], 0)
    logits = draft.forward(ids[-1:], 5, keep=5)[-5:]  # entries 0..4 in one step
    inside = head.t2d
    assert torch.isinf(logits[:, ~inside]).all() and (logits[:, ~inside] < 0).all()
    assert torch.isfinite(logits[:, inside]).all()
    for params in (SamplingParams(1.0), SamplingParams(0.7, top_k=4), SamplingParams(1.3, top_p=0.8)):
        q = to_probs(logits, params)
        assert torch.allclose(q.sum(-1), torch.ones(5, dtype=q.dtype), atol=1e-12)
        assert (q[:, ~inside] == 0).all()
    # the draft rows land on their target ids: full[:, draft_id + d2t[draft_id]] == the head's own logits
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.inference_mode():
        g = head.project(target.last_hidden)
        full, h = head(g, ids[1:], draft.cos[:5], draft.sin[:5], HeadDraft(head, 32).cache, 0, mask)
        assert torch.allclose(full[:, head.draft_ids], head.lm_head(head.norm(h)), atol=1e-12, rtol=0)
    assert torch.allclose(full, logits, atol=1e-12, rtol=0)


# --- the head's shape: names, defaults, save / load ------------------------------------------------------


def test_default_aux_layers_and_weight_names() -> None:
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(24) == (2, 12, 21)
    assert default_aux_layers(2) == (1, 1, 0) and default_aux_layers(1) == (0, 0, 0)  # clamped for tiny targets
    hf = target_hf(2, layers=6)
    head = random_head(hf, N=20)
    assert head.config.aux_layers == (2, 3, 3)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    H, I, D = 32, 64, 8
    assert shapes == {
        "fc.weight": (H, 3 * H),
        "midlayer.self_attn.q_proj.weight": (4 * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (2 * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (2 * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, 4 * D),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (20, H),
        "d2t": (20,),
        "t2d": (61,),
    }  # the speculators / SpecForge Llama EAGLE-3 names; no embedding (the target's)
    assert head.embed.data_ptr() == hf.get_input_embeddings().weight.data_ptr()  # shared, not copied


def test_save_and_load_round_trip(tmp_path) -> None:
    hf = target_hf(3, vocab=31, layers=3)
    head = random_head(hf, N=12, scale=5.0)
    save_head(head, tmp_path / "head")
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["draft_vocab_size"] == 12 and config["aux_layers"] == [2, 1, 0]
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "head" / "model.safetensors")) == set(head.state_dict())
    again = load_head(tmp_path / "head", hf.get_input_embeddings())
    assert again.config == head.config
    for k, v in head.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    target = make_runner(hf, 64)
    a = generate(target, [1, 2], draft=HeadDraft(head, 64), max_new_tokens=20, sampling=SamplingParams(1.0),
                 generator=torch.Generator().manual_seed(0))
    b = generate(target, [1, 2], draft=HeadDraft(again, 64), max_new_tokens=20, sampling=SamplingParams(1.0),
                 generator=torch.Generator().manual_seed(0))
    assert a.tokens == b.tokens and a.stats.tau_hist == b.stats.tau_hist


# --- the target's features -------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [(2, 3, 3), (0, 5, 1)])
def test_captured_hidden_states_equal_hf_output_hidden_states(layers) -> None:
    hf = target_hf(4, layers=6)
    ids = torch.tensor([5, 3, 8, 1, 1, 9, 2, 7, 4])
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True).hidden_states
    expected = torch.cat([ref[i][0] for i in layers], dim=-1)  # (T, 3H)
    runners = {"lean": make_runner(hf, 32), "hf": make_runner(hf, 32, lean=False)}
    for name, runner in runners.items():
        runner.capture_layers = layers
        runner.forward(ids[:5], 0, keep=1)  # a prefill keeps one row of logits but every row's features
        prefill = runner.last_hidden
        runner.forward(ids[5:], 5)  # a verify step
        got = torch.cat([prefill, runner.last_hidden])
        assert got.shape == (9, 96)
        assert torch.allclose(got, expected, atol=1e-12, rtol=0), name
    lean = LeanLM(hf, 32)
    lean.capture_layers = layers
    lean.forward_static(ids[:5], torch.arange(5))
    prefill = lean.last_hidden
    lean.forward_static(ids[5:], torch.arange(5, 9))
    assert torch.allclose(torch.cat([prefill, lean.last_hidden]), expected, atol=1e-12, rtol=0)
    lean.capture_layers = ()
    lean.last_hidden = None
    lean.forward(ids, 0)
    assert lean.last_hidden is None  # off by default: nothing kept


def test_generate_leaves_the_target_as_it_found_it() -> None:
    hf = target_hf(5)
    target = make_runner(hf, 64)
    generate(target, [1, 2, 3], draft=HeadDraft(random_head(hf), 64), max_new_tokens=10)
    assert target.capture_layers == ()


# --- the head's cache: rollback equals recomputation ---------------------------------------------------------


def fresh_entries(hf, head: Eagle3Head, seq: list[int], S: int = 128) -> HeadDraft:
    """A new head that read the target's features for seq[:-1] in one step: entries 0 .. len(seq)-2.

    Compared at 1e-6: RMSNorm runs in float32 even for float64 models (HF's op, which LeanLM follows), so
    chunked and one-step computations differ by float32 rounding; a wrong entry is off by ~0.1."""
    target = LeanLM(hf, S)
    target.capture_layers = head.config.aux_layers
    ids = torch.tensor(seq)
    target.forward(ids[:-1], 0)
    draft = HeadDraft(head, S)
    draft.observe(target.last_hidden, ids[:-1], 0)
    draft.forward(ids[-1:], len(seq) - 1)
    return draft


def test_keep_runs_the_output_head_on_the_returned_entries_only() -> None:
    """forward(keep=n) returns the last n rows of what keep=0 returns, and leaves the same cache and hidden states;
    the output head runs on the returned entries only (counted), also when self-fed entries follow target-fed ones."""
    hf = target_hf(7)
    head = mimic_head(hf)
    seq = [1, 5, 7, 9, 2, 4]
    outs = {}
    for keep in (0, 1, 2):
        target = LeanLM(hf, 64)
        target.capture_layers = head.config.aux_layers
        target.forward(torch.tensor(seq[:-2]), 0)
        draft = HeadDraft(head, 64)
        draft.observe(target.last_hidden, torch.tensor(seq[:-2]), 0)
        rows, real = [], head.to_target_vocab
        head.to_target_vocab = lambda logits: rows.append(logits.shape[0]) or real(logits)  # the output head's rows
        try:  # 4 target-fed entries (0..3), then one self-fed (4); keep=0 returns as many rows as tokens fed
            outs[keep] = (draft.forward(torch.tensor(seq[-2:]), len(seq) - 2, keep=keep), draft)
        finally:
            del head.to_target_vocab
        assert sum(rows) == (keep or 2)  # not 5: the output head skips the entries whose logits nobody reads
    full, ref = outs[0]
    for keep in (1, 2):
        logits, draft = outs[keep]
        assert torch.equal(logits, full[-keep:])
        assert torch.equal(draft.outs[:5], ref.outs[:5]) and torch.equal(draft.cache.k[:, :, :5], ref.cache.k[:, :, :5])


@pytest.mark.parametrize("k,mix,tau", [(3, 1.0, 2), (5, 0.0, 3), (2, 0.0, 3)])
def test_head_cache_after_decoding_equals_a_fresh_recomputation(k: int, mix: float, tau: int) -> None:
    hf = target_hf(6, mix=mix)
    head = mimic_head(hf)
    draft = HeadDraft(head, 128)
    prompt = [1, 2, 3]
    out = generate(make_runner(hf, 128), prompt, draft=draft, max_new_tokens=50, policy=KPolicy(k=k))
    assert 0 < out.stats.accepted < out.stats.drafted  # there were rejections to roll back
    assert max(out.stats.tau_hist) >= tau  # and accepted runs (depths >= 2: the head fed itself)
    seq = prompt + out.tokens
    fresh = fresh_entries(hf, head, seq)
    n = draft.h_len  # entries that read the target's features (the rest of seq is pending: observed, not read)
    assert n >= len(seq) - k - 2
    assert torch.allclose(draft.cache.k[:, :, :n], fresh.cache.k[:, :, :n], atol=1e-6, rtol=0)
    assert torch.allclose(draft.cache.v[:, :, :n], fresh.cache.v[:, :, :n], atol=1e-6, rtol=0)
    assert torch.allclose(draft.outs[:n], fresh.outs[:n], atol=1e-6, rtol=0)


def test_self_fed_entries_are_recomputed_from_the_target_once_it_has_read_them() -> None:
    hf = target_hf(7)
    head = random_head(hf)
    seq = [4, 8, 15, 16, 23, 42, 7]
    target = LeanLM(hf, 64)
    target.capture_layers = head.config.aux_layers
    draft = HeadDraft(head, 64)
    ids = torch.tensor(seq)
    target.forward(ids[:3], 0)
    draft.observe(target.last_hidden, ids[:3], 0)
    draft.forward(ids[3:4], 3)  # entries 0..2 from the target
    draft.forward(ids[4:5], 4)  # entry 3 fed its own hidden (depth 2)
    draft.forward(ids[5:6], 5)  # entry 4 (depth 3)
    assert (draft.h_len, draft.e_len) == (3, 5)
    target.forward(ids[3:6], 3)  # the target verifies seq[3:6]; all accepted
    draft.observe(target.last_hidden, ids[3:6], 3)
    draft.forward(ids[6:7], 6)  # entries 3..5 recomputed from the target's features
    fresh = fresh_entries(hf, head, seq, S=64)
    assert torch.allclose(draft.cache.k[:, :, :6], fresh.cache.k[:, :, :6], atol=1e-6, rtol=0)
    assert torch.allclose(draft.outs[:6], fresh.outs[:6], atol=1e-6, rtol=0)


def test_head_draft_refuses_to_draft_without_features() -> None:
    hf = target_hf(8, layers=2)
    draft = HeadDraft(random_head(hf), 16)
    with pytest.raises(ValueError, match="observe"):
        draft.forward(torch.tensor([1, 2]), 0)
    feats = torch.zeros(2, 96, dtype=torch.float64)
    draft.observe(feats, torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match="continue"):
        draft.observe(feats, torch.tensor([1, 2]), 5)  # a gap


# --- exactness --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,N", [(0, None), (1, 30), (2, 7)])
def test_greedy_equals_target_greedy_for_every_k(seed: int, N: int | None) -> None:
    hf = target_hf(seed)
    target = make_runner(hf, 128)
    heads = {"random": random_head(hf, N, seed=seed), "mimic": mimic_head(hf, N)}
    for prompt in PROMPTS:
        ref = generate(target, prompt, max_new_tokens=30).tokens
        for (name, head), k in itertools.product(heads.items(), range(1, 6)):
            out = generate(target, prompt, draft=HeadDraft(head, 128), max_new_tokens=30, policy=KPolicy(k=k))
            assert out.tokens == ref, (name, k, prompt)
        policy = KPolicy(k=2, dynamic=True, confidence=0.3)
        assert generate(target, prompt, draft=HeadDraft(heads["mimic"], 128), max_new_tokens=30,
                        policy=policy).tokens == ref


def test_an_int8_head_stays_exact_accepts_about_as_often_and_leaves_the_head_alone() -> None:
    """HeadDraft(quantize="int8"): a quantised copy (the head and the target's embedding untouched), greedy output
    still the target's at every K, acceptance within a few tokens of the float32 head's."""
    from draftsmith.decode.head import quantize_head_int8

    hf = target_hf(9, mix=0.0).float()  # fbgemm's int8 is a float32 CPU kernel
    head = mimic_head(hf, N=40)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    q = quantize_head_int8(head)
    assert type(q.lm_head) is not torch.nn.Linear and type(head.lm_head) is torch.nn.Linear
    assert q.embed is head.embed and all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())
    target = make_runner(hf, 128)
    accepted = {None: 0, "int8": 0}
    for prompt, k in [([1, 2, 3], 1), ([5], 3), ([9, 9, 9, 1], 2)]:
        ref = generate(target, prompt, max_new_tokens=25).tokens
        for quant in accepted:
            out = generate(target, prompt, draft=HeadDraft(head, 128, quantize=quant), max_new_tokens=25,
                           policy=KPolicy(k=k))
            assert out.tokens == ref, (quant, k)
            accepted[quant] += out.stats.accepted
    assert accepted[None] > 10 and abs(accepted["int8"] - accepted[None]) <= 0.2 * accepted[None]
    with pytest.raises(ValueError, match="unknown quantisation"):
        HeadDraft(head, 128, quantize="int4")
    with pytest.raises(ValueError, match="float32"):
        quantize_head_int8(mimic_head(target_hf(9, mix=0.0), N=40))


def test_greedy_exact_with_the_hf_runner_and_one_draft_reused() -> None:
    hf = target_hf(9, mix=0.0)
    head = mimic_head(hf, N=40)
    draft = HeadDraft(head, 128)  # one draft object across calls: observe at 0 starts afresh
    for lean, prompt, k in [(False, [1, 2, 3], 3), (True, [5], 4), (False, [9, 9, 9, 1], 2), (True, [1, 2, 3], 5)]:
        target = make_runner(hf, 128, lean=lean)
        ref = generate(target, prompt, max_new_tokens=25).tokens
        out = generate(target, prompt, draft=draft, max_new_tokens=25, policy=KPolicy(k=k))
        assert out.tokens == ref and out.stats.accepted > 0


def test_eos_and_budget_truncate_like_the_target() -> None:
    hf = target_hf(10)
    target, head = make_runner(hf, 128), mimic_head(hf)
    ref = generate(target, [1, 9], max_new_tokens=40).tokens
    eos = ref[17]
    cut = ref[: ref.index(eos) + 1]
    for k in (1, 3, 5):
        assert generate(target, [1, 9], draft=HeadDraft(head, 128), max_new_tokens=40, eos_ids=[eos],
                        policy=KPolicy(k=k)).tokens == cut
        assert generate(target, [1, 9], draft=HeadDraft(head, 128), max_new_tokens=7,
                        policy=KPolicy(k=k)).tokens == ref[:7]


# --- temperature > 0: the output law is the target's --------------------------------------------------------


def always_accept(p, q, draft_tokens, generator):
    """A decoder that never rejects: it emits the head's own samples (negative control)."""
    K = draft_tokens.shape[0]
    return K, int(sample(p[K], generator))


def mixed_q(p, q, draft_tokens, generator):
    """Drafts sampled from q, but the ratio and the residual computed with another q (negative control)."""
    return verify(p, 0.5 * q + 0.5 / q.shape[-1], draft_tokens, generator)


def law_pair(N: int):
    hf = target_hf(20, vocab=LAW_V, layers=2)
    head = random_head(hf, N=N, seed=21, scale=40.0)  # peaky q, far from p: many rejections
    return hf, make_runner(hf, 32), HeadDraft(head, 32)


@pytest.mark.parametrize("params,k,N", [(SamplingParams(1.0), 2, 3),
                                        pytest.param(SamplingParams(0.8, top_k=3), 3, 4, marks=SLOW),
                                        pytest.param(SamplingParams(1.2, top_p=0.9), 1, 3, marks=SLOW)])
def test_sampled_output_law_equals_target_law(params: SamplingParams, k: int, N: int) -> None:
    """Chi-square over all 64 continuations of 3 tokens (V = 4), n = 3000 draws, as for standalone drafts
    (the power is stated there). With N = 3 the head's vocabulary leaves one id out: q = 0 there."""
    hf, target, draft = law_pair(N)
    prompt = [1, 3]
    law = target_sequence_law(hf, prompt, params)
    n = 3000
    assert chi2_pvalue(sample_counts(target, draft, prompt, params, k, n, seed=0), law, n) > 1e-3


@pytest.mark.parametrize("control", [always_accept, mixed_q])
def test_negative_controls_fail_the_law_test(control, monkeypatch) -> None:
    """The same test rejects a decoder that never rejects, and one whose ratio and residual use another q than
    the one the drafts were sampled from: the law test can fail."""
    params, n = SamplingParams(1.0), 1000
    hf, target, draft = law_pair(3)
    law = target_sequence_law(hf, [1, 3], params)
    monkeypatch.setattr(draftsmith.decode.speculative, "verify", control)
    assert chi2_pvalue(sample_counts(target, draft, [1, 3], params, 2, n, seed=0), law, n) < 1e-6


def test_same_seed_same_output_and_greedy_draws_nothing() -> None:
    hf = target_hf(22)
    target, head = make_runner(hf, 128), mimic_head(hf, N=30)
    params = SamplingParams(1.0)
    runs = [generate(target, [1, 2], draft=HeadDraft(head, 128), max_new_tokens=30, sampling=params,
                     generator=torch.Generator().manual_seed(s)).tokens for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]
    g = torch.Generator().manual_seed(5)
    state = g.get_state().clone()
    generate(target, [1, 2], draft=HeadDraft(head, 128), max_new_tokens=30, generator=g)
    assert torch.equal(g.get_state(), state)


# --- the fixed-shape verify step, compiled -----------------------------------------------------------------


class StaticVerify:
    """The target with every verify step through `torch.compile(forward_static)`: K+1 rows, padded."""

    def __init__(self, lean: LeanLM, K: int) -> None:
        self.lean, self.rows = lean, K + 1
        self.vocab_size, self.max_seq_len = lean.vocab_size, lean.max_seq_len - K
        self.step = torch.compile(lean.forward_static, dynamic=False, fullgraph=True)
        self.last_hidden = None

    @property
    def capture_layers(self):
        return self.lean.capture_layers

    @capture_layers.setter
    def capture_layers(self, layers) -> None:
        self.lean.capture_layers = layers

    def forward(self, tokens, pos, keep=0):
        T = tokens.shape[0]
        if keep:  # the prefill: the dynamic path
            logits = self.lean.forward(tokens, pos, keep)
        else:  # padding rows write past the accepted prefix: never read, overwritten later
            padded = torch.cat([tokens, tokens.new_zeros(self.rows - T)])
            logits = self.step(padded, torch.arange(pos, pos + self.rows))[:T]
        self.last_hidden = self.lean.last_hidden[:T] if self.lean.capture_layers else None
        return logits


def test_compiled_static_verify_with_a_head_is_exact() -> None:
    hf = target_hf(11, mix=0.0)
    head = mimic_head(hf, N=40)
    K = 3
    target = StaticVerify(LeanLM(hf, 96), K)
    t0 = time.perf_counter()
    for prompt in ([1, 2, 3], [7]):
        ref = generate(LeanLM(hf, 96), prompt, max_new_tokens=30).tokens
        out = generate(target, prompt, draft=HeadDraft(head, 96), max_new_tokens=30, policy=KPolicy(k=K))
        assert out.tokens == ref and 0 < out.stats.accepted < out.stats.drafted
    assert time.perf_counter() - t0 < 600
