"""A whole `pair` run on tiny models: every output file, the schema, the sort order, validation."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import torch

from draftsmith.decode.spec import split_specs
from draftsmith.pairing.leaderboard import PairConfig, run_pair
from tests import helpers

WORDS = "the a of to and in is it that for on with as was be by this are or at from code data list sort print".split()


def tiny_tokenizer():
    return helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *WORDS], eos="</s>", bos="<s>", split_punctuation=True)


def save_tiny(path: Path, seed: int, layers: int, vocab: int) -> Path:
    return helpers.save_tiny(path, tiny_tokenizer(), seed, vocab_size=vocab, eos_id=2, bos_id=1, layers=layers,
                             max_positions=512, head_scale=4.0)


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    vocab = len(WORDS) + 3
    target = save_tiny(tmp_path / "target", 0, 3, vocab)
    other = save_tiny(tmp_path / "other", 1, 1, vocab)
    prompts = tmp_path / "prompts.jsonl"
    rows = [("code", "sort the list of data"), ("code", "print the code"), ("chat", "this is it"), ("chat", "the data was on")]
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in rows))
    return target, other, prompts


def test_pair_end_to_end_writes_all_files_with_the_schema(setup, tmp_path: Path) -> None:
    target, other, prompts = setup
    out = tmp_path / "board"
    cfg = PairConfig(candidates=[str(target), str(other), f"derive:{target}:keep=1"], prompts_per_domain=2,
                     max_new_tokens=8, validate=2, validate_prompts=1, draft_quant=None, validate_repeats=2)
    board = run_pair(str(target), out, cfg, prompts=str(prompts), progress=False)
    for name in ("leaderboard.json", "leaderboard.md", "leaderboard.csv", "leaderboard.html",
                 "alpha_by_domain.png", "speedup_vs_k.png", "alpha_by_position.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    on_disk = json.loads((out / "leaderboard.json").read_text())
    assert on_disk["target"] == str(target) and "machine" in on_disk and "settings" in on_disk
    keys = {"draft", "params", "compatible", "compat_notes", "alpha", "alpha_by_domain", "positions", "cost_ratio",
            "verify_cost", "best_k", "predicted_speedup", "measured_speedup"}
    cands = on_disk["candidates"]
    assert len(cands) == 3
    for c in cands:
        assert keys <= set(c), keys - set(c)
        assert set(c["alpha_by_domain"]) == {"code", "chat"}
        assert 1 <= c["best_k"] <= 16 and c["positions"] > 0
    speeds = [c["predicted_speedup"] for c in cands]
    assert speeds == sorted(speeds, reverse=True)
    by_name = {c["draft"]: c for c in cands}
    assert by_name[str(target)]["alpha"] == pytest.approx(1.0)  # the target drafting for itself
    validated = [c for c in cands if c["measured_speedup"] is not None]
    assert len(validated) == 2 and all(c["validation"]["greedy_equal"] for c in validated)
    # decoded side by side over one target-alone run, so that the two speedups compare
    a, b = (c["validation"] for c in validated)
    assert a["target_only_tok_per_s"] == b["target_only_tok_per_s"] and a["target_only_seconds"] > 0
    assert a["side_by_side_with"] == [validated[1]["draft"]] and b["side_by_side_with"] == [validated[0]["draft"]]
    for v in (a, b):  # the median of the interleaved repeats
        assert len(v["measured_speedup_repeats"]) == 2
        assert v["measured_speedup"] == pytest.approx(statistics.median(v["measured_speedup_repeats"]))
    # one target verifies every candidate: their calibrations share its clock, their draft steps stay their own
    timed = [c["decoder_cost"] for c in cands]
    assert all(t["target_side_shared_over"] == 3 for t in timed)
    for key in ("target_token_s", "target_prefill_s", "verify_s"):
        assert all(t[key] == timed[0][key] for t in timed), key
    with open(out / "leaderboard.csv") as f:
        assert len(list(csv.reader(f))) == 4
    assert "<img" in (out / "leaderboard.html").read_text()
    assert board["candidates"] == cands


def test_split_candidates_keeps_derive_layer_lists() -> None:
    assert split_specs("a,b") == ["a", "b"]
    assert split_specs("a,derive:m:layers=0,1,2,b") == ["a", "derive:m:layers=0,1,2", "b"]
    assert split_specs("derive:m:keep=8, c") == ["derive:m:keep=8", "c"]


def save_random_head(folder: Path, target: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from draftsmith.decode.head import Eagle3Head, HeadConfig, save_head

    hf = AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(0)
    head = Eagle3Head(HeadConfig.for_target(hf.config, draft_vocab_size=20), hf.get_input_embeddings())
    return save_head(head, folder)


def test_heads_rank_with_drafts_and_validate_across_k(setup, tmp_path: Path) -> None:
    target, other, prompts = setup
    head = save_random_head(tmp_path / "head", target)
    cfg = PairConfig(candidates=[str(other), f"head:{head}"], prompts_per_domain=2, max_new_tokens=8, validate=2,
                     validate_prompts=1, validate_ks=[1, 2], draft_quant=None)
    board = run_pair(str(target), tmp_path / "board", cfg, prompts=str(prompts), progress=False)
    rows = {c["draft"]: c for c in board["candidates"]}
    h = rows[f"head:{head}"]
    assert h["kind"] == "head" and h["acceptance_method"].startswith("teacher-forced, a head")
    assert h["decoder_cost"]["draft_step_s"] > 0 and h["cost_ratio"] > 0
    for c in rows.values():
        assert c["validation"]["greedy_equal"] and c["decoder_cost"] is not None
        assert set(c["measured_speedup_by_k"]) == {"1", "2", str(c["best_k"])}
        assert c["measured_best_k"] in (1, 2, c["best_k"]) and c["best_k_shortfall"] >= 0
        b = c["prediction_breakdown"]
        assert b["measured_tau"] >= 1 and b["expected_tau"] >= 1 and b["modeled_round_s"] > 0
        # greedy, unquantized: the rows of the validated prompts walk to the decoder's own tokens per round
        assert b["expected_tau_same_prompts"] == pytest.approx(b["measured_tau"], abs=1e-9)
        assert c["prediction_error"] == pytest.approx(abs(c["measured_speedup"] - c["predicted_speedup"])
                                                      / c["measured_speedup"])
    assert "By K:" in (tmp_path / "board" / "leaderboard.md").read_text()


def test_a_cross_tokenizer_draft_is_measured_in_transformers(setup, tmp_path: Path) -> None:
    """Another tokenizer (the same words renumbered, one more): our decoder cannot run it, transformers'
    universal assisted generation can; the row gets that measured speedup beside its prediction, greedy-equal."""
    target, _, prompts = setup
    renumbered = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *reversed(WORDS), "extra"], eos="</s>", bos="<s>",
                                        split_punctuation=True)
    cross = helpers.save_tiny(tmp_path / "cross", renumbered, 3, vocab_size=len(WORDS) + 4, eos_id=2, bos_id=1,
                              layers=1, max_positions=512, head_scale=4.0)
    cfg = PairConfig(candidates=[str(cross)], prompts_per_domain=2, max_new_tokens=8, validate=1,
                     validate_prompts=1, draft_quant=None)
    board = run_pair(str(target), tmp_path / "board", cfg, prompts=str(prompts), progress=False)
    (c,) = board["candidates"]
    assert c["kind"] == "cross-tokenizer" and "validation_note" not in c
    v = c["validation"]
    assert v["engine"].startswith("transformers universal assisted") and v["greedy_equal"] is True
    assert v["k"] == c["best_k"] and v["prompts"] == 2 and v["hf_generate"]["tokens"] == v["hf_assisted"]["tokens"] > 0
    assert c["measured_speedup"] == pytest.approx(v["hf_assisted"]["tok_per_s"] / v["hf_generate"]["tok_per_s"])
    assert c["prediction_error"] == pytest.approx(abs(c["measured_speedup"] - c["predicted_speedup"])
                                                  / c["measured_speedup"])
    assert "in transformers universal assisted generation" in (tmp_path / "board" / "leaderboard.md").read_text()


@pytest.mark.parametrize("spec", ["head:/nonexistent/head", "head:{other}"])
def test_a_bad_head_is_one_line(setup, tmp_path: Path, spec: str) -> None:
    from draftsmith.decode.runtime.errors import DraftsmithError

    target, other, prompts = setup
    cfg = PairConfig(candidates=[spec.format(other=other)], prompts_per_domain=1, max_new_tokens=4)
    with pytest.raises(DraftsmithError, match="head"):
        run_pair(str(target), tmp_path / "board", cfg, prompts=str(prompts), progress=False)


@pytest.mark.parametrize("predicted,measured,needle", [
    (1.2, 0.95, "slower than the target alone"), (1.5, 1.2, "25% off"), (0.8, 1.0, "20% off"),
    (1.3, 1.2, None), (0.9, 0.85, None), (1.2, None, None)])
def test_a_prediction_that_misleads_carries_a_caveat(predicted, measured, needle) -> None:
    from draftsmith.pairing.leaderboard import prediction_caveat

    why = prediction_caveat(predicted, measured)
    assert (why is None) == (needle is None) and (needle is None or needle in why)
