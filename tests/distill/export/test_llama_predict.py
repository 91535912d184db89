"""llama-server's speedup predicted from llama.cpp's costs: the arithmetic against brute force (simulated server
runs, least squares in float64), the parity flag and the verdict. The real engine: test_llama_cpp.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from draftsmith.distill.export.llama_predict import (PARITY_GAP, EngineCost, curve, fit_rest, parity_row, rounds_of,
                                          seconds_per_round, verdict)


def _simulated_run(rng: random.Random, K: int, prompts: int, a: list[float], round_s: float) -> dict:
    """A server run as llama-server counts it: each prompt's first token from its prompt pass, then rounds that
    accept drafts until the first rejection (depth j accepted with probability a[j-1]) and add the target's
    token. Returns its counts, its generation time and the true number of rounds."""
    generated = accepted = rounds = 0
    for _ in range(prompts):
        generated += 1
        for _ in range(rng.randint(1, 30)):
            n = 0
            while n < K and rng.random() < a[n]:
                n += 1
            generated, accepted, rounds = generated + n + 1, accepted + n, rounds + 1
    return {"predicted_n": generated, "accepted": accepted, "drafted": rounds * K, "prompts": prompts,
            "predicted_ms": 1000.0 * rounds * round_s, "rounds": rounds}


@pytest.mark.parametrize("seed", range(5))
def test_rounds_and_speedup_match_a_simulated_server(seed: int) -> None:
    rng = random.Random(seed)
    K, a = rng.randint(1, 6), [rng.random() for _ in range(6)]
    cost = EngineCost(target_token_s=0.05, verify_s={K: 0.07}, draft_step_s=0.01, rest_s=0.02)
    run = _simulated_run(rng, K, rng.randint(1, 4), a, cost.round_s(K))
    assert rounds_of(run["predicted_n"], run["accepted"], run["prompts"]) == run["rounds"]
    assert seconds_per_round(run) == pytest.approx(cost.round_s(K), rel=1e-12)
    tau = (run["predicted_n"] - run["prompts"]) / run["rounds"]  # tokens a round in this run
    # tokens/s with the draft (the rounds' tokens over their time) over the target alone's 1 / target_token_s
    measured = (run["predicted_n"] - run["prompts"]) / (run["predicted_ms"] / 1000.0) * cost.target_token_s
    assert cost.speedup(tau, K) == pytest.approx(measured, rel=1e-12)
    assert cost.round_s(K) == pytest.approx(K * 0.01 + 0.07 + 0.02)


def test_speedup_refuses_impossible_tau_and_unknown_k() -> None:
    cost = EngineCost(target_token_s=0.05, verify_s={2: 0.07}, draft_step_s=0.01, rest_s=0.0)
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        cost.speedup(3.5, 2)
    with pytest.raises(ValueError, match="no verify time for K=4"):
        cost.round_s(4)
    assert cost.to_dict()["round_s"] == {"2": pytest.approx(0.09)}


def test_fit_rest_recovers_a_line_and_matches_least_squares() -> None:
    verify = {1: 0.05, 3: 0.06, 4: 0.062}
    b, a = 0.013, 0.021
    assert fit_rest([(k, b * k + a + verify[k]) for k in (1, 3)], verify, None) == pytest.approx((b, a), rel=1e-12)
    rng = np.random.default_rng(0)
    pts = [(k, b * k + a + verify[k] + rng.normal(0, 1e-3)) for k in (1, 3, 4, 1)]
    slope, icept = np.polyfit([k for k, _ in pts], [s - verify[k] for k, s in pts], 1)
    assert fit_rest(pts, verify, None) == pytest.approx((slope, icept), rel=1e-9)
    # a known draft step (llama-bench's): the rest is the mean of what is left
    got = fit_rest([(1, 0.05 + 0.01 + 0.02), (3, 0.06 + 0.03 + 0.04)], verify, 0.01)
    assert got == pytest.approx((0.01, 0.03))


def test_fit_rest_keeps_both_parts_non_negative() -> None:
    verify = {1: 0.05, 3: 0.05}
    # rounds cheaper at a longer K (noise): no negative draft step, the rest is the mean
    assert fit_rest([(1, 0.09), (3, 0.08)], verify, None) == pytest.approx((0.0, 0.035))
    # a line through a negative intercept: the rest clamps to 0 and the step refits through the origin
    b, a = fit_rest([(1, 0.05 + 0.005), (3, 0.05 + 0.045)], verify, None)
    assert a == 0.0 and b == pytest.approx((1 * 0.005 + 3 * 0.045) / 10)
    assert fit_rest([(1, 0.04)], verify, 0.02) == (0.02, 0.0)  # less than the forwards: no negative rest
    with pytest.raises(ValueError, match="two K"):
        fit_rest([(1, 0.09), (1, 0.08)], verify, None)


def test_parity_row_flags_a_gap_beyond_the_threshold_only() -> None:
    row = parity_row(3, (30, 60), (45, 90), expected=0.5)
    assert row["llama_cpp"] == 0.5 and row["decoder"] == 0.5 and row["expected"] == 0.5 and not row["flagged"]
    just = parity_row(2, (int(100 * (0.5 + PARITY_GAP)) - 1, 100), (50, 100), None)
    assert not just["flagged"]
    far = parity_row(2, (20, 100), (50, 100), expected=0.5)  # the export changed the draft: 0.2 against 0.5
    assert far["flagged"] and far["gap"] == pytest.approx(-0.3)
    # without our decoder's counts the expected value is the reference
    assert parity_row(1, (10, 100), None, expected=0.5)["flagged"]
    assert parity_row(1, (0, 0), None, expected=0.5)["gap"] is None


def test_curve_and_verdict() -> None:
    cost = EngineCost(target_token_s=0.1, verify_s={1: 0.12, 2: 0.13}, draft_step_s=0.05, rest_s=0.03)
    rows = curve(cost, {1: 1.8, 2: 2.4}, {1: 0.9, 2: None})
    assert rows[0]["predicted"] == pytest.approx(1.8 * 0.1 / 0.2)
    assert rows[0]["error"] == pytest.approx((0.9 - 0.9) / 0.9, abs=1e-12) and rows[1]["error"] is None
    assert "don't use a draft in llama.cpp on this machine" in verdict(rows)
    assert "measured best 0.90x at K = 1" in verdict(rows)
    fast = EngineCost(target_token_s=0.3, verify_s={1: 0.12, 2: 0.13}, draft_step_s=0.05, rest_s=0.03)
    text = verdict(curve(fast, {1: 1.8, 2: 2.4}, {}))
    assert text.startswith("predicted best") and text.endswith("serve it in llama.cpp at K = 2")
