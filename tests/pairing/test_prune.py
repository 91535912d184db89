"""The prune:MODEL:vocab=FILE spec: parsing, the kept-ids file and its checks, the one route from a spec to a
model and a runner, and a pruned candidate ranked beside its whole model on the pair leaderboard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.pruned import PrunedRunner
from draftsmith.decode.spec import DraftSpec
from draftsmith.pairing.derive import resolve_candidate
from draftsmith.pairing.drafts import load_draft, model_runner
from draftsmith.pairing.prune import build_vocab, read_vocab
from tests import helpers
from tests.pairing.test_leaderboard import WORDS, save_tiny, setup  # noqa: F401 (a fixture)

# --- the spec ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,expected", [
    ("prune:qwen2.5-coder-0.5b-instruct:vocab=kept.json", ("qwen2.5-coder-0.5b-instruct", Path("kept.json"))),
    ("prune:derive:m:keep=4:vocab=/a/b.json", ("derive:m:keep=4", Path("/a/b.json"))),
    ("prune:runs/x/best:vocab=v.json", ("runs/x/best", Path("v.json"))),
    ("qwen2.5-coder-0.5b-instruct", None),
    ("derive:m:keep=4", None),
])
def test_parse_prune_spec(spec: str, expected) -> None:
    d = DraftSpec.parse(spec, sniff=False)
    assert ((d.inner.text, d.vocab) if d.kind == "prune" else None) == expected


@pytest.mark.parametrize("spec,message", [
    ("prune:m", "expected prune:MODEL:vocab=FILE"),
    ("prune:m:vocab=", "expected prune:MODEL:vocab=FILE"),
    ("prune::vocab=f.json", "expected prune:MODEL:vocab=FILE"),
    ("prune:head:h:vocab=f.json", "MODEL must be a standalone model"),
    ("prune:prune:m:vocab=a:vocab=b", "MODEL must be a standalone model"),
])
def test_parse_prune_spec_errors(spec: str, message: str) -> None:
    with pytest.raises(DraftsmithError, match=message):
        DraftSpec.parse(spec, sniff=False)


def test_resolve_candidate_refuses_a_pruned_spec_in_one_line() -> None:
    with pytest.raises(DraftsmithError, match="vocabulary-pruned draft runs in draftsmith's decoder only") as e:
        resolve_candidate("prune:m:vocab=f.json")
    assert "\n" not in str(e.value)


# --- the kept-ids file ------------------------------------------------------------------------------------------


def test_build_and_read_back_by_coverage_and_by_size(tmp_path: Path) -> None:
    counts = torch.tensor([0, 5, 1, 9, 9, 0, 3, 2])  # ranked 9, 9, 5, 3, 2, 1: shares .31 .62 .79 .90 .97 1
    kept = build_vocab(counts, tmp_path / "c.json", coverage=0.8, source={"data": "x"})
    assert kept.ids.tolist() == [1, 3, 4, 6] and kept.covered == pytest.approx(26 / 29)
    back = read_vocab(tmp_path / "c.json", 8)
    assert torch.equal(back.ids, kept.ids) and back.vocab_size == 8 and back.coverage == 0.8
    assert back.covered == pytest.approx(26 / 29) and back.counted_tokens == 29 and back.source == {"data": "x"}
    on_disk = json.loads((tmp_path / "c.json").read_text())
    assert on_disk["format"] == "draftsmith-kept-vocab" and on_disk["n"] == len(on_disk["ids"]) == 4
    sized = build_vocab(counts, tmp_path / "s.json", coverage=None, size=5, context_ids=False)
    assert sized.ids.tolist() == [1, 3, 4, 6, 7] and read_vocab(tmp_path / "s.json", 8).coverage is None
    assert back.context and not read_vocab(tmp_path / "s.json", 8).context  # the default; and as asked
    old = {k: v for k, v in on_disk.items() if k != "context_ids"}  # a file from before context ids: without them
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert not read_vocab(tmp_path / "old.json", 8).context


def test_build_vocab_coverage_takes_the_fewest_ids(tmp_path: Path) -> None:
    counts = torch.tensor([0, 5, 1, 9, 9, 0, 3, 2])
    for coverage, n in ((23 / 29, 3), (0.8, 4), (1.0, 6), (1e-6, 1)):
        assert build_vocab(counts, tmp_path / "v.json", coverage=coverage).n == n


@pytest.mark.parametrize("kwargs,message", [
    ({"coverage": None}, "give one of coverage"),
    ({"coverage": 0.9, "size": 3}, "give one of coverage"),
    ({"coverage": None, "size": 0}, "keeps 1..8 ids"),
    ({"coverage": None, "size": 9}, "keeps 1..8 ids"),
    ({"coverage": 1.5}, "coverage must be in"),
])
def test_build_vocab_errors(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(DraftsmithError, match=message):
        build_vocab(torch.tensor([0, 5, 1, 9, 9, 0, 3, 2]), tmp_path / "v.json", **kwargs)
    assert not (tmp_path / "v.json").exists()


def vocab_file(path: Path, **fields) -> Path:
    doc = {"format": "draftsmith-kept-vocab", "version": 1, "vocab_size": 8, "n": 3, "ids": [1, 3, 4]} | fields
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("fields,message", [
    ({"ids": [], "n": 0}, r"keeps no ids \(N = 0\)"),
    ({"ids": [1, 3, 8]}, r"ids outside the target's vocabulary \[0, 8\)"),
    ({"ids": [-1, 3, 4]}, r"ids outside the target's vocabulary \[0, 8\)"),
    ({"ids": [1, 3, 3]}, "kept more than once"),
    ({"vocab_size": 9}, "built for a vocabulary of 9 ids, the target has 8"),
    ({"n": 4}, "corrupt kept-vocabulary file"),
    ({"ids": [1, "3", 4]}, "corrupt kept-vocabulary file"),
    ({"ids": None}, "corrupt kept-vocabulary file"),
    ({"format": "something-else"}, "not a kept-vocabulary file"),
    ({"context_ids": "yes"}, "context_ids must be true or false"),
])
def test_read_vocab_errors_are_one_line(tmp_path: Path, fields: dict, message: str) -> None:
    with pytest.raises(DraftsmithError, match=message) as e:
        read_vocab(vocab_file(tmp_path / "v.json", **fields), 8)
    assert "\n" not in str(e.value)


def test_a_missing_or_corrupt_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DraftsmithError, match="no such kept-vocabulary file"):
        read_vocab(tmp_path / "absent.json", 8)
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)))  # not UTF-8: one line, not a UnicodeDecodeError
    with pytest.raises(DraftsmithError, match="not text") as e:
        read_vocab(tmp_path / "binary.bin", 8)
    assert "\n" not in str(e.value)
    (tmp_path / "bad.json").write_text('{"format": "draftsmith-kept-vocab", "ids": [1, 2')
    with pytest.raises(DraftsmithError, match="not valid JSON"):
        read_vocab(tmp_path / "bad.json", 8)
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    with pytest.raises(DraftsmithError, match="not a kept-vocabulary file"):
        read_vocab(tmp_path / "list.json", 8)


# --- from a spec to a model and a runner ------------------------------------------------------------------------


def load_model_draft(spec: str, target, **kw):
    """(the model, the kept ids) of a standalone draft spec, as `pairing.drafts.load_draft` loads it."""
    d = load_draft(spec, target, **kw)
    return d.loaded, d.kept


def test_load_model_draft_and_draft_runner(setup, tmp_path: Path) -> None:
    target_dir, other, _ = setup
    target = load(target_dir)
    V = len(WORDS) + 3
    f = vocab_file(tmp_path / "v.json", vocab_size=V, ids=[2, 5, 7, 9], n=4)
    loaded, kept = load_model_draft(f"prune:{other}:vocab={f}", target)
    assert loaded.name == f"prune:{other}:vocab={f}" and kept.ids.tolist() == [2, 5, 7, 9]
    runner, quant = model_runner(loaded.model, kept, 32, "int8")
    assert isinstance(runner, PrunedRunner) and quant == "int8" and runner.vocab_size == V
    plain, none = load_model_draft(str(other), target)
    assert none is None and not isinstance(model_runner(plain.model, None, 32, None)[0], PrunedRunner)


def test_a_model_and_its_pruned_variants_share_one_copy_of_its_weights(setup, tmp_path: Path) -> None:
    """With `shared`, MODEL and prune:MODEL:... load MODEL once (each keeps its own name); without, each loads."""
    target_dir, other, _ = setup
    target = load(target_dir)
    f = vocab_file(tmp_path / "v.json", vocab_size=len(WORDS) + 3, ids=[2, 5, 7, 9], n=4)
    shared: dict = {}
    whole, _ = load_model_draft(str(other), target, shared=shared)
    pruned, kept = load_model_draft(f"prune:{other}:vocab={f}", target, shared=shared)
    assert pruned.model is whole.model and len(shared) == 1 and kept is not None
    assert whole.name == str(other) and pruned.name == f"prune:{other}:vocab={f}"
    alone, _ = load_model_draft(f"prune:{other}:vocab={f}", target)  # negative control: no dict, a copy of its own
    assert alone.model is not whole.model


def test_load_model_draft_refuses_what_cannot_prune(setup, tmp_path: Path) -> None:
    target_dir, other, _ = setup
    target = load(target_dir)
    wrong_size = vocab_file(tmp_path / "w.json", vocab_size=99)
    with pytest.raises(DraftsmithError, match="built for a vocabulary of 99 ids"):
        load_model_draft(f"prune:{other}:vocab={wrong_size}", target)
    renumbered = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *reversed(WORDS)], eos="</s>", bos="<s>",
                                        split_punctuation=True)
    cross = helpers.save_tiny(tmp_path / "cross", renumbered, 3, vocab_size=len(WORDS) + 3, eos_id=2, bos_id=1,
                              layers=1)
    ok = vocab_file(tmp_path / "ok.json", vocab_size=len(WORDS) + 3)
    with pytest.raises(DraftsmithError, match="different tokenizers"):
        load_model_draft(f"prune:{cross}:vocab={ok}", target)


def test_validate_opens_a_pruned_spec_as_the_decoder_runs_it(setup, tmp_path: Path) -> None:
    from draftsmith.pairing.drafts import open_draft

    target_dir, other, _ = setup
    f = vocab_file(tmp_path / "v.json", vocab_size=len(WORDS) + 3, ids=[2, 5, 7], n=3)
    opened = open_draft(f"prune:{other}:vocab={f}", load(target_dir), 32, None)
    assert isinstance(opened.runner, PrunedRunner) and opened.quant is None
    assert opened.runner.head.weight.shape[0] == 3


# --- the pair leaderboard ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("context", [False, True])
def test_a_pruned_candidate_ranks_beside_its_whole_model(setup, tmp_path: Path, context: bool) -> None:
    """The target drafting for itself, whole and pruned to the ids it writes most often less the most written
    one: teacher-forced at temperature 0 the pruned copy is accepted exactly where the target's token is kept
    (with context ids: or read before, in the prompt or the continuation), so its alpha is the share of such
    tokens in the references (the whole copy's is 1). Both validate greedy-equal; the row says what was kept and
    that llama.cpp cannot run it pruned."""
    from draftsmith.decode.prompts import load_prompts
    from draftsmith.pairing.prune import count_tokens
    from draftsmith.pairing.leaderboard import PairConfig, run_pair
    from draftsmith.pairing.reference import reference_continuations

    target_dir, other, prompts = setup
    target = load(target_dir)
    refs = reference_continuations(target, load_prompts(str(prompts), limit_per_domain=2), max_new_tokens=8,
                                   progress=False)
    conts = [list(c) for c in refs["continuation_ids"]]
    counts = count_tokens(conts, len(WORDS) + 3)
    counts[int(counts.argmax())] = 0  # drop the most written id: the draft cannot propose it
    kept = build_vocab(counts, tmp_path / "kept.json", coverage=1.0, context_ids=context)
    ids = set(kept.ids.tolist())
    hits = [t in ids or (context and t in set(list(p) + c[:j]))
            for p, c in zip(refs["prompt_ids"], conts) for j, t in enumerate(c)]
    share = sum(hits) / len(hits)
    assert 0 < share < 1
    if context:  # the dropped id is read before it is written again: context ids recover some of it
        assert share > sum(t in ids for c in conts for t in c) / len(hits)
    pruned = f"prune:{target_dir}:vocab={tmp_path / 'kept.json'}"
    cfg = PairConfig(candidates=[str(target_dir), pruned, str(other)], prompts_per_domain=2, max_new_tokens=8,
                     validate=3, validate_prompts=1, draft_quant=None)
    board = run_pair(str(target_dir), tmp_path / "board", cfg, prompts=str(prompts), progress=False)
    rows = {c["draft"]: c for c in board["candidates"]}
    assert set(rows) == {str(target_dir), pruned, str(other)}
    whole, p = rows[str(target_dir)], rows[pruned]
    assert whole["alpha"] == pytest.approx(1.0) and p["alpha"] == pytest.approx(share, abs=1e-12)
    assert p["compatible"] and p["kind"] == "same-tokenizer" and p["llama_cpp_compatible"] is False
    assert p["draft_vocab"]["n"] == kept.n and whole["draft_vocab"] is None
    assert any(n.startswith("vocabulary-pruned: proposes") for n in p["compat_notes"])
    assert p["draft_vocab"]["context_ids"] is context
    assert p["cost_ratio"] > 0 and p["validation"]["greedy_equal"] and whole["validation"]["greedy_equal"]
    assert pruned in (tmp_path / "board" / "leaderboard.md").read_text()


# --- int4:MODEL -------------------------------------------------------------------------------------------------


def test_resolve_candidate_refuses_an_int4_spec_in_one_line() -> None:
    with pytest.raises(DraftsmithError, match="int4 draft runs in draftsmith's decoder only") as e:
        resolve_candidate("int4:qwen2.5-coder-0.5b-instruct")
    assert "\n" not in str(e.value)


def test_an_int4_spec_loads_its_model_and_runs_int4_where_it_can(tmp_path: Path, monkeypatch) -> None:
    """`int4:MODEL` and `prune:int4:MODEL:vocab=FILE` load MODEL and run it int4 (int8 where the rows do not fit
    draftsmith's int4 kernel: a model 32 wide), whatever the caller's own quantisation; a plain spec is unchanged."""
    from draftsmith.decode.runtime.quant import Int4Linear, int4_chunk
    from tests.pairing.test_leaderboard import save_tiny as save
    from tests.pairing.test_leaderboard import tiny_tokenizer

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    V = len(WORDS) + 3
    target = load(save(tmp_path / "target", 0, 1, V))
    helpers.save_tiny(tmp_path / "wide", tiny_tokenizer(), 3, vocab_size=V, eos_id=2, bos_id=1, layers=1,
                      hidden=128, max_positions=512)
    f = vocab_file(tmp_path / "v.json", vocab_size=V, ids=[2, 5, 7, 9], n=4)
    quant = lambda spec: DraftSpec.parse(spec, sniff=False).quant  # noqa: E731
    assert quant(f"int4:{tmp_path / 'wide'}") == "int4" == quant(f"prune:int4:m:vocab={f}")
    assert quant(str(tmp_path / "wide")) is None
    for spec in (f"int4:{tmp_path / 'wide'}", f"prune:int4:{tmp_path / 'wide'}:vocab={f}"):
        loaded, kept = load_model_draft(spec, target)
        assert loaded.name == spec and (kept is None) == (DraftSpec.parse(spec).kind == "int4")
        runner, quant = model_runner(loaded.model, kept, 32, "int8", spec)
        assert quant == ("int4" if int4_chunk() else "int8")
        inner = runner.inner if isinstance(runner, PrunedRunner) else runner
        assert any(isinstance(m, Int4Linear) for m in inner.modules()) == (quant == "int4")
    plain, _ = load_model_draft(str(tmp_path / "wide"), target)
    assert model_runner(plain.model, None, 32, "int8", str(tmp_path / "wide"))[1] == "int8"  # negative control


def test_an_int4_candidate_ranks_with_the_alpha_of_its_int4_weights(setup, tmp_path: Path) -> None:
    """The target drafting for itself: whole and float it agrees everywhere (alpha 1); as `int4:` its ranking reads
    the int4 weights it decodes with, which disagree somewhere (alpha < 1; the decoder agrees: its validated
    rounds emit fewer than K + 1 tokens). Its head unscaled, so that its argmax has near ties to flip."""
    from draftsmith.decode.runtime.quant import int4_chunk
    from draftsmith.pairing.leaderboard import PairConfig, run_pair
    from tests.pairing.test_leaderboard import tiny_tokenizer

    if not int4_chunk():
        pytest.skip("no int4 kernel on this CPU (AVX-512BW or AVX2)")
    _, _, prompts = setup
    target = helpers.save_tiny(tmp_path / "flat", tiny_tokenizer(), 0, vocab_size=len(WORDS) + 3, eos_id=2,
                               bos_id=1, layers=2, max_positions=512, head_scale=1.0)
    spec = f"int4:{target}"
    cfg = PairConfig(candidates=[str(target), spec], prompts_per_domain=2, max_new_tokens=12, validate=2,
                     validate_prompts=2, draft_quant=None)
    board = run_pair(str(target), tmp_path / "board", cfg, prompts=str(prompts), progress=False)
    rows = {c["draft"]: c for c in board["candidates"]}
    assert rows[str(target)]["alpha"] == pytest.approx(1.0)
    assert 0.3 < rows[spec]["alpha"] < 1.0
    val = rows[spec]["validation"]
    assert val["greedy_equal"] and val["mean_tau"] < val["k"] + 1


def test_a_calibrated_int4_spec_names_its_file_pruned_or_not(tmp_path) -> None:
    from draftsmith.decode.runtime.quant import write_calib
    from draftsmith.pairing.drafts import calibration as spec_calib

    path = write_calib(tmp_path / "calib.json", [[1, 2, 3]])
    for spec in (f"int4:m:calib={path}", f"prune:int4:m:calib={path}:vocab=kept.json"):
        assert spec_calib(spec).sequences == ((1, 2, 3),) and DraftSpec.parse(spec, sniff=False).quant == "int4"
    assert spec_calib("int4:m") is None and spec_calib("prune:int4:m:vocab=kept.json") is None
    with pytest.raises(DraftsmithError, match="no such calibration file"):
        spec_calib(f"int4:m:calib={tmp_path / 'none.json'}")
    with pytest.raises(DraftsmithError, match="int4:MODEL:calib=FILE"):
        spec_calib(f"prune:m:calib={path}:vocab=kept.json")
