"""Counting target ids on text the target wrote: the count itself, which rows of each data folder are the
target's, and `make_vocab` end to end on a tiny target."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.prompts import Prompt, load_prompts
from draftsmith.distill.data import generate_data
from draftsmith.distill.heads.data import HeadDataConfig, build_head_data, load_head_data
from draftsmith.distill.vocab import data_texts, make_vocab
from draftsmith.pairing.prune import count_tokens
from draftsmith.pairing.prune import read_vocab
from draftsmith.pairing.reference import reference_continuations
from tests import helpers
from tests.distill.test_data import PROMPTS, pair  # noqa: F401 (a fixture)


def test_count_tokens_is_a_plain_count() -> None:
    seqs = [[3, 1, 3], torch.tensor([0, 3]), [], (5,)]
    want = Counter([3, 1, 3, 0, 3, 5])
    assert count_tokens(seqs, 7).tolist() == [want[i] for i in range(7)]
    assert count_tokens([], 4).tolist() == [0, 0, 0, 0]
    for bad in ([[1, 7]], [[-1]]):
        with pytest.raises(DraftsmithError, match="do not fit a vocabulary of 7"):
            count_tokens(bad, 7)


def test_a_gen_data_folder_gives_its_target_rows_only(pair, tmp_path: Path) -> None:  # noqa: F811
    target, draft = pair
    ds = generate_data(target, draft, PROMPTS, tmp_path / "d", source="mixed", mix=0.5, max_new_tokens=4,
                       temperature=0.0, progress=False)
    want = [r["continuation_ids"] for r in ds if r["source"] == "target"]
    assert 0 < len(want) < len(ds)
    assert data_texts(tmp_path / "d", target) == want
    only_draft = generate_data(target, draft, PROMPTS[:2], tmp_path / "od", source="draft", max_new_tokens=4,
                               temperature=0.0, progress=False)
    assert len(only_draft) == 2
    with pytest.raises(DraftsmithError, match="no text the target wrote"):
        data_texts(tmp_path / "od", target)


def test_a_head_data_folder_gives_each_rows_continuation(tmp_path: Path) -> None:
    words = "the a of to and in is it that for on with as was be by this are or at from code data".split()
    tok = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *words], eos="</s>", bos="<s>")
    target = load(str(helpers.save_tiny(tmp_path / "target", tok, 0, eos_id=2, bos_id=1, layers=4, head_scale=4.0)))
    prompts = [Prompt(f"p{i}", "code", " ".join(words[i : i + 4])) for i in range(3)]
    build_head_data(target, prompts, tmp_path / "data", HeadDataConfig(samples=2, max_new_tokens=6, batch_size=4,
                                                                      aux_layers=(1, 2, 3)), progress=False)
    rows = load_head_data(tmp_path / "data")
    assert data_texts(tmp_path / "data", target) == [r["tokens"][r["prompt_len"]:].tolist() for r in rows]


def test_make_vocab_counts_the_targets_continuations(tmp_path: Path, monkeypatch) -> None:
    from tests.pairing.test_leaderboard import WORDS, save_tiny

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    target = save_tiny(tmp_path / "target", 0, 2, len(WORDS) + 3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": "code"}) + "\n"
                               for p in ("sort the list of data", "print the code", "this is it")))
    kept = make_vocab(str(target), tmp_path / "kept.json", prompts=str(prompts), coverage=0.9, max_new_tokens=8,
                      progress=False)
    refs = reference_continuations(load(str(target)), load_prompts(str(prompts)), max_new_tokens=8, progress=False)
    counts = count_tokens(refs["continuation_ids"], len(WORDS) + 3)
    back = read_vocab(tmp_path / "kept.json", len(WORDS) + 3)
    assert torch.equal(back.ids, kept.ids) and back.counted_tokens == int(counts.sum()) > 0
    assert back.covered >= 0.9 > float(counts.sort(descending=True).values[: kept.n - 1].sum() / counts.sum())
    assert back.source["prompt_ids"] == [p.id for p in load_prompts(str(prompts))]
    with pytest.raises(DraftsmithError, match="give one of data"):
        make_vocab(str(target), tmp_path / "x.json", progress=False)
