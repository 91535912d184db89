"""The cost model: the speedup math against hand-computed values and the paper, best K on constructed
cost curves, and measurement on tiny random runners (orderings, not exact times)."""

import json
import math
import time

import pytest
import torch

from draftsmith.decode.runtime.runner import make_runner
from draftsmith.pairing.cost import CostModel, expected_tau, measure_cost, predicted_speedup, speedup_curve
from draftsmith.pairing.policy import choose_policy, taus_from_alpha
from tests import helpers

KS = range(1, 17)


# -- the math --


def test_expected_tau_and_speedup_by_hand() -> None:
    assert expected_tau(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)  # 3.3616
    assert expected_tau(0.8, 4) == pytest.approx(3.3616)
    assert predicted_speedup(0.8, 4, 0.1, 1.2) == pytest.approx(3.3616 / 1.6)  # 2.101
    assert predicted_speedup(0.8, 4, 0.1, 1.2) == pytest.approx(2.101)
    assert expected_tau(1.0, 5) == 6.0  # every draft accepted plus the bonus
    assert expected_tau(0.0, 7) == 1.0  # only the corrected token
    assert expected_tau(0.5, 1) == pytest.approx(1.5)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("K", [1, 2, 5, 16])
@pytest.mark.parametrize("c", [0.0, 0.05, 0.5])
def test_leviathan_special_case(alpha: float, K: int, c: float) -> None:
    paper = (1 - alpha ** (K + 1)) / ((1 - alpha) * (K * c + 1))  # Leviathan et al. 2023, Thm 3.8
    assert predicted_speedup(alpha, K, c, 1.0) == pytest.approx(paper, rel=1e-12)


def test_expected_tau_continuous_at_alpha_one() -> None:
    assert expected_tau(1 - 1e-9, 8) == pytest.approx(9.0, rel=1e-6)


@pytest.mark.parametrize(
    "args",
    [(-0.1, 4, 0.1, 1.0), (1.1, 4, 0.1, 1.0), (math.nan, 4, 0.1, 1.0), (0.5, 0, 0.1, 1.0),
     (0.5, 4, -0.1, 1.0), (0.5, 4, 0.1, 0.0), (0.5, 4, 0.1, -1.0), (0.5, 4, math.nan, 1.0)],
)
def test_invalid_inputs_raise(args) -> None:
    with pytest.raises(ValueError):
        predicted_speedup(*args)



def best_k(alpha: float, c: float, v: dict[int, float]) -> tuple[int, float]:
    """K and its predicted speedup for i.i.d. acceptance, through the one chooser (pairing.policy)."""
    choice = choose_policy(CostModel.from_ratios(c, v), taus=taus_from_alpha(alpha, 16))
    return choice.k, choice.predicted


def test_invalid_inputs_name_the_problem() -> None:
    with pytest.raises(ValueError, match="alpha"):
        expected_tau(1.5, 3)
    with pytest.raises(ValueError, match="K must be >= 1"):
        expected_tau(0.5, 0)
    with pytest.raises(ValueError, match="c must be >= 0"):
        predicted_speedup(0.5, 3, -1, 1.0)
    with pytest.raises(ValueError, match=r"v\(K\) must be > 0"):
        best_k(0.5, 0.1, {1: 1.0, 2: 0.0})
    with pytest.raises(ValueError, match="empty"):
        best_k(0.5, 0.1, {})


# -- best K on constructed curves --


def test_flat_verify_cost_and_cheap_draft_pick_a_large_k() -> None:
    K, s = best_k(0.95, 0.01, {k: 1.0 for k in KS})
    assert K >= 12
    brute = max(((1 - 0.95 ** (k + 1)) / (0.05 * (0.01 * k + 1)), k) for k in KS)
    assert (s, K) == (pytest.approx(brute[0]), brute[1])


def test_steep_verify_cost_picks_a_small_k() -> None:
    flat, _ = best_k(0.8, 0.05, {k: 1.0 for k in KS})
    steep, _ = best_k(0.8, 0.05, {k: 1.0 + 0.5 * k for k in KS})
    assert steep <= 2 < flat


def test_a_dip_in_verify_cost_is_picked() -> None:
    # shaped like the CPU measurement: T=3 (K=2) expensive, T=4 (K=3) cheap again, then rising
    v = {1: 1.45, 2: 2.15, 3: 1.45, 4: 2.3, 5: 2.4, 6: 2.45, 7: 2.5, 8: 2.6}
    K, s = best_k(0.8, 0.05, v)
    assert K == 3
    assert s == speedup_curve(0.8, 0.05, v)[3] == max(speedup_curve(0.8, 0.05, v).values())


def test_alpha_zero_picks_k_one() -> None:
    assert best_k(0.0, 0.1, {k: 1.0 for k in KS})[0] == 1
    assert best_k(0.0, 0.0, {k: 1.0 for k in KS}) == (1, 1.0)  # all tied: the smaller K


def test_ties_go_to_the_smaller_k() -> None:
    # alpha = 1, c = 0: speedup = (K+1) / v(K); make K = 3 and K = 7 tie exactly at 2.0
    v = {1: 4.0, 3: 2.0, 5: 6.0, 7: 4.0}
    assert speedup_curve(1.0, 0.0, v)[3] == speedup_curve(1.0, 0.0, v)[7] == 2.0
    assert best_k(1.0, 0.0, v) == (3, 2.0)


def test_speedup_curve_covers_exactly_the_ks_given() -> None:
    v = {4: 1.3, 1: 1.1, 9: 2.0}
    curve = speedup_curve(0.7, 0.2, v)
    assert list(curve) == [1, 4, 9]
    assert curve[4] == predicted_speedup(0.7, 4, 0.2, 1.3)


def test_cost_model_ratios_and_dict() -> None:
    cost = CostModel(target_step_s=0.02, draft_step_s=0.004, verify_s={1: 0.03, 2: 0.05}, context=64, repeats=5)
    assert cost.c == pytest.approx(0.2)
    assert cost.v == pytest.approx({1: 1.5, 2: 2.5})
    d = json.loads(json.dumps(cost.to_dict()))
    assert d["c"] == pytest.approx(0.2) and d["v"] == pytest.approx({"1": 1.5, "2": 2.5})
    assert d["target_step_s"] == 0.02 and d["verify_s"]["2"] == 0.05 and d["context"] == 64
    assert CostModel.from_dict(d) == cost


# -- measurement on tiny runners --


def tiny_hf(seed: int, layers: int = 2, hidden: int = 32):
    return helpers.tiny_llama(seed, 61, layers=layers, hidden=hidden, head_scale=1.0)


class Slow:
    """A runner that sleeps 5 ms on every call: slower than a tiny model's step by a wide margin."""

    def __init__(self, runner) -> None:
        self.runner, self.vocab_size, self.max_seq_len = runner, runner.vocab_size, runner.max_seq_len
        self.calls = 0

    def forward(self, tokens, pos, keep=0):
        self.calls += 1
        time.sleep(0.005)
        return self.runner.forward(tokens, pos, keep)


def test_measure_cost_same_architecture() -> None:
    target = make_runner(tiny_hf(0), 128)
    draft = make_runner(tiny_hf(1), 128)
    # 9 rounds: on 2 shared cores a preempted call costs a ~5 ms time slice; the median must outvote those
    cost = measure_cost(target, draft, context=32, repeats=9, warmup=1)
    assert sorted(cost.verify_s) == list(KS)
    assert cost.target_step_s > 0 and cost.draft_step_s > 0
    assert all(t > 0 for t in cost.verify_s.values())
    assert 0.2 < cost.c < 5  # same shapes; a loose band for a noisy shared machine
    assert (cost.context, cost.repeats) == (32, 9)
    json.dumps(cost.to_dict())


def test_measure_cost_int8_draft_and_hf_runner() -> None:
    # the runners as pairing will use them: an int8 lean draft, and HF's own runner (cache cropped on rollback)
    target = make_runner(tiny_hf(0), 64, lean=False)
    draft = make_runner(tiny_hf(1), 64, quantize="int8")
    cost = measure_cost(target, draft, ks=[1, 4], context=16, repeats=2, warmup=1)
    assert sorted(cost.verify_s) == [1, 4] and cost.c > 0 and all(x > 0 for x in cost.v.values())


def test_slow_draft_costs_more_than_fast_target() -> None:
    target = make_runner(tiny_hf(0), 64)
    draft = Slow(make_runner(tiny_hf(1), 64))
    cost = measure_cost(target, draft, ks=[1, 2, 3], context=16, repeats=5, warmup=1)
    assert cost.draft_step_s >= 0.005
    assert cost.c > 1
    assert draft.calls == 1 + (1 + 5)  # cache fill, then one draft step per round (warm-up included)
    slow_target = measure_cost(Slow(make_runner(tiny_hf(0), 64)), make_runner(tiny_hf(1), 64),
                               ks=[1, 2], context=16, repeats=5, warmup=1)
    assert slow_target.c < 1


def test_timing_reuses_one_position_after_filling_the_cache() -> None:
    calls = []

    class Recorder:
        vocab_size, max_seq_len = 61, 40

        def forward(self, tokens, pos, keep=0):
            calls.append((tokens.tolist(), pos, keep))
            return torch.zeros(keep or len(tokens), 61)

    measure_cost(Recorder(), Recorder(), ks=[1, 3], context=8, repeats=2, warmup=1)
    assert calls[0] == (list(range(8)), 0, 1) and calls[1] == (list(range(8)), 0, 1)  # fill both caches
    timed = calls[2:]
    assert len(timed) == 3 * 4  # (warm-up + repeats) rounds x (target, draft, K=1, K=3)
    assert {pos for _, pos, _ in timed} == {8}
    assert timed[:4] == [([8], 8, 0), ([8], 8, 1), ([8, 9], 8, 0), ([8, 9, 10, 11], 8, 0)]


def test_measure_cost_rejects_what_does_not_fit() -> None:
    target, draft = make_runner(tiny_hf(0, layers=1), 32), make_runner(tiny_hf(1, layers=1), 32)
    with pytest.raises(ValueError, match="target cache holds 32"):
        measure_cost(target, draft, ks=range(1, 17), context=16)
    with pytest.raises(ValueError, match="ks"):
        measure_cost(target, draft, ks=[], context=8)
    with pytest.raises(ValueError, match="ks"):
        measure_cost(target, draft, ks=[0, 1], context=8)
    with pytest.raises(ValueError, match="repeats"):
        measure_cost(target, draft, ks=[1], context=8, repeats=0)
    with pytest.raises(ValueError, match="context"):
        measure_cost(target, draft, ks=[1], context=0)


# -- cost as it happens: the decoder's own round times --


def test_decoder_speedup_by_hand() -> None:
    from draftsmith.pairing.cost import decoder_speedup

    # alone: 0.1 s prefill + 10 tokens * 0.02 s = 0.3 s; with the draft: 0.12 + 10 / 2.5 * 0.03 = 0.24 s
    assert decoder_speedup(2.5, 3, 10, target_token_s=0.02, target_prefill_s=0.1, spec_prefill_s=0.12,
                           round_s=0.03) == pytest.approx(0.3 / 0.24)
    # no prefill, tau tokens a round at one target step a round: tau
    assert decoder_speedup(3.0, 4, 7, target_token_s=1.0, target_prefill_s=0.0, spec_prefill_s=0.0,
                           round_s=1.0) == pytest.approx(3.0)
    for bad in ({"tau": 0.5}, {"tau": 5.5}, {"tokens": 0}, {"round_s": 0.0}):
        args = {"tau": 2.0, "K": 4, "tokens": 10, **bad}
        with pytest.raises(ValueError):
            decoder_speedup(args["tau"], args["K"], args["tokens"], target_token_s=0.01, target_prefill_s=0.0,
                            spec_prefill_s=0.0, round_s=args["round_s"] if "round_s" in args else 0.02)


class VirtualClock:
    """Stands in for the `time` module of the timed code: only `Ticking` runner calls move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Ticking(Slow):
    """A runner whose every call costs exactly `s` seconds of a `VirtualClock` (and nothing else does)."""

    def __init__(self, runner, clock: VirtualClock, s: float) -> None:
        super().__init__(runner)
        self.clock, self.s = clock, s

    def forward(self, tokens, pos, keep=0):
        self.clock.now += self.s
        return self.runner.forward(tokens, pos, keep)


def test_calibrated_prediction_matches_a_decode_dominated_by_known_times(monkeypatch) -> None:
    """Target forwards cost 12 ms whatever their length, draft steps 3 ms, on a virtual clock (so a busy
    machine cannot move the numbers); the draft is the target itself (every draft accepted). The calibration
    reads those times back, and its prediction at another K and another length matches the decoder's
    measured speedup."""
    import draftsmith.decode.bench
    import draftsmith.decode.speculative
    import draftsmith.pairing.cost
    from draftsmith.decode.bench import validate_drafts
    from draftsmith.pairing.cost import calibrate_decoder

    clock = VirtualClock()
    for module in (draftsmith.decode.bench, draftsmith.decode.speculative, draftsmith.pairing.cost):
        monkeypatch.setattr(module, "time", clock)
    hf = tiny_hf(0)
    target, draft = Ticking(make_runner(hf, 128), clock, 0.012), Ticking(make_runner(hf, 128), clock, 0.003)
    iso = measure_cost(target, draft, ks=[1, 2, 3, 4], context=16, repeats=3, warmup=1)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    dc = calibrate_decoder(target, draft, prompts, k=2, isolated=iso, max_new_tokens=12)
    assert dc.calibration_k == 2 and dc.calibration_tokens == 24 and dc.calibration_seconds > 0
    assert dc.draft_step_s == pytest.approx(0.003) and dc.target_token_s == pytest.approx(0.012)
    assert dc.verify_s[2] == pytest.approx(0.012) and dc.target_prefill_s == pytest.approx(0.012)
    assert dc.spec_prefill_s == pytest.approx(0.015) and dc.other_s == pytest.approx(0, abs=1e-12)
    assert dc.round_s(3) == pytest.approx(3 * dc.draft_step_s + dc.verify_s[3] + dc.other_s)
    json.dumps(dc.to_dict())
    val = validate_drafts(target, {"d": draft}, prompts, k=3, max_new_tokens=24, eos_ids=[], desc=None)
    st = val.stats["d"]
    assert val.greedy_equal["d"]
    predicted = dc.speedup(st.new_tokens / st.target_forwards, 3, 24)
    # about 2.1x here; a model that left out the draft steps would predict about 3.4x
    assert predicted == pytest.approx(val.speedup("d"), rel=0.02)
    with pytest.raises(ValueError, match="K=5"):
        calibrate_decoder(target, draft, prompts, k=5, isolated=iso)
    # a dip in the isolated shape (a busy machine timed the 3-token verify below the 2-token one) is not trusted:
    # v(K) is carried up from the largest time at any K below
    import dataclasses

    dipped = dataclasses.replace(iso, verify_s={1: 0.012, 2: 0.009, 3: 0.015, 4: 0.014})
    dc = calibrate_decoder(target, draft, prompts, k=1, isolated=dipped, max_new_tokens=12)
    assert dc.verify_s[1] == pytest.approx(0.012) and dc.verify_s[2] == pytest.approx(0.012)
    assert dc.verify_s[3] == pytest.approx(0.015) == pytest.approx(dc.verify_s[4])


class Stalling(Ticking):
    """A `Ticking` runner whose `stall_at`-th call costs `stall` seconds more (a page fault, a cold kernel)."""

    def __init__(self, runner, clock: VirtualClock, s: float, stall_at: int, stall: float) -> None:
        super().__init__(runner, clock, s)
        self.calls, self.stall_at, self.stall = 0, stall_at, stall

    def forward(self, tokens, pos, keep=0):
        self.calls += 1
        if self.calls == self.stall_at:
            self.clock.now += self.stall
        return super().forward(tokens, pos, keep)


@pytest.mark.parametrize("stalled", ["draft", "target"])
def test_one_stalled_forward_does_not_set_the_calibrated_round(monkeypatch, stalled) -> None:
    """One forward 30x slower than the rest (draft step 3 ms, target 12 ms) leaves every per-round time the
    calibration reads where the other rounds put it; a mean over the rounds would not (checked)."""
    import draftsmith.decode.speculative
    import draftsmith.pairing.cost
    from draftsmith.pairing.cost import calibrate_decoder

    clock = VirtualClock()
    for module in (draftsmith.decode.speculative, draftsmith.pairing.cost):
        monkeypatch.setattr(module, "time", clock)
    hf = tiny_hf(0)
    slow = {"draft": (0, 6), "target": (9, 0)}[stalled]  # which call of each runner stalls (0: none)
    target = Stalling(make_runner(hf, 128), clock, 0.012, slow[0], 0.36)
    draft = Stalling(make_runner(hf, 128), clock, 0.003, slow[1], 0.09)
    iso = CostModel(target_step_s=0.012, draft_step_s=0.003, verify_s={1: 0.012, 2: 0.012}, context=16, repeats=1)
    dc = calibrate_decoder(target, draft, [[1, 2, 3, 4, 5], [7, 8, 9]], k=2, isolated=iso, max_new_tokens=12)
    assert dc.draft_step_s == pytest.approx(0.003) and dc.target_token_s == pytest.approx(0.012)
    assert dc.verify_s[2] == pytest.approx(0.012) and dc.other_s == pytest.approx(0, abs=1e-12)
    assert target.calls >= slow[0] and draft.calls >= slow[1]  # the stall happened inside the timed decodes


def test_a_walks_speedup_is_its_rounds_time_by_hand() -> None:
    from draftsmith.pairing.cost import DecoderCost, decoder_speedup

    dc = DecoderCost(target_token_s=0.05, target_prefill_s=0.1, spec_prefill_s=0.11, draft_step_s=0.004,
                     other_s=0.001, verify_s={1: 0.052, 2: 0.054, 3: 0.07}, calibration_k=1,
                     calibration_seconds=1.0, calibration_tokens=32)
    # 2 prompts, 7 tokens: rounds of 2, 1, 2 drafts and a plain step at the budget's end
    want = (2 * 0.1 + 7 * 0.05) / (2 * 0.11 + dc.round_s(2) * 2 + dc.round_s(1) + 0.05)
    assert dc.walk_speedup(7, [2, 1, 2, 0], 2) == pytest.approx(want)
    # rounds all of K drafts emitting tau tokens each: the fixed-K formula
    assert dc.walk_speedup(30, [2] * 12, 1) == pytest.approx(decoder_speedup(
        2.5, 2, 30, target_token_s=0.05, target_prefill_s=0.1, spec_prefill_s=0.11, round_s=dc.round_s(2)))
    # a sibling round: two tokens proposed in one draft step, verified over three rows
    sib = 0.004 + 0.054 + 0.001
    assert dc.round_s(2, steps=1) == pytest.approx(sib)
    want = (2 * 0.1 + 7 * 0.05) / (2 * 0.11 + dc.round_s(2) + sib + dc.round_s(1) + 0.05)
    assert dc.walk_speedup(7, [(2, 2), (1, 2), (1, 1), (0, 0)], 2) == pytest.approx(want)
    with pytest.raises(ValueError, match="round"):
        dc.walk_speedup(7, [], 2)


def _calibrated(token: float, verify: dict[int, float], step: float, prefill: float = 0.1, extra: float = 0.01):
    from draftsmith.pairing.cost import DecoderCost

    return DecoderCost(target_token_s=token, target_prefill_s=prefill, spec_prefill_s=prefill + extra,
                       draft_step_s=step, other_s=0.001, verify_s=verify, calibration_k=2, calibration_seconds=1.0,
                       calibration_tokens=64)


def test_a_shared_target_clock_is_the_median_of_the_target_side_and_keeps_each_drafts() -> None:
    from draftsmith.pairing.cost import shared_target_clock

    costs = [_calibrated(0.14, {1: 0.15, 2: 0.16, 3: 0.18}, 0.015),
             _calibrated(0.17, {1: 0.21, 2: 0.21, 3: 0.22}, 0.014, prefill=0.2, extra=0.03),  # a slow window
             _calibrated(0.13, {1: 0.14, 2: 0.17, 3: 0.17}, 0.022)]
    shared = shared_target_clock(costs)
    for s, c in zip(shared, costs):
        assert s.target_token_s == 0.14 and s.target_prefill_s == 0.1 and s.shared_over == 3
        assert s.verify_s == {1: 0.15, 2: 0.17, 3: 0.18}  # pointwise medians: still non-decreasing
        assert (s.draft_step_s, s.other_s) == (c.draft_step_s, c.other_s)
        assert s.spec_prefill_s == pytest.approx(0.1 + c.spec_prefill_s - c.target_prefill_s)
    assert shared_target_clock(costs[:1]) == costs[:1]


def test_a_slow_calibration_window_no_longer_ranks_a_faster_draft_below() -> None:
    """The same target's verify timed 30% slower in one draft's window (as the EPYC timed 0.206 s against
    0.157-0.164 s in the others, its one-token step unchanged): alone, that prices the draft with the cheaper step
    below the others; with the target's side shared, the cheaper step ranks first (the negative control: unshared)."""
    from draftsmith.pairing.cost import shared_target_clock

    fast_window = _calibrated(0.14, {2: 0.16}, 0.018)
    slow_window = _calibrated(0.14, {2: 0.16 * 1.3}, 0.015)  # the cheaper draft, timed in a slow window
    third = _calibrated(0.14, {2: 0.16}, 0.020)
    tau, n = 2.5, 48
    before = [c.speedup(tau, 2, n) for c in (fast_window, slow_window, third)]
    after = [c.speedup(tau, 2, n) for c in shared_target_clock([fast_window, slow_window, third])]
    assert before[1] < before[2] < before[0]  # the drift alone decides it
    assert after[1] > after[0] > after[2]  # the draft steps decide it
