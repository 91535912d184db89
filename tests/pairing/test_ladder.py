"""The ladder: each rung over the rung below and over the target alone, per domain, from one interleaved run."""

from __future__ import annotations

import statistics

import pytest

from draftsmith.decode.bench import Validation, _merge
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.speculative import Stats
from draftsmith.pairing.ladder import Rung, ladder, waterfall

GROUPS = ["code", "code", "chat"]
# seconds per prompt (10 tokens each) for each decoder in each of 3 repeats: the target 1 s a prompt; each rung
# faster than the one before by a known, domain-dependent amount
SECONDS = {
    "target_only": [[1.0, 1.0, 1.0], [1.1, 1.1, 1.1], [0.9, 0.9, 0.9]],
    "plain": [[0.8, 0.8, 0.9], [0.85, 0.85, 1.0], [0.7, 0.7, 0.8]],
    "walked": [[0.6, 0.6, 0.9], [0.65, 0.65, 0.95], [0.55, 0.55, 0.75]],
    "int4": [[0.5, 0.5, 0.6], [0.55, 0.55, 0.65], [0.45, 0.45, 0.5]],
}


def _validation() -> Validation:
    per_prompt = [{n: [Stats(new_tokens=10, seconds=s) for s in reps[r]] for n, reps in SECONDS.items()}
                  for r in range(3)]
    repeats = [{n: _merge(sts) for n, sts in r.items()} for r in per_prompt]
    stats = {n: _merge(r[n] for r in repeats) for n in SECONDS}
    return Validation(4, ["a", "b", "c"], 10, "cpu", stats, {n: True for n in SECONDS if n != "target_only"},
                      {}, repeats, GROUPS, per_prompt)


def _brute(a: str, b: str, group: str | None) -> list[float]:
    """tokens/s ratios by hand, in float64: tokens over summed seconds of the group's prompts, per repeat."""
    pick = [i for i, g in enumerate(GROUPS) if group in (None, g)]
    return [(10 * len(pick) / sum(SECONDS[a][r][i] for i in pick)) / (10 * len(pick) / sum(SECONDS[b][r][i]
                                                                                             for i in pick))
            for r in range(3)]


def test_each_rung_over_the_one_below_and_over_the_target_match_the_hand_count() -> None:
    rungs = [Rung("plain", "stock as loaded, plain K = 4", 1.2), Rung("walked", "its walked policy", 1.4),
             Rung("int4", "int4 weights")]
    table = ladder(_validation(), rungs)
    assert table["groups"] == ["all", "code", "chat"] and [r["name"] for r in table["rungs"]] == ["plain", "walked",
                                                                                                   "int4"]
    assert table["rungs"][0]["over_below"] is None and table["rungs"][2]["predicted"] is None
    for i, r in enumerate(table["rungs"]):
        for g in table["groups"]:
            group = None if g == "all" else g
            want = _brute(r["name"], "target_only", group)
            assert r["over_target"][g]["repeats"] == pytest.approx(want, rel=1e-12)
            assert r["over_target"][g]["median"] == pytest.approx(statistics.median(want), rel=1e-12)
            assert r["over_target"][g]["range"] == pytest.approx([min(want), max(want)], rel=1e-12)
            if i:
                below = _brute(r["name"], rungs[i - 1].name, group)
                assert r["over_below"][g]["repeats"] == pytest.approx(below, rel=1e-12)
    # the walked policy bought nothing on chat's prompt in repeat 1 (0.9 s both): the ratio says 1.0 there
    assert table["rungs"][1]["over_below"]["chat"]["repeats"][0] == pytest.approx(1.0)


def test_the_waterfall_steps_from_the_target_alone_through_each_rung() -> None:
    table = ladder(_validation(), [Rung("plain", "plain"), Rung("walked", "walked"), Rung("int4", "int4")])
    bars = waterfall(table, "code")
    assert [b[0] for b in bars] == ["plain", "walked", "int4"] and bars[0][1] == 1.0
    assert [b[2] for b in bars] == [r["over_target"]["code"]["median"] for r in table["rungs"]]
    assert all(bars[i][1] == bars[i - 1][2] for i in range(1, 3))  # each bar starts where the last ended


def test_a_rung_that_was_not_timed_or_appears_twice_is_refused() -> None:
    with pytest.raises(DraftsmithError, match="not timed"):
        ladder(_validation(), [Rung("plain", "p"), Rung("trained", "t")])
    with pytest.raises(DraftsmithError, match="twice"):
        ladder(_validation(), [Rung("plain", "p"), Rung("plain", "again")])
    with pytest.raises(DraftsmithError, match="no rungs"):
        ladder(_validation(), [])
