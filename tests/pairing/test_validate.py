"""The validate stage's result read back (`pairing.validate.BenchResult`, validate/bench.json) and the run's verdict
(`pairing.validate.verdict`): one function of the validate and export stages' typed results, which the report
only renders."""

from __future__ import annotations

import json

import pytest

from draftsmith.decode.bench import Validation
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.speculative import KPolicy, Stats
from draftsmith.distill.export.results import DraftExport, HeadExport, read_export
from draftsmith.pairing.ladder import Rung
from draftsmith.pairing.policy import PolicyChoice
from draftsmith.pairing.validate import BenchResult, DraftUnderTest, ValidationResult, after_vs_before, verdict


def bench(before: float, after: float, **extra) -> BenchResult:
    """A summary as docs/results keeps one: speedups with their range over three repeats, four test prompts."""
    return BenchResult.from_dict({
        "k": 2, "speedup_vs_target_only": {"draft_before": before, "draft_after": after},
        "speedup_range": {"draft_before": [before - 0.02, before + 0.01], "draft_after": [after - 0.03, after + 0.02]},
        "repeats": [{}, {}, {}], "prompts": ["a", "b", "c", "d"], "in_sample": False,
        "policies": {"draft_before": {"k": 2}, "draft_after": {"k": 2, "confidence": 0.6, "siblings": 3}}, **extra})


def test_no_verdict_before_validate_has_measured() -> None:
    assert verdict(None) is None and verdict(BenchResult.from_dict({"k": 2})) is None


def test_when_no_draft_pays_the_verdict_says_so_and_what_came_closest() -> None:
    said = verdict(bench(0.85, 0.97), read_export({"best_k": 2, "serving": {"vLLM": "vllm serve T"}}))
    assert said == ("no draft beats the target alone here: best 0.97x (distilled draft; median of 3 repeats, range "
                    "0.94x-0.99x, on 4 test prompts never used to train or choose, greedy-equal) — don't serve one.",
                    False)
    in_sample = verdict(bench(0.85, 0.97, in_sample=True, repeats=[]))[0]
    assert "median of 1 repeats" in in_sample and "held-out dev prompts it was chosen on (in-sample)" in in_sample


def test_a_paying_draft_is_named_with_its_policy_and_where_else_it_was_measured() -> None:
    b = bench(1.1, 1.34, labels={"draft_after": "head"})
    text, pays = verdict(b)
    assert pays and text == ("serve the head with draftsmith's decoder at K = 2, its 3 most probable first tokens "
                             "side by side below probability 0.6: 1.34x the target alone (median of 3 repeats, range "
                             "1.31x-1.36x, on 4 test prompts never used to train or choose, greedy-equal).")
    run = {"speedup_vs_target_only": 0.6, "draft_max": 2, "accepted": 5, "drafted": 9, "prompts": 2}
    slow = read_export({"best_k": 2, "serving": {"vLLM": "vllm serve T"},
                        "llama_cpp": {"q8_0": run, "f16": {**run, "speedup_vs_target_only": 0.8, "draft_max": 3}}})
    assert isinstance(slow, DraftExport)
    assert verdict(b, slow)[0].endswith(" In llama.cpp (llama-server) it measured 0.80x at K = 3: don't use it there "
                                        "on this machine. vLLM / SGLang lines are in the export section (not "
                                        "measured here).")
    head = read_export({"vllm": "v", "sglang": "s", "k": 2, "serving": {}, "llama_cpp": {
        "target_alone_mean_tokens_per_s": 10.0, "target_alone_tokens_per_s": [10.0, 10.0],
        "runs": {"1": {**run, "speedup_vs_target_only": 1.2, "draft_max": 1}, "2": run}}})
    assert isinstance(head, HeadExport)
    assert verdict(b, head)[0].endswith(" In llama.cpp (llama-server) it measured 1.20x at K = 1.")
    predicted = read_export({"llama_cpp": {"q8_0": run}, "llama_cpp_prediction": {"verdict": "predicted best 0.9x"}})
    assert verdict(b, predicted)[0].endswith(" In llama.cpp (llama-server) predicted best 0.9x.")  # over measured


def test_the_fastest_kind_compares_its_pick_with_the_stock_draft_at_the_same_policy_search() -> None:
    """The race stage's verdict adds its fair line: the race's pick over the stock draft at its walked policy,
    overall and per domain, naming the ladder's steps between them."""
    def st(seconds: float) -> Stats:
        return Stats({1: 16}, 0, 0, 16, 0.0, seconds)

    reps = [{"target_only": st(4.0), "draft_before": st(2.0 + d), "int4": st(1.8 + d), "draft_after": st(1.6 + d)}
            for d in (0.0, 0.1)]
    per = [{n: [s, s] for n, s in r.items()} for r in reps]
    merged = {n: Stats({1: 32}, 0, 0, 32, 0.0, sum(r[n].seconds for r in reps)) for n in reps[0]}
    val = Validation(4, ["code-0", "chat-0"], 16, "cpu", merged, {n: True for n in merged if n != "target_only"},
                     repeats=reps, groups=["code", "chat"], prompt_stats=per)
    drafts = [DraftUnderTest("draft_before", "m0", label="stock m0 at its walked policy", alpha=0.5,
                             step="its walked policy"),
              DraftUnderTest("int4", "int4:m0", label="int4 m0", alpha=0.5, step="int4 weights"),
              DraftUnderTest("draft_after", "prune:int4:m0:vocab=v.json", label="int4 m0 pruned", alpha=0.5,
                             chooses=True, step="vocabulary pruned to 64 ids")]
    policy = KPolicy.fixed(4)
    written = ValidationResult("t", drafts, val, {d.name: policy for d in drafts}, PolicyChoice(policy, 2.0, "raced"),
                               {d.name: "int8" for d in drafts}, kind="race").to_dict()
    b = BenchResult.from_dict(json.loads(json.dumps(written)))
    assert b.after_vs_before == after_vs_before(val) and b.validation == Validation.from_dict(written)
    text, pays = verdict(b)
    # over the target alone: 4.0 / 1.6 = 2.50 and 4.0 / 1.7 = 2.35, median 2.43; over the stock draft at its
    # walked policy: 2.0 / 1.6 = 1.25 and 2.1 / 1.7 = 1.235, median 1.243, in every domain alike
    assert pays and text.startswith("serve the int4 m0 pruned with draftsmith's decoder at K = 4: 2.43x the target "
                                    "alone (median of 2 repeats, range 2.35x-2.50x")
    assert text.endswith(" The race's pick (int4 m0 pruned) over the stock m0 at its walked policy (the same policy "
                         "search on the same dev prompts; what differs: int4 weights, vocabulary pruned to 64 ids): "
                         "all 1.24x (1.24-1.25); code 1.24x (1.24-1.25); chat 1.24x (1.24-1.25).")
    standalone = BenchResult.from_dict({**b.to_dict(), "kind": "standalone"})
    assert "race's pick" not in verdict(standalone)[0]  # only the fastest kind ran the same search for both


def test_bench_json_reads_back_typed_whole_or_as_a_summary() -> None:
    """The record the stage writes reads back to the same JSON with its timing typed; a summary without timing
    (docs/results) reads too, with no `validation`; a newer version is a one-line error."""
    st = Stats({1: 8, 2: 4}, 12, 4, 16, 0.1, 2.0)
    val = Validation(2, ["p0"], 16, "cpu", {"target_only": Stats({1: 16}, 0, 0, 16, 0.1, 4.0), "draft_after": st},
                     {"draft_after": True}, repeats=[{"target_only": Stats({1: 16}, 0, 0, 16, 0.1, 4.0),
                                                      "draft_after": st}])
    drafts = [DraftUnderTest("draft_after", "m0", alpha=0.5, chooses=True)]
    written = json.loads(json.dumps(ValidationResult(
        "t", drafts, val, {"draft_after": KPolicy.fixed(2)}, PolicyChoice(KPolicy.fixed(2), 1.8, "best predicted"),
        {"draft_after": "int8"}, {"cost_ratio": 0.1}, roles={"timed_split": "test"}).to_dict()))
    assert written["version"] == BenchResult.VERSION == 1
    b = BenchResult.from_dict(written)
    assert b.to_dict() == written and b.validation == val and b.k_of("draft_after") == 2
    assert b.speedup("draft_after") == 2.0 and b.speedup("draft_before") is None and b.cost_ratio == 0.1
    summary = {key: written[key] for key in ("k", "speedup_vs_target_only", "speedup_range", "prompts")}
    old = BenchResult.from_dict(summary)  # no version: written before versions were
    assert old.version == 1 and old.validation is None and old.to_dict() == {**summary, "version": 1}
    with pytest.raises(DraftsmithError) as e:
        BenchResult.from_dict({**written, "version": 2}, "runs/x/validate/bench.json")
    assert "runs/x/validate/bench.json" in str(e.value) and "version 2" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DraftsmithError, match="bench.json: its timing does not read"):
        BenchResult.from_dict({**written, "stats": {"target_only": {}}}, "bench.json")


def test_the_ladder_rungs_read_typed() -> None:
    val = Validation(2, ["p0"], 8, "cpu", {n: Stats({1: 8}, 0, 0, 8, 0.0, s) for n, s in
                                            (("target_only", 2.0), ("a", 1.0), ("b", 0.5))},
                     {"a": True, "b": True}, repeats=[{n: Stats({1: 8}, 0, 0, 8, 0.0, s) for n, s in
                                                       (("target_only", 2.0), ("a", 1.0), ("b", 0.5))}])
    from draftsmith.pairing.ladder import ladder

    b = BenchResult(ladder=ladder(val, [Rung("a", "stock", 1.5), Rung("b", "int4")]))
    first, second = b.rungs()
    assert (first.name, first.predicted, first.spread("all", below=True)) == ("a", 1.5, None)
    assert second.spread("all")["median"] == 4.0 and second.spread("all", below=True)["median"] == 2.0
    assert b.steps_between("a", "b") == ["int4"] and b.steps_between("a", "c") == [] == BenchResult().rungs()
