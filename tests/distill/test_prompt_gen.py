"""Self-written prompts: the dedup functions agree with brute force, the pre-query prefix stops at the user
header, batched generation equals one-at-a-time, an interrupted run resumes to the same dataset, bad inputs
get one-line errors, and the folder loads as prompts."""

from __future__ import annotations

import json
import random
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch

import draftsmith.distill.prompt_gen as pg
from draftsmith.decode.batch import generate_batch
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import read_json
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.decode.prompts import load_prompts
from draftsmith.decode.sampling import SamplingParams
from draftsmith.distill.prompt_gen import (NearDuplicates, generate_prompts, jaccard, minhash_signature, normalize, pre_query,
                                shingles)
from draftsmith.pairing.reference import prompt_seed
from tests import helpers

WORDS = [f"w{i}" for i in range(40)]
TOKENS = [*WORDS, "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "[UNK]", "<eos>"]
EOS, IM_START, IM_END, USER = len(TOKENS) - 1, TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>"), 43
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMALL = {"max_prompt_tokens": 24, "min_chars": 1, "progress": False}


def chat_tokenizer(template: str | None = CHATML):
    tok = helpers.word_tokenizer(TOKENS, eos="<eos>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Loaded:
    return helpers.tiny_loaded(0, tmp_path_factory.mktemp("models") / "target", chat_tokenizer(), eos_id=EOS)


def rows(ds) -> list[dict]:
    return ds.to_list()


# -- dedup: pure functions against brute force ----------------------------------------------------------------


def test_normalize_and_shingles() -> None:
    assert normalize("  Hello,   WORLD!\n") == normalize("hello world") == "hello world"
    assert normalize("ﬁle_name") == "file name"  # NFKC ligature, underscore is punctuation here
    text = "a b c d e"
    assert shingles(text) == {"a b c", "b c d", "c d e"}
    assert shingles("a b") == {"a b"} and shingles("") == frozenset() and shingles("A, b") == shingles("a b")


def test_jaccard_and_minhash_agree_with_brute_force() -> None:
    rng = random.Random(0)
    errors = []
    for _ in range(60):
        a = {f"s{rng.randrange(80)}" for _ in range(rng.randrange(1, 40))}
        b = set(rng.sample(sorted(a), rng.randrange(len(a) + 1))) | {f"s{rng.randrange(80)}" for _ in range(5)}
        union = sorted(a | b)
        brute = sum(x in a and x in b for x in union) / len(union)
        assert jaccard(frozenset(a), frozenset(b)) == pytest.approx(brute)
        est = float(np.mean(minhash_signature(a) == minhash_signature(b)))
        errors.append(abs(est - brute))
    assert np.mean(errors) < 0.05 and max(errors) < 0.2
    assert jaccard(frozenset(), frozenset()) == 1.0
    assert (minhash_signature(["x", "y"]) == minhash_signature(["y", "x", "x"])).all()


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.9])
def test_near_duplicate_index_decides_as_brute_force(threshold: float) -> None:
    """Each text in turn: LSH + exact check says "near duplicate" exactly when some earlier kept text has
    Jaccard >= threshold (texts with 1 to 3 words changed straddle every threshold)."""
    rng = random.Random(1)
    bases = [[f"v{rng.randrange(500)}" for _ in range(30)] for _ in range(20)]
    texts = [" ".join(b) for b in bases]
    for _ in range(80):
        words = list(rng.choice(bases))
        for _ in range(rng.randrange(1, 4)):
            words[rng.randrange(len(words))] = f"v{rng.randrange(500)}"
        texts.append(" ".join(words))
    rng.shuffle(texts)
    index, kept, found = NearDuplicates(threshold), [], 0
    for t in texts:
        s = shingles(t)
        brute = any(jaccard(s, k) >= threshold for k in kept)
        assert index.find(s) == brute
        found += brute
        if not brute:
            index.add(s)
            kept.append(s)
    assert 0 < found < len(texts)


def test_filter_drops_exact_and_near_duplicates_and_keeps_distinct() -> None:
    long = " ".join(WORDS[:30])
    near = long.replace("w15", "w39")  # one word of 30 changed: Jaccard 25/31
    filt = pg._Filter(6, ["code", "chat"], min_chars=3, threshold=0.7)
    decided = [filt.consider({"index": i, "domain": d, "text": t, "tokens": 5, "clean": c}) for i, (d, t, c) in
               enumerate([("code", long, True), ("chat", long.upper() + " !", True), ("code", near, True),
                          ("chat", "w1 w2 w3", False), ("code", "w1", True), ("chat", "w5 w6 w7", True),
                          ("code", "w8 w9", True), ("chat", "w10 w11", True), ("code", "w12 w13", True),
                          ("chat", "w14 w15", True), ("code", "w16 w17", True)])]
    assert decided == ["kept", "duplicate", "near_duplicate", "length_cap", "too_short", "kept", "kept", "kept",
                       "kept", "kept", "surplus"]
    stats = filt.stats(6, 11)
    assert stats["kept"] == 6 and stats["complete"] and stats["surplus"] == 1
    assert stats["rejected"] == {"length_cap": 1, "too_short": 1, "duplicate": 1, "near_duplicate": 1}
    assert stats["unique_fraction"] == pytest.approx(6 / 9)  # kept / ended their turn


# -- the pre-query template -----------------------------------------------------------------------------------


def test_pre_query_stops_at_the_user_header() -> None:
    tok = chat_tokenizer()
    ids, end = pre_query(tok, "code")
    assert ids[:2] == [IM_START, TOKENS.index("system")] and ids[-2:] == [IM_START, USER]
    assert ids.count(IM_END) == 1 and end == IM_END
    assert pre_query(tok, "chat")[0] != ids  # the domain's system line steers
    no_system = chat_tokenizer("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
                               "{% endif %}" + CHATML)  # as Gemma's: then the domain is only a label
    assert pre_query(no_system, "code") == ([IM_START, USER], IM_END) == pre_query(no_system, "chat")


# -- generation -------------------------------------------------------------------------------------------------


def test_batched_equals_one_at_a_time_and_each_row_its_own_decode(target, tmp_path, monkeypatch) -> None:
    stops = []
    monkeypatch.setattr(pg, "generate_batch", lambda *a, **kw: stops.append(kw["eos_ids"]) or generate_batch(*a, **kw))
    one = rows(generate_prompts(target, 8, ["code", "chat"], tmp_path / "one", batch_size=1, **SMALL))
    many = rows(generate_prompts(target, 8, ["code", "chat"], tmp_path / "many", batch_size=5, **SMALL))
    assert one == many and len(one) == 8
    assert all(s == [IM_END, EOS] for s in stops)  # the template's end of turn stops a request, as EOS does
    for r in one:
        i = int(r["id"].split("-")[1])
        assert r["domain"] == ("code", "chat")[i % 2]
        gen = torch.Generator().manual_seed(prompt_seed(0, i))
        toks = generate_batch(target.model, [pre_query(target.tokenizer, r["domain"])[0]], max_new_tokens=24,
                              sampling=SamplingParams(1.0), eos_ids=[IM_END, EOS], generators=[gen])[0]
        assert toks[-1] in (IM_END, EOS)
        assert target.tokenizer.decode(toks[:-1], skip_special_tokens=True).strip() == r["prompt"]


class Interrupted(Exception):
    """Stands for Ctrl-C or a killed job in the middle of generation."""


@pytest.mark.parametrize("resume_batch", [3, 1])
def test_resume_after_interruption_equals_uninterrupted_run(target, tmp_path, monkeypatch, resume_batch) -> None:
    full = rows(generate_prompts(target, 8, ["code", "chat", "json"], tmp_path / "full", batch_size=3, **SMALL))
    calls = []

    def failing(*args, **kwargs):
        if len(calls) == 2:
            raise Interrupted
        calls.append(1)
        return generate_batch(*args, **kwargs)

    monkeypatch.setattr(pg, "generate_batch", failing)
    out = tmp_path / "cut"
    with pytest.raises(Interrupted):
        generate_prompts(target, 8, ["code", "chat", "json"], out, batch_size=3, **SMALL)
    part = tmp_path / "cut.partial" / "rows.jsonl"
    assert not out.exists() and len(part.read_text().splitlines()) == 6
    with part.open("a") as f:
        f.write('{"index": 6, "dom')  # a torn line: the kill came mid-write
    with pytest.raises(DraftsmithError, match="other settings.*temperature"):
        generate_prompts(target, 8, ["code", "chat", "json"], out, temperature=0.8, **SMALL)
    monkeypatch.setattr(pg, "generate_batch", generate_batch)
    assert rows(generate_prompts(target, 8, ["code", "chat", "json"], out, batch_size=resume_batch, **SMALL)) == full
    assert not part.parent.exists()
    batch_dependent = ("surplus", "attempt_indices", "new_tokens_this_run", "seconds_this_run", "tokens_per_s")
    stats, full_stats = (read_json(f / "stats.json") for f in (out, tmp_path / "full"))
    assert {k: v for k, v in stats.items() if k not in batch_dependent} == \
        {k: v for k, v in full_stats.items() if k not in batch_dependent}
    with pytest.raises(DraftsmithError, match="other settings.*seed"):
        generate_prompts(target, 8, ["code", "chat", "json"], out, seed=1, **SMALL)


def test_output_loads_as_prompts_with_domain_tags(target, tmp_path) -> None:
    out = tmp_path / "prompts"
    ds = generate_prompts(target, 9, ["code", "json", "summarize", "chat"], out, max_attempts=80, **SMALL)
    prompts = load_prompts(out)
    assert [(p.id, p.domain, p.prompt) for p in prompts] == [(r["id"], r["domain"], r["prompt"]) for r in rows(ds)]
    stats = read_json(out / "stats.json")
    by_domain = {d: sum(p.domain == d for p in prompts) for d in ("code", "json", "summarize", "chat")}
    assert stats["kept_by_domain"] == by_domain and stats["kept"] == len(prompts)
    assert stats["complete"] and by_domain == {"code": 3, "json": 2, "summarize": 2, "chat": 2}  # shares of 9
    assert 0 < stats["unique_fraction"] <= 1 and stats["generated"] >= stats["kept"]
    assert json.loads(ds.info.description)["draftsmith_prompts"]["n"] == 9
    assert rows(generate_prompts(target, 9, ["code", "json", "summarize", "chat"], out, max_attempts=80,
                                 **SMALL)) == rows(ds)  # a finished folder is loaded


def test_bad_inputs_are_one_line_errors(target, tmp_path) -> None:
    plain = Loaded(target.model, chat_tokenizer(template=None), target.path, "plain")
    cases = [
        (lambda: generate_prompts(plain, 4, ["code"], tmp_path / "a"), "no chat template"),
        (lambda: generate_prompts(target, 0, ["code"], tmp_path / "b"), "n must be >= 1"),
        (lambda: generate_prompts(target, 4, ["code", "poetry"], tmp_path / "c"),
         "unknown prompt domain 'poetry'; known domains: code, json, summarize, chat"),
        (lambda: generate_prompts(target, 4, [], tmp_path / "d"), "unknown prompt domain"),
        (lambda: generate_prompts(target, 4, ["code"], tmp_path / "e", temperature=0), "temperature must be > 0"),
        (lambda: generate_prompts(target, 4, ["code"], tmp_path / "e", dtype="fp8"),
         "dtype must be one of float32, bfloat16"),
        (lambda: generate_prompts(target, 4, ["code"], tmp_path / "f", max_prompt_tokens=10_000),
         "supports 256"),
        # "chat" wants none of 1 prompt: the attempts end on its skipped indices, then nothing was kept
        (lambda: generate_prompts(target, 1, ["code", "chat"], tmp_path / "h", batch_size=1, max_attempts=4,
                                  max_prompt_tokens=8, min_chars=10_000, progress=False), "no request kept out of 2"),
    ]
    for call, message in cases:
        with pytest.raises(DraftsmithError, match=message) as e:
            call()
        assert "\n" not in str(e.value)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "x.txt").write_text("mine")
    with pytest.raises(DraftsmithError, match="not a generate_prompts folder"):
        generate_prompts(target, 4, ["code"], tmp_path / "g", **SMALL)
    assert {p.name for p in tmp_path.iterdir()} == {"g", "h.partial"}  # the others refused before writing


def test_a_bfloat16_writer_leaves_the_target_alone_and_is_its_own_setting(target, tmp_path) -> None:
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    out = tmp_path / "bf16"
    ds = generate_prompts(target, 4, ["code", "chat"], out, dtype="bfloat16", **SMALL)
    assert len(ds) == 4 and read_json(out / "settings.json")["dtype"] == "bfloat16"
    assert all(torch.equal(v, target.model.state_dict()[k]) and v.dtype == torch.float32 for k, v in before.items())
    generate_prompts(target, 4, ["code", "chat"], tmp_path / "f32", **SMALL)
    assert "dtype" not in read_json(tmp_path / "f32" / "settings.json")  # float32 folders keep their old settings
    with pytest.raises(DraftsmithError, match="other settings.*dtype"):
        generate_prompts(target, 4, ["code", "chat"], out, **SMALL)
