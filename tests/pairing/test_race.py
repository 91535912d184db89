"""`pairing.race.winner`: the measured speedup picks, alpha breaks a tie on a few dev prompts."""

from __future__ import annotations

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.pairing.race import TIE, raced, winner


def row(draft: str, alpha: float, measured: float | None, predicted: float = 1.5, compatible: bool = True) -> dict:
    return {"draft": draft, "alpha": alpha, "measured_speedup": measured, "predicted_speedup": predicted,
            "compatible": compatible}


def test_within_the_tie_the_higher_alpha_wins_outside_it_the_faster() -> None:
    board = {"candidates": [row("whole", 0.84, 2.00), row("16k", 0.779, 2.18), row("32k", 0.818, 2.16)]}
    assert winner(board)["draft"] == "32k"  # 2.16 is within 2% of 2.18: a tie, and 32k has the higher alpha
    assert winner(board, tie=0.0)["draft"] == "16k"  # no tie allowed: the faster (the same board, another answer)
    board["candidates"][2]["measured_speedup"] = 2.10  # 3.7% slower: no longer a tie
    assert winner(board)["draft"] == "16k"
    assert 0 < TIE < 0.05


def test_equal_alpha_in_a_tie_goes_to_the_faster_and_unmeasured_rows_go_by_prediction() -> None:
    board = {"candidates": [row("a", 0.8, 2.17), row("b", 0.8, 2.18), row("c", 0.9, None, predicted=9.0)]}
    assert winner(board)["draft"] == "b"  # c was not decoded: a measured row wins over any prediction
    board = {"candidates": [row("a", 0.8, None, 1.7), row("b", 0.9, None, 1.6), row("c", 0.95, 3.0, compatible=False)]}
    assert winner(board)["draft"] == "a"
    with pytest.raises(DraftsmithError, match="tokenizer"):
        winner({"candidates": [row("c", 0.95, 3.0, compatible=False)]})


def test_a_race_replaces_the_measured_speedups_and_only_raced_rows_can_win_by_measure() -> None:
    board = {"candidates": [row("a", 0.84, 1.86, predicted=2.0), row("b", 0.84, 1.71, predicted=2.06),
                            row("c", 0.82, 1.87, predicted=2.05)]}
    result = {"drafts": {"b": {"measured_speedup": 2.09, "policy": {"k": 7}},
                         "a": {"measured_speedup": 1.73, "policy": {"k": 4}}}}
    after = raced(board, result)
    assert [c["measured_speedup"] for c in after["candidates"]] == [1.73, 2.09, None]
    assert after["candidates"][1]["policy"] == {"k": 7} and after["candidates"][2]["policy"] is None
    # at plain K, c measured fastest and a, within 2% with the higher alpha, won the tie (the EPYC ranking, where
    # a was the stock 0.5B itself)
    assert winner(after)["draft"] == "b" and winner(board)["draft"] == "a"
    assert board["candidates"][1]["measured_speedup"] == 1.71  # the board itself is left as it was


def test_with_a_reference_the_best_worst_domain_wins_not_the_fastest_overall() -> None:
    """The goal is per domain (each domain over the stock draft at its K): a draft fastest over all prompts
    because one domain runs far ahead loses to one that clears both. The control: without the reference the same
    race picks the fastest overall."""
    board = {"candidates": [row("pruned", 0.83, None), row("int4", 0.84, None), row("stock", 0.84, None)]}
    drafts = {"pruned": {"measured_speedup": 2.15, "policy": {"k": 8}, "worst_over_reference": 1.05},
              "int4": {"measured_speedup": 2.05, "policy": {"k": 7}, "worst_over_reference": 1.14},
              "stock": {"measured_speedup": 1.95, "policy": {"k": 7}, "worst_over_reference": 1.06}}
    assert winner(raced(board, {"drafts": drafts}))["draft"] == "int4"
    plain = {d: {k: v for k, v in r.items() if k != "worst_over_reference"} for d, r in drafts.items()}
    assert winner(raced(board, {"drafts": plain}))["draft"] == "pruned"
    drafts["pruned"]["worst_over_reference"] = 1.13  # within 2% of int4's 1.14: a tie, alpha decides
    assert winner(raced(board, {"drafts": drafts}))["draft"] == "int4"
    board["candidates"][0]["alpha"] = 0.85
    assert winner(raced(board, {"drafts": drafts}))["draft"] == "pruned"


def test_a_race_is_reused_only_against_the_same_walked_reference() -> None:
    """Resuming: a race.json is reused when it raced the same drafts against the base at its walked policy; one
    written before the fair reference (the base at a fixed K) is raced again."""
    from draftsmith.pairing.race import race_reusable

    drafts = {"stock": {}, "int4:stock": {}}
    fair = {"drafts": drafts, "reference": {"draft": "stock", "policy": "walked", "name": "draft0"}}
    old = {"drafts": drafts, "reference": {"draft": "stock", "k": 4, "name": "reference", "greedy_equal": True}}
    assert race_reusable(fair, ["int4:stock", "stock"], "stock")
    assert not race_reusable(old, ["int4:stock", "stock"], "stock")
    assert not race_reusable(fair, ["stock"], "stock") and not race_reusable(fair, ["int4:stock", "stock"], None)
    assert race_reusable({"drafts": drafts}, ["stock", "int4:stock"], None)
