"""Training a draft head: the training-time unroll computes, for every entry and depth, exactly the logits the
decoder's HeadDraft computes when a round starts there; the data folder resumes; training lowers the loss."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.decode.head import HeadDraft, load_head
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.distill.heads.data import HeadDataConfig, build_head_data, load_head_data, target_features
from draftsmith.decode.runtime.attention import grouped_attention
from draftsmith.decode.head import ttt_logits, ttt_mask
from draftsmith.decode.runtime.kernels import dense
from draftsmith.distill.heads.train import HeadTrainConfig, soft_cross_entropy, train_head
from tests import helpers
from tests.decode.test_head import random_head, target_hf


def test_ttt_mask_is_what_a_round_sees() -> None:
    m = ttt_mask(5, 3)  # depth 3 of entry e: depth-1 keys < e-1, depth-2 key e-1, depth-3 key e
    assert m.shape == (5, 15)
    e = 4
    assert m[e, :5].tolist() == [True, True, True, False, False]
    assert m[e, 5:10].tolist() == [False, False, False, True, False]
    assert m[e, 10:].tolist() == [False, False, False, False, True]
    assert ttt_mask(4, 1).equal(torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("Hq,Hkv,j", [(6, 2, 2), (4, 4, 1), (6, 3, 3)])
def test_grouped_attention_is_masked_softmax_attention_with_hf_head_grouping(Hq, Hkv, j) -> None:
    g = torch.Generator().manual_seed(Hq * 10 + j)
    B, E, D = 2, 5, 8
    q = torch.randn(B, Hq, E, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, j * E, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, j * E, D, generator=g, dtype=torch.float64, requires_grad=True)
    mask = ttt_mask(E, j)
    out = grouped_attention(q, k, v, mask)
    # brute force: kv heads repeated as HF's repeat_kv (query head h reads kv head h // (Hq / Hkv)), one query at a time
    rep = Hq // Hkv
    ref = torch.empty_like(out)
    for b in range(B):
        for h in range(Hq):
            for e in range(E):
                keys = mask[e].nonzero()[:, 0]
                s = torch.stack([q[b, h, e] @ k[b, h // rep, c] for c in keys]) / D ** 0.5
                ref[b, h, e] = torch.softmax(s, 0) @ v[b, h // rep, keys]
    assert torch.allclose(out, ref, atol=1e-12)
    if Hkv not in (1, Hq):  # negative control: the brute force tells head h -> kv head h % Hkv apart
        bias = torch.zeros(E, j * E, dtype=torch.float64).masked_fill(~mask, float("-inf"))
        alt = torch.softmax(q @ k.repeat(1, rep, 1, 1).transpose(-1, -2) / D ** 0.5 + bias, -1) @ v.repeat(1, rep, 1, 1)
        assert not torch.allclose(alt, ref, atol=1e-6)
    gq, gk, gv = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out)).sum(), (q, k, v))
    rq, rk, rv = torch.autograd.grad((ref * torch.arange(ref.numel()).view_as(ref)).sum(), (q, k, v))
    assert torch.allclose(gq, rq) and torch.allclose(gk, rk) and torch.allclose(gv, rv)


def test_soft_cross_entropy_and_its_gradient_against_autograd_in_float64() -> None:
    g = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(7, 11, generator=g, dtype=torch.float64)).requires_grad_()
    p = torch.softmax(torch.randn(7, 11, generator=g, dtype=torch.float64), -1)
    ce = soft_cross_entropy(z, p)
    ref = -(p * torch.log_softmax(z, -1)).sum(-1)
    assert torch.allclose(ce, ref, atol=1e-12)
    w = torch.randn(7, generator=g, dtype=torch.float64)
    assert torch.allclose(torch.autograd.grad((ce * w).sum(), z)[0], torch.autograd.grad((ref * w).sum(), z)[0])
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, p), (z,))
    zb = z.detach().bfloat16().requires_grad_()  # bfloat16 logits: the loss in float32, the gradient back in bfloat16
    out = soft_cross_entropy(zb, p.float())
    assert out.dtype == torch.float32
    assert torch.autograd.grad(out.sum(), zb)[0].dtype == torch.bfloat16


def test_dense_equals_a_matmul_and_keeps_up_with_in_place_changes() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 64, generator=g), torch.randn(300, 64, generator=g)
    with torch.no_grad():
        assert torch.allclose(dense(x, w), x @ w.T, atol=1e-4)
        w.mul_(2)  # a packed copy, if any, follows the weight
        assert torch.allclose(dense(x, w), x @ w.T, atol=1e-4)


@pytest.mark.parametrize("N", [None, 40])
def test_unrolled_logits_equal_the_decoders_at_every_entry_and_depth(N) -> None:
    hf = target_hf(3, layers=4)
    head = random_head(hf, N=N, seed=1, scale=4.0)
    tokens = torch.tensor([1, 5, 7, 9, 11, 3, 4, 8, 13, 21, 34, 6])
    aux = head.config.aux_layers
    feats = target_features(hf, [tokens.tolist()], aux)[0]["features"].double()
    # float64 features straight from HF (target_features stores float16; recompute at full precision here)
    with torch.no_grad():
        hs = hf(input_ids=tokens[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in aux], dim=-1)
        steps = 3
        unrolled = ttt_logits(head, feats, tokens, steps)  # per depth: (E, N)
    E = len(tokens) - 1
    for j in range(1, steps + 1):
        for e in range(j - 1, E):
            L = e - j + 3  # the accepted length when entry e is the round's depth-j draft
            if L < 2:
                continue
            draft = HeadDraft(head, 64)  # the target has read tokens[:L-1]; token L-1 is its bonus token
            draft.observe(feats[: L - 1], tokens[: L - 1], 0)
            logits = draft.forward(tokens[L - 1 : L], L - 1, keep=1)
            for d in range(2, j + 1):  # the round's later depths read the drafted tokens (teacher-forced here)
                logits = draft.forward(tokens[L + d - 2 : L + d - 1], L + d - 2, keep=1)
            expected = head.to_target_vocab(unrolled[j - 1][e : e + 1])
            # RMSNorm runs in float32 inside (as HF), so float64 paths agree to ~1e-6, not to rounding
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=f"entry {e} depth {j}")


def _word_target(tmp_path):
    """A tiny target over a word vocabulary, 6 prompts and a small data config (2 samples, batches of 4)."""
    from draftsmith.decode.runtime.loading import load
    from draftsmith.decode.prompts import Prompt

    words = "the a of to and in is it that for on with as was be by this are or at from code data".split()
    tok = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *words], eos="</s>", bos="<s>")
    folder = helpers.save_tiny(tmp_path / "target", tok, 0, eos_id=2, bos_id=1, layers=4, head_scale=4.0)
    target: Loaded = load(str(folder))
    prompts = [Prompt(f"p{i}", "code", " ".join(words[i : i + 4])) for i in range(6)]
    return target, prompts, HeadDataConfig(samples=2, max_new_tokens=8, batch_size=4, aux_layers=(1, 2, 3))


def test_head_data_resumes_and_training_lowers_the_loss(tmp_path) -> None:
    target, prompts, cfg = _word_target(tmp_path)
    stats = build_head_data(target, prompts, tmp_path / "data", cfg, progress=False)
    rows = load_head_data(tmp_path / "data")
    assert len(rows) == 12 == stats["rows"] and stats["tokens"] == sum(len(r["tokens"]) for r in rows)
    first = sorted((tmp_path / "data").glob("shard-*"))[0]
    first.unlink()  # as if killed before the first shard was written
    build_head_data(target, prompts, tmp_path / "data", cfg, progress=False)
    again = load_head_data(tmp_path / "data")
    assert all(torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["features"], b["features"])
               for a, b in zip(rows, again))
    import draftsmith.distill.heads.data as hd

    with pytest.MonkeyPatch.context() as mp:  # the second pass the lean runner saves gives the same rows
        mp.setattr(hd, "lean_supported", lambda config: (False, "test"))
        build_head_data(target, prompts, tmp_path / "hf-data", cfg, progress=False)
    for a, b in zip(rows, load_head_data(tmp_path / "hf-data")):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["next"], b["next"])
        assert a["prompt_len"] == b["prompt_len"]
        torch.testing.assert_close(a["features"].float(), b["features"].float(), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(a["final"].float(), b["final"].float(), rtol=2e-3, atol=2e-3)
    from draftsmith.decode.runtime.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="aux layers"):
        build_head_data(target, prompts, tmp_path / "bad", HeadDataConfig(aux_layers=(1, 2, 4)), progress=False)
    with pytest.raises(DraftsmithError, match="other settings"):
        build_head_data(target, prompts, tmp_path / "data", HeadDataConfig(samples=3, max_new_tokens=8,
                                                                          aux_layers=(1, 2, 3)), progress=False)
    with pytest.raises(DraftsmithError, match=r"other settings \(dtype\)"):
        build_head_data(target, prompts, tmp_path / "data", HeadDataConfig(**{**vars(cfg), "dtype": "bfloat16"}),
                        progress=False)
    # a bfloat16 copy of the target writes the same kind of rows, faster where AMX is; the target stays float32
    build_head_data(target, prompts[:2], tmp_path / "bf16", HeadDataConfig(**{**vars(cfg), "dtype": "bfloat16"}),
                    progress=False)
    bf16 = load_head_data(tmp_path / "bf16")
    assert len(bf16) == 4 and next(target.model.parameters()).dtype == torch.float32
    assert all(r["features"].dtype == torch.float16 and r["features"].shape[-1] == rows[0]["features"].shape[-1]
               for r in bf16)
    with pytest.raises(DraftsmithError, match="dtype must be one of"):
        HeadDataConfig(dtype="int8")
    tcfg = HeadTrainConfig(draft_vocab_size=20, lr=3e-3, epochs=6, rows_per_step=4, eval_every=6, warmup_steps=2)
    summary = train_head(target, rows[:10], rows[10:], tmp_path / "head", tcfg, aux_layers=(1, 2, 3), progress=False)
    losses = [json.loads(x)["loss"] for x in (tmp_path / "head" / "log.jsonl").read_text().splitlines()
              if '"loss"' in x]
    assert summary["steps"] == 15 and losses[-1] < losses[0]
    bcfg = HeadTrainConfig(**{**vars(tcfg), "dtype": "bfloat16"})  # bfloat16 matmuls learn too
    train_head(target, rows[:10], rows[10:], tmp_path / "bf16-head", bcfg, aux_layers=(1, 2, 3), progress=False)
    b_losses = [json.loads(x)["loss"] for x in (tmp_path / "bf16-head" / "log.jsonl").read_text().splitlines()
                if '"loss"' in x]
    assert b_losses[-1] < b_losses[0] and b_losses[0] == pytest.approx(losses[0], rel=0.05)
    with pytest.raises(DraftsmithError, match="dtype must be float32 or bfloat16"):
        HeadTrainConfig(dtype="float16")
    wcfg = HeadTrainConfig(**{**vars(tcfg), "epochs": 1, "intermediate_size": 48})  # a wider MLP than the target's
    train_head(target, rows[:10], rows[10:], tmp_path / "wide-head", wcfg, aux_layers=(1, 2, 3), progress=False)
    wide = load_head(tmp_path / "wide-head" / "best", target.model.get_input_embeddings())
    assert wide.config.intermediate_size == 48 == wide.midlayer.mlp.up_proj.out_features
    assert (tmp_path / "head" / "best" / "model.safetensors").is_file()
    assert 0.0 < summary["draft_vocab_coverage"] <= 1.0

    # a time budget: after 10 timed steps the cosine is fitted to the steps that fit, and a resume follows it
    import draftsmith.distill.heads.train as ht

    class Clock:  # every reading of the clock is one second later
        t = 0.0

        def perf_counter(self) -> float:
            self.t += 1.0
            return self.t

    budget = dict(draft_vocab_size=20, lr=3e-3, epochs=50, rows_per_step=4, eval_every=5, warmup_steps=2,
                  max_minutes=1.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ht, "time", Clock())
        timed = train_head(target, rows[:10], rows[10:], tmp_path / "timed", HeadTrainConfig(**budget),
                           aux_layers=(1, 2, 3), progress=False)
    log = [json.loads(x) for x in (tmp_path / "timed" / "log.jsonl").read_text().splitlines() if '"lr"' in x]
    assert 10 < timed["total_steps"] < 125 == 50 * 10 // 4  # the budget, not the epochs, sets the length
    assert timed["steps"] == timed["total_steps"] and log[-1]["lr"] == pytest.approx(0.0, abs=1e-9)


def test_a_repeated_prompt_is_trained_on_once_and_its_loss_is_the_full_rows_tail() -> None:
    from draftsmith.distill.heads.train import _loss_starts, _row_loss

    hf = target_hf(3, layers=4)
    head = random_head(hf, N=40, seed=2, scale=4.0)
    prompt = [1, 5, 7, 9, 11]
    rows = []
    for cont in ([3, 4, 8, 13], [6, 2, 4, 8], [1, 5, 7]):  # two samples of one prompt, then another prompt
        toks = prompt + cont if len(rows) < 2 else [2, 4] + cont
        r = target_features(hf, [toks], head.config.aux_layers)[0]
        rows.append({**{k: v.long() if k in ("tokens", "next") else v for k, v in r.items()},
                     "prompt_len": len(prompt) if len(rows) < 2 else 2})
    assert _loss_starts(rows, True) == [0, len(prompt) - 1, 0]
    assert _loss_starts(rows, False) == [0, 0, 0]
    w = hf.get_output_embeddings().weight.detach()[head.draft_ids].float()
    a = len(prompt) - 1
    with torch.no_grad():
        for j in (1, 2, 3):  # per depth, the tail's loss is the full row's loss over the same entries
            full, n_full, acc_full = _row_loss(head, rows[1], w, j)
            tail, n_tail, acc_tail = _row_loss(head, rows[1], w, j, start=a)
            head_part, _, _ = _row_loss(head, {**rows[1], "tokens": rows[1]["tokens"][: a + 1],
                                                "features": rows[1]["features"][: a + 1],
                                                "final": rows[1]["final"][: a + 1], "next": rows[1]["next"][: a + 1]},
                                        w, j)
            torch.testing.assert_close(tail, full - head_part, rtol=1e-4, atol=1e-5)
            assert n_tail == n_full - a and acc_tail == acc_full  # agreement counts continuation entries only


def test_rows_unrolled_together_give_each_rows_own_loss_and_agreement() -> None:
    from draftsmith.distill.heads.train import _batch_loss, _bucketed, _row_loss

    hf = target_hf(3, layers=4)
    head = random_head(hf, N=40, seed=3, scale=4.0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, p in ((9, 4), (14, 3), (6, 5)):  # different lengths: the batch pads the shorter rows
        toks = torch.randint(1, 60, (n,), generator=gen).tolist()
        r = target_features(hf, [toks], head.config.aux_layers)[0]
        rows.append({**{k: v.long() if k in ("tokens", "next") else v for k, v in r.items()}, "prompt_len": p})
    starts = [0, 2, 4]
    w = hf.get_output_embeddings().weight.detach()[head.draft_ids].float()
    with torch.no_grad():
        for steps in (1, 2, 3):
            loss, n, acc = _batch_loss(head, rows, starts, w, steps)
            each = [_row_loss(head, r, w, steps, a) for r, a in zip(rows, starts)]
            torch.testing.assert_close(loss, sum(e[0] for e in each), rtol=1e-5, atol=1e-5)
            assert n == sum(e[1] for e in each)
            assert acc == [tuple(sum(e[2][j][i] for e in each) for i in (0, 1)) for j in range(steps)]
    # one epoch's order holds every row once, in steps of rows of similar length, a short step last
    rows = [{"tokens": torch.zeros(n)} for n in torch.randint(5, 300, (37,), generator=gen).tolist()]
    order = _bucketed(rows, 4, torch.Generator().manual_seed(1)).tolist()
    assert sorted(order) == list(range(37))
    lengths = [len(rows[i]["tokens"]) for i in order]
    assert all(lengths[k : k + 4] == sorted(lengths[k : k + 4]) for k in range(0, 32, 4))
    assert lengths[-1] == max(lengths)  # 37 = 9 steps of 4 + the short one, which holds the longest row


def test_a_head_run_trains_on_prompts_the_target_wrote_within_the_budget(tmp_path) -> None:
    """`written_prompts`: the target writes requests of its own (in a bfloat16 copy here) and answers them; the
    head trains on them beside the recipe's prompts, for what `budget_minutes` leaves after the data."""
    from draftsmith.decode.runtime.errors import DraftsmithError
    from draftsmith.distill.heads.pipeline import HeadRunConfig, run_head
    from tests.distill.test_prompt_gen import EOS, TOKENS, chat_tokenizer

    folder = helpers.save_tiny(tmp_path / "target", chat_tokenizer(), 0, vocab_size=EOS + 1, eos_id=EOS, layers=8,
                               head_scale=4.0)
    words = [t for t in TOKENS if t.isalpha()][:12]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(words[i : i + 3]), "domain": d}) + "\n"
                               for i in range(3) for d in ("code", "chat")))
    cfg = HeadRunConfig(samples=1, max_new_tokens=6, gen_batch_size=4, draft_vocab_size=16, epochs=1,
                        rows_per_step=2, train_minutes=0, eval_every=4, written_prompts=3, prompt_tokens=24,
                        gen_dtype="bfloat16", train_dtype="bfloat16", budget_minutes=30)
    result = run_head(str(folder), tmp_path / "run", cfg, prompts=str(prompts), eval_per_domain=1, progress=False)
    written = load_prompts_folder(tmp_path / "run" / "prompts")
    # a random tiny model ends few requests cleanly: what it kept (at most 3) is what the head trained on
    assert 1 <= len(written) == result["written_data"]["rows"] <= 3 and {p.domain for p in written} <= {"code", "chat"}
    assert result["train_summary"]["train_rows"] == result["data"]["rows"] + len(written) == 4 + len(written)
    assert result["train_minutes"] == pytest.approx(30 - result["generation_seconds"] / 60)
    with pytest.raises(DraftsmithError, match="nothing is left to train"):
        run_head(str(folder), tmp_path / "run", HeadRunConfig(**{**vars(cfg), "budget_minutes": 0.01}),
                 prompts=str(prompts), eval_per_domain=1, progress=False)


def test_a_data_budget_cuts_answers_short_and_skips_what_it_cannot_pay_for(tmp_path) -> None:
    """`max_seconds`: the first shard gets what there is and its answers stop there (prefixes of the whole
    ones, features intact); shards with nothing left are not written; a rerun without the cap writes them."""
    target, prompts, cfg = _word_target(tmp_path)
    build_head_data(target, prompts, tmp_path / "whole", cfg, progress=False)
    whole = load_head_data(tmp_path / "whole")
    stats = build_head_data(target, prompts, tmp_path / "cut", cfg, progress=False, max_seconds=1e-9)
    assert [p.name for p in sorted((tmp_path / "cut").glob("shard-*"))] == ["shard-00000.safetensors"]
    assert stats["cut_shards"] == 1 and stats["skipped_shards"] == 2
    cut = load_head_data(tmp_path / "cut")
    assert len(cut) == 4 and any(len(w["tokens"]) > int(w["prompt_len"]) + 1 for w in whole[:4])
    for c, w in zip(cut, whole):  # one new token each: the deadline fell at the first step
        n = len(c["tokens"])
        assert n == int(c["prompt_len"]) + 1 and torch.equal(c["tokens"], w["tokens"][:n])
        torch.testing.assert_close(c["features"].float(), w["features"][:n].float(), rtol=2e-3, atol=2e-3)
    stats = build_head_data(target, prompts, tmp_path / "cut", cfg, progress=False)  # no cap: the rest is written
    assert stats["skipped_shards"] == 0 and len(load_head_data(tmp_path / "cut")) == 12


def test_the_data_cap_shares_what_is_left_by_weight_in_order() -> None:
    from draftsmith.distill.heads.pipeline import DataCap

    cap = DataCap(100.0, {"data": 0.5, "prompts": 0.25, "written": 0.25}, spent=20.0)
    assert cap.allow("data") == pytest.approx(40.0)  # (100 - 20) * 0.5
    cap.spend("data", 30.0)  # data ended early: the next parts share the 50 left
    assert cap.allow("prompts") == pytest.approx(25.0) and cap.has_time("prompts")
    cap.spend("prompts", 45.0)  # prompts ran over: 5 left, all of it the last part's
    assert cap.allow("written") == pytest.approx(5.0)
    cap.spend("written", 10.0)
    over = DataCap(10.0, {"data": 0.5, "prompts": 0.5}, spent=12.0)
    assert over.allow("data") < 0 and over.skipped == ["data"]
    assert DataCap(None, {"data": 1.0}).allow("data") is None and DataCap(None, {"data": 1.0}).has_time("data")


def load_prompts_folder(path):
    from draftsmith.decode.prompts import load_prompts

    return load_prompts(path)




def test_thin_rows_keeps_every_sth_prompt_and_at_most_n_rows_each() -> None:
    from draftsmith.distill.heads.pipeline import thin_rows

    rows = [{"tokens": torch.tensor([p, 9, s]), "prompt_len": 1, "tag": (p, s)} for p in (1, 2, 3, 4) for s in (5, 6, 7)]
    rows = rows[::2] + rows[1::2]  # prompts interleaved: first appearance decides the order
    assert thin_rows(rows) == rows
    kept = [r["tag"] for r in thin_rows(rows, stride=2, per_prompt=2)]
    firsts = list(dict.fromkeys(r["tag"][0] for r in rows))[::2]
    assert {p for p, _ in kept} == set(firsts)
    for p in firsts:  # the first two rows of each kept prompt, in their order
        assert [t for t in kept if t[0] == p] == [r["tag"] for r in rows if r["tag"][0] == p][:2]


def test_bfloat16_falls_back_to_float32_on_a_cpu_where_it_is_not_faster(monkeypatch, capsys) -> None:
    """A recipe's gen_dtype / train_dtype bfloat16 runs in bfloat16 only where the CPU's bfloat16 Linears are
    faster than float32 at the rows they run, timed (`bf16_speedup`): with AVX2 alone there is no path (several
    times slower; the quickstart's data generation stalled), and with AVX-512 BF16 but no AMX they ran slower than
    float32. Float32 there, said in one line with the measured ratio; GPUs get what was asked."""
    from draftsmith.distill.heads import pipeline

    asked = []
    monkeypatch.setattr(pipeline, "bf16_speedup", lambda *shape: asked.append(shape) or 0.0)
    assert pipeline.fast_dtype("bfloat16", "cpu", "gen_dtype", (16, 64, 256)) == "float32"
    assert "gen_dtype bfloat16 -> float32: this CPU has no fast bfloat16 path" in capsys.readouterr().err
    monkeypatch.setattr(pipeline, "bf16_speedup", lambda *shape: asked.append(shape) or 0.61)
    assert pipeline.fast_dtype("bfloat16", "cpu", "train_dtype", (32, 64, 256)) == "float32"
    assert "train_dtype bfloat16 -> float32: bfloat16 ran 0.61x float32 at 32 x 64 x 256" in capsys.readouterr().err
    assert asked == [(16, 64, 256), (32, 64, 256)]
    assert pipeline.fast_dtype("float32", "cpu") == "float32"
    assert pipeline.fast_dtype("bfloat16", "cuda") == "bfloat16"  # GPUs: as asked
    monkeypatch.setattr(pipeline, "bf16_speedup", lambda *shape: 2.1)
    assert pipeline.fast_dtype("bfloat16", "cpu") == "bfloat16" and not capsys.readouterr().err
    assert len(asked) == 2  # float32 asked, or a GPU: nothing timed


def test_bf16_speedup_times_both_dtypes_once_per_shape(monkeypatch) -> None:
    from draftsmith.decode.runtime import kernels

    kernels.bf16_speedup.cache_clear()
    monkeypatch.setattr(kernels, "bf16_fast", lambda: False)
    assert kernels.bf16_speedup(8, 16, 32) == 0.0  # no oneDNN path: nothing timed
    kernels.bf16_speedup.cache_clear()
    monkeypatch.setattr(kernels, "bf16_fast", lambda: True)
    calls = []
    real = kernels.F.linear
    monkeypatch.setattr(kernels.F, "linear", lambda a, b: calls.append(a.dtype) or real(a, b))
    r = kernels.bf16_speedup(8, 16, 32)
    assert r > 0 and calls == [torch.float32] * 6 + [torch.bfloat16] * 6  # best_time: a warm-up, the best of 5
    assert kernels.bf16_speedup(8, 16, 32) == r and len(calls) == 12  # cached
    kernels.bf16_speedup.cache_clear()
