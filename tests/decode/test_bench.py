"""decode.bench.side_by_side on tiny models: every decoder gives the target's greedy tokens on every prompt, and
each decoder's stats are the merge of its per-prompt runs (the warm-up left out)."""

from __future__ import annotations

import pytest

from draftsmith.decode.bench import side_by_side
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.speculative import KPolicy, Stats, generate
from tests import helpers

V = 40
EOS = V - 1
PROMPTS = [[1, 5, 7, 9, 11, 2, 3, 4, 8, 13, 21, 34, 6, 10, 12, 14, 16, 18], [3], [2, 2, 2, 2, 2, 2, 8]]
N_NEW = 12


@pytest.fixture(scope="module")
def target_model():
    return helpers.tiny_llama(0, V, eos_id=EOS, layers=2)


@pytest.fixture(scope="module")
def results(target_model):
    target = make_runner(target_model, 64)
    drafts = {
        "target_only": None,
        "same": make_runner(target_model, 64),  # the target as its own draft: every token accepted
        "other": make_runner(helpers.tiny_llama(1, V, eos_id=EOS, layers=1), 64),
    }
    out = side_by_side(target, drafts, PROMPTS, k=3, max_new_tokens=N_NEW, eos_ids=[EOS])
    return target, drafts, out


def test_greedy_tokens_equal_the_target_alone_for_every_draft(results, target_model) -> None:
    _, _, out = results
    assert list(out) == ["target_only", "same", "other"]
    fresh = make_runner(target_model, 64)
    reference = [generate(fresh, p, max_new_tokens=N_NEW, eos_ids=[EOS]).tokens for p in PROMPTS]
    assert all(len(t) == N_NEW or t[-1] == EOS for t in reference) and any(len(t) > 1 for t in reference)
    for name, (_, tokens, _) in out.items():
        assert tokens == reference, name


def test_stats_are_the_merge_of_the_per_prompt_runs(results) -> None:
    target, drafts, out = results
    for name, draft in drafts.items():
        stats, tokens, per_prompt = out[name]
        alone = [generate(target, p, draft=draft, max_new_tokens=N_NEW, eos_ids=[EOS], policy=KPolicy(k=3)).stats
                 for p in PROMPTS]
        merged = Stats()
        for s in alone:
            merged = merged.merge(s)
        assert stats.new_tokens == sum(len(t) for t in tokens) == merged.new_tokens
        assert (stats.tau_hist, stats.drafted, stats.accepted) == (merged.tau_hist, merged.drafted, merged.accepted)
        assert stats.seconds > 0 and stats.tokens_per_s > 0
        # the per-prompt stats are the prompts' own runs, and merge into the decoder's stats
        assert [(s.tau_hist, s.new_tokens) for s in per_prompt] == [(s.tau_hist, s.new_tokens) for s in alone]
        assert sum(s.seconds for s in per_prompt) == pytest.approx(stats.seconds)
    only, same, other = (out[n][0] for n in ("target_only", "same", "other"))
    assert only.drafted == 0 and only.acceptance_rate is None and only.mean_tau == 1.0
    assert only.target_forwards == only.new_tokens  # one token per target forward without a draft
    assert same.drafted > 0 and same.acceptance_rate == 1.0 and same.mean_tau > 2.0
    assert same.target_forwards < only.target_forwards
    assert other.drafted > 0 and 0 <= other.accepted <= other.drafted


def test_validate_drafts_is_one_typed_result_that_round_trips(target_model) -> None:
    """The one validation function: baseline first, greedy equality per draft, speedups from the same stats, and
    the JSON form reads back into the same result; a bad call is a one-line error."""
    from draftsmith.decode.bench import Validation, validate_drafts
    from draftsmith.decode.runtime.errors import DraftsmithError

    target = make_runner(target_model, 64)
    wrong = make_runner(helpers.tiny_llama(2, V, eos_id=EOS, layers=1), 64)
    val = validate_drafts(target, {"same": make_runner(target_model, 64)}, PROMPTS, k=2, max_new_tokens=N_NEW,
                          eos_ids=[EOS], names=["a", "b", "c"], desc=None)
    assert list(val.stats) == ["target_only", "same"] and val.drafts == ["same"] and val.prompts == ["a", "b", "c"]
    assert val.greedy_equal == {"same": True}
    assert val.stats["same"].acceptance_rate == 1.0  # the target drafting for itself
    assert val.speedup("same") == val.tok_per_s["same"] / val.tok_per_s["target_only"]
    assert Validation.from_dict(val.to_dict()) == val
    d = val.to_dict()
    assert d["speedup_vs_target_only"] == {"same": val.speedup("same")} and d["tokens"]["same"] == val.stats[
        "same"].new_tokens
    both = validate_drafts(target, {"k2": make_runner(target_model, 64), "k4": make_runner(target_model, 64)},
                           PROMPTS, k=2, max_new_tokens=N_NEW, eos_ids=[EOS], desc=None, policies={"k4": KPolicy(k=4), "k2": KPolicy(k=2)})
    assert both.ks == {"k4": 4} and Validation.from_dict(both.to_dict()) == both  # each draft at its own K
    assert max(both.stats["k2"].tau_hist) == 3 and max(both.stats["k4"].tau_hist) == 5
    sampled = validate_drafts(target, {"other": wrong}, PROMPTS[:1], k=2, max_new_tokens=4, eos_ids=[EOS],
                              greedy=False, desc=None)
    assert sampled.greedy_equal == {"other": None} and sampled.prompts == ["0"]
    for drafts, prompts, needle in (({}, PROMPTS, "at least one draft"), ({"target_only": wrong}, PROMPTS, "baseline"),
                                    ({"x": wrong}, [], "at least one prompt")):
        with pytest.raises(DraftsmithError, match=needle):
            validate_drafts(target, drafts, prompts, k=2, max_new_tokens=4, eos_ids=[EOS], desc=None)


def test_repeats_rotate_who_goes_first_and_report_the_median_and_range(target_model, monkeypatch) -> None:
    """Three repeats: within each, the decoder that runs first moves from prompt to prompt (and from repeat to
    repeat), every repeat's tokens are checked, and the speedup is the median of the repeats' ratios."""
    import statistics

    import draftsmith.decode.bench as bench
    from draftsmith.decode.bench import Validation, validate_drafts

    order, real = [], bench.generate
    monkeypatch.setattr(bench, "generate", lambda t, ids, **kw: order.append(kw.get("draft")) or real(t, ids, **kw))
    target = make_runner(target_model, 64)
    drafts = {"same": make_runner(target_model, 64), "other": make_runner(helpers.tiny_llama(1, V, eos_id=EOS), 64)}
    val = validate_drafts(target, drafts, PROMPTS, k=2, max_new_tokens=N_NEW, eos_ids=[EOS], desc=None, repeats=3)
    timed = order[3:]  # after the warm-up of the three decoders
    assert len(timed) == 3 * len(PROMPTS) * 3
    firsts = [timed[i * 3] for i in range(3 * len(PROMPTS))]  # the first decoder of every (repeat, prompt)
    who = {None: "target_only", drafts["same"]: "same", drafts["other"]: "other"}
    assert [who[f] for f in firsts] == ["target_only", "same", "other", "same", "other", "target_only",
                                        "other", "target_only", "same"]
    assert len(val.repeats) == 3 and val.greedy_equal == {"same": True, "other": True}
    for name in drafts:
        ratios = val.repeat_speedups(name)
        assert ratios == [r[name].tokens_per_s / r["target_only"].tokens_per_s for r in val.repeats]
        assert val.speedup(name) == statistics.median(ratios)
        assert val.speedup_range[name] == [min(ratios), max(ratios)]
    assert val.stats["same"].new_tokens == sum(r["same"].new_tokens for r in val.repeats)
    assert Validation.from_dict(val.to_dict()) == val


def test_bench_repeats_rotate_the_first_mode_and_report_the_median_of_repeat_ratios(monkeypatch) -> None:
    """decode.bench with repeats: each pass interleaves the modes per prompt, the mode that goes first rotating;
    a speedup is the median of the per-repeat ratios (not the ratio of the totals), and a greedy mismatch in any
    repeat is caught."""
    import statistics

    from draftsmith.decode import bench
    from draftsmith.decode.prompts import Prompt

    calls: list[tuple[int, str]] = []
    speed = {"target_only": [1.0, 1.0, 1.0], "speculative_k2": [2.0, 3.0, 10.0]}  # seconds per token by repeat
    wrong = {(2, "speculative_k2")}  # the third repeat's draft emits a wrong token

    def fake_run_mode(pair, mode, ids, n, eos, policy=None):
        if n == 4:  # warm-up
            return [0] * n, 1.0, None
        r = sum(1 for _, m in calls if m == mode) // 2  # two prompts a repeat
        calls.append((r, mode))
        toks = [7] * n if (r, mode) in wrong else [5] * n
        return toks, n / speed[mode][r], None

    monkeypatch.setattr(bench, "_run_mode", fake_run_mode)
    items = [Prompt(id=f"p{i}", prompt="x", domain="code") for i in range(2)]
    modes = ["target_only", "speculative_k2"]
    passes = bench._time_modes(None, items, [[1, 2], [3, 4]], modes, 6, [], False, repeats=3)
    assert [m for _, m in calls[:2]] == modes and [m for _, m in calls[4:6]] == modes[::-1]  # rotated
    ratios = bench._repeat_ratios(passes, "speculative_k2", "target_only")
    assert ratios == pytest.approx([2.0, 3.0, 10.0])
    assert statistics.median(ratios) == pytest.approx(3.0)  # the totals' ratio would be 5.0
    merged, _ = bench._merged(passes)
    assert [r["repeat"] for r in merged["target_only"]] == [0, 0, 1, 1, 2, 2]
    checks = bench._greedy_checks(items, [[1, 2], [3, 4]], passes, ["speculative_k2"], hf_modes=False)
    assert not any(c["greedy_equal"] for c in checks)  # repeat 2 differs: caught
    assert all(c["greedy_equal"] for c in bench._greedy_checks(items, [[1, 2], [3, 4]], passes[:2],
                                                                ["speculative_k2"], hf_modes=False))


def test_group_speedups_are_the_ratio_of_the_groups_own_timings(target_model) -> None:
    """Per-domain speedups: each repeat's tokens/s over the group's prompts only, checked against the raw
    per-prompt timings by hand; a group of every prompt gives the overall speedups; groups survive the JSON form."""
    from draftsmith.decode.bench import Validation, validate_drafts
    from draftsmith.decode.runtime.errors import DraftsmithError

    target = make_runner(target_model, 64)
    drafts = {"same": make_runner(target_model, 64),
              "other": make_runner(helpers.tiny_llama(1, V, eos_id=EOS, layers=1), 64)}
    val = validate_drafts(target, drafts, PROMPTS, k=2, max_new_tokens=N_NEW, eos_ids=[EOS], names=["a", "b", "c"],
                          desc=None, repeats=2, groups=["x", "y", "x"])
    assert len(val.prompt_stats) == 2 and all(len(r["same"]) == 3 for r in val.prompt_stats)
    for r, want in zip(val.prompt_stats, val.ratio_repeats("same", "other", group="x")):
        tps = {n: sum(r[n][i].new_tokens for i in (0, 2)) / sum(r[n][i].seconds for i in (0, 2)) for n in r}
        assert want == pytest.approx(tps["same"] / tps["other"])
    groups = val.by_group()
    assert list(groups) == ["x", "y"] and groups["x"]["prompts"] == ["a", "c"] and groups["y"]["prompts"] == ["b"]
    reps = val.ratio_repeats("other", group="y")
    assert groups["y"]["speedup_repeats"]["other"] == reps and groups["y"]["speedup_range"]["other"] == [min(reps), max(reps)]
    assert val.ratio_repeats("same", group="x") != val.ratio_repeats("same", group="y")  # the groups differ
    whole = validate_drafts(target, drafts, PROMPTS, k=2, max_new_tokens=N_NEW, eos_ids=[EOS], desc=None,
                            groups=["all"] * 3)
    assert whole.ratio_repeats("same", group="all") == pytest.approx(whole.repeat_speedups("same"))
    assert Validation.from_dict(val.to_dict()) == val and "by_group" in val.to_dict()
    with pytest.raises(DraftsmithError, match="no prompt in group"):
        val.ratio_repeats("same", group="z")
    with pytest.raises(DraftsmithError, match="2 groups for 3 prompts"):
        validate_drafts(target, drafts, PROMPTS, k=2, max_new_tokens=N_NEW, eos_ids=[EOS], desc=None, groups=["x", "y"])


def test_bench_modes_are_each_k_then_each_named_policy_once() -> None:
    from draftsmith.decode.bench import spec_policies

    modes = spec_policies([2, 4], ["K=4", "K=8 stop<0.6 siblings=2", "K=8  stop<0.6 siblings=2", "K=4 stop<0.5"])
    assert list(modes) == ["speculative_k2", "speculative_k4", "speculative K=8 stop<0.6 siblings=2",
                           "speculative K=4 stop<0.5"]  # "K=4" is the plain chain at K=4: timed once
    assert modes["speculative K=8 stop<0.6 siblings=2"] == KPolicy(k=8, k_max=16, confidence=0.6, siblings=2)


def test_bench_plot_reads_one_repeat_and_many() -> None:
    """A one-repeat report's per-prompt rows carry no repeat number; the plot reads them as repeat 0."""
    from draftsmith.decode.bench import bench_plot, mode_rates

    one = {"per_prompt": [{"tokens": 8, "seconds": 2.0}, {"tokens": 8, "seconds": 6.0}]}
    two = {"per_prompt": [{"tokens": 8, "seconds": 2.0, "repeat": 1}, {"tokens": 8, "seconds": 4.0, "repeat": 0}]}
    assert mode_rates(one) == [2.0] and mode_rates(two) == [2.0, 4.0]
    report = {"target": "t", "draft": "d", "prompts": ["p0", "p1"], "max_new_tokens": 8, "repeats": 1,
              "modes": {"target_only": one, "speculative_k2": one, "speculative": one}}
    assert bench_plot(report).startswith(b"\x89PNG")

