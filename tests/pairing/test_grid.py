"""`pairing.grid`: the grid names every policy the decoder can run (and only those), and one interleaved run
times each beside the target alone, greedy-equal, for a standalone draft and for a head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.head import save_head
from draftsmith.decode.runtime.loading import load
from draftsmith.pairing.grid import GridConfig, parse_policy_label, policy_grid, policy_label, run_grid
from tests import helpers
from tests.decode.test_head import mimic_head

WORDS = "the a of to and in is it that for on with as was be by this are or at from code data list sort".split()


def test_policy_grid_keeps_what_the_decoder_runs() -> None:
    cfg = GridConfig(k=[1, 2, 3], confidence=[0.0, 0.5], siblings=[0, 3], sibling_depth=[1, 2])
    labels = [policy_label(p) for p in policy_grid(cfg)]
    assert labels == [
        "K=1", "K=1 stop<0.5 siblings=3",
        "K=2", "K=2 stop<0.5", "K=2 stop<0.5 siblings=3", "K=2 stop<0.5 siblings=3 children",
        "K=3", "K=3 stop<0.5", "K=3 stop<0.5 siblings=3", "K=3 stop<0.5 siblings=3 children"]
    assert len(labels) == len(set(labels))
    assert [policy_label(p) for p in policy_grid(GridConfig(k=[4]))] == ["K=4"]
    named = GridConfig(k=[2, 4], policy=["K=8 stop<0.6 siblings=2", "K=4", "K=3 stop<0.5 siblings=3 children"])
    assert [policy_label(p) for p in policy_grid(named)] == [
        "K=2", "K=4", "K=8 stop<0.6 siblings=2", "K=3 stop<0.5 siblings=3 children"]  # K=4 once


@pytest.mark.parametrize("label", ["K=2", "K=5 stop<0.6", "K=8 stop<0.6 siblings=2", "K=3 stop<0.5 siblings=3 children"])
def test_policy_labels_read_back(label: str) -> None:
    assert policy_label(parse_policy_label(label)) == label


@pytest.mark.parametrize("bad", [{"k": [0]}, {"confidence": [1.0]}, {"siblings": [1]}, {"sibling_depth": [3]},
                                 {"quant": ["fp8"]}, {"prompts_per_domain": 0}, {"repeats": 0},
                                 {"policy": ["K=2 fast"]}, {"policy": ["stop<0.5"]}, {"policy": ["K=2 siblings=2"]}])
def test_bad_grid_settings_are_one_line_errors(bad: dict) -> None:
    with pytest.raises(DraftsmithError) as e:
        GridConfig(**bad)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("grid")
    tok = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *WORDS], eos="</s>", bos="<s>")
    target = helpers.save_tiny(root / "target", tok, 0, eos_id=2, bos_id=1, layers=4, head_scale=4.0)
    draft = helpers.save_tiny(root / "draft", tok, 1, eos_id=2, bos_id=1, layers=1, head_scale=4.0)
    hf = load(str(target)).model.double()
    head = save_head(mimic_head(hf).float(), root / "head")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i:i + 4]), "domain": d}) + "\n"
                               for i, d in ((0, "code"), (5, "chat"), (9, "code"))))
    return {"target": str(target), "draft": str(draft), "head": f"head:{head}", "prompts": str(prompts)}


def test_a_grid_times_every_policy_greedy_equal(world: dict, tmp_path: Path) -> None:
    cfg = GridConfig(prompts=world["prompts"], prompts_per_domain=1, max_new_tokens=8, k=[1, 2],
                     confidence=[0.0, 0.9], siblings=[0, 2], quant=["none"])
    for draft in (world["draft"], world["head"]):
        out = tmp_path / "grid.json"
        result = run_grid(world["target"], draft, cfg, out=out)
        names = [policy_label(p) for p in policy_grid(cfg)]
        assert list(result["tok_per_s"]) == ["target_only", *names]
        assert result["greedy_equal"] == {n: True for n in names}
        assert json.loads(out.read_text())["policies"]["K=2 stop<0.9 siblings=2"]["siblings"] == 2
        assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")  # the policies drawn beside it
        assert result["prompts"] and result["machine"] and result["versions"]
        # each policy ran as named: no round drafted more than its K (a sibling round proposes its m)
        for n, p in result["policies"].items():
            assert max(map(int, result["stats"][n]["tau_hist"])) <= p["k"] + 1


def test_named_policies_and_repeats(world: dict) -> None:
    cfg = GridConfig(prompts=world["prompts"], prompts_per_domain=1, max_new_tokens=6, k=[2],
                     policy=["K=3 stop<0.9 siblings=2"], quant=["none"], repeats=2)
    result = run_grid(world["target"], world["draft"], cfg)
    assert list(result["greedy_equal"]) == ["K=2", "K=3 stop<0.9 siblings=2"] and all(result["greedy_equal"].values())
    assert len(result["repeats"]) == 2 and all(len(v) == 2 for v in result["speedup_repeats"].values())


def test_two_quants_run_side_by_side(world: dict) -> None:
    cfg = GridConfig(prompts=world["prompts"], prompts_per_domain=1, max_new_tokens=6, k=[2], quant=["int8", "none"])
    result = run_grid(world["target"], world["head"], cfg)
    assert set(result["greedy_equal"]) == {"K=2 int8", "K=2 none"} and all(result["greedy_equal"].values())
