"""Every stage's result as a type (`decode.runtime.records.Record`): read back, it writes the same JSON (`to_dict(from_dict(d))
== d`); a record written before versions were reads as version 1; a newer version, a missing key or a value that is
no JSON object is a one-line DraftsmithError naming the file. The records below are shaped as their writers write
them (the writer itself where it is cheap: `export_head`, `run_pair`'s `PairLeaderboard`); docs/results keeps real
ones, trimmed, which must read too."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from draftsmith.decode.runtime.records import Part, Record
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.distill.export.results import (DraftExport, GgufExport, HeadExport, HeadGguf, HeadLlamaCpp, HfExport,
                                               LlamaServerRun, read_export)
from draftsmith.distill.heads.pipeline import HeadRunConfig
from draftsmith.distill.pipeline import DistillConfig
from draftsmith.distill.results import (DataCap, DistillResult, HeadData, HeadResult, HeadSettings,
                                        HeadTrainSummary, LogRow, PromptStats, RowStats, TrainSettings,
                                        TrainSummary, read_log)
from draftsmith.distill.train import TrainConfig
from draftsmith.pairing.leaderboard import PairLeaderboard
from draftsmith.pairing.race import RaceResult, RankedDraft
from draftsmith.pairing.validate import BenchResult, LadderRung

ROOT = Path(__file__).resolve().parents[2]
SPREAD = {"median": 1.1, "range": [1.0, 1.2], "repeats": [1.2, 1.1, 1.0]}
RUN = {"drafted": 60, "accepted": 50, "acceptance": 0.833, "prompts": 4, "predicted_n": 256, "tokens_per_s": 11.2,
       "draft_max": 3, "spec_type": "draft-simple", "p_min": 0.0, "threads": 1, "server_version": "v",
       "speedup_vs_target_only": 1.12, "greedy_equal": {"prompts": 4, "equal": 4}}
STATS = {"rows": 4, "tokens": 157, "new_tokens": 105, "generate_seconds": 0.31, "feature_seconds": 0.0,
         "skipped_shards": 0, "cut_shards": 0, "generate_tokens_per_s": 338.1}

# what each writer writes (keys and nesting), with small values
RECORDS = {
    "data/prompts/stats.json": (PromptStats, {
        "n_requested": 4, "generated": 6, "surplus": 2, "attempt_indices": 8, "kept": 4,
        "kept_by_domain": {"code": 2, "chat": 2}, "cleanly_ended": 6, "unique_fraction": 0.667,
        "rejected": {"length_cap": 0, "too_short": 2, "duplicate": 0, "near_duplicate": 0}, "complete": True,
        "new_tokens_this_run": 62, "seconds_this_run": 0.054, "tokens_per_s": 1144.6}),
    "data/rows/stats.json": (RowStats, {"rows": 4, "new_tokens": 20, "seconds": 0.0176, "setup_seconds": 9e-05,
                                        "tokens_per_s": 1135.9, "batch_size": 4}),
    "data/rows/stats.json (two processes)": (RowStats, {"rows": 8, "new_tokens": 40, "seconds": 0.02, "processes": 2,
                                                        "setup_seconds": 0.0, "batch_size": 4, "tokens_per_s": 2000.0}),
    "distill/distill.json": (DistillResult, {
        "target": "t", "draft": "d", "config": asdict(TrainConfig()), "distill": asdict(DistillConfig()),
        "data_source": "target", "train_prompts": 8, "data_dir": None, "held_out_prompts": 4, "data_rows": 8,
        "alpha_before": 0.8, "alpha_after": 0.85, "alpha_gain": 0.05, "skipped_steps": 0, "skipped_note": None,
        "train_summary": {"alpha_before": 0.8, "alpha_after": 0.85, "best_step": 40, "steps_done": 40,
                          "stopped_early": False, "skipped_steps": 0, "loss": 1.2, "config": {}, "paths": {}},
        "speed": {"k": 3, "speedup_vs_target_only": {"draft_before": 1.1, "draft_after": 1.3}}}),
    "distill/head.json": (HeadResult, {
        "kind": "head", "target": "t", "head": "runs/h/distill/head/best", "aux_layers": [2, 4, 5],
        "config": asdict(HeadRunConfig()), "train_prompts": 8, "held_out_prompts": 4, "held_out_ids": ["code-0"],
        "data": STATS, "written_data": None, "held_data": STATS, "data_seconds_this_session": 0.44,
        "generation_seconds": 0.4, "train_minutes": 0.0,
        "data_cap": {"seconds": None, "left_out": [], "cut_shards": 0, "skipped_shards": 0},
        "agreement_before": [0.0, 0.0, 0.0], "agreement_after": [0.125, 0.0625, None],
        "curve": [{"tokens": 0, "agreement_by_depth": [0.0, 0.0, 0.0]}],
        "train_summary": {"steps": 16, "total_steps": 16, "seconds": 0.79, "tokens_seen": 228, "best_step": 16,
                          "draft_vocab_coverage": 0.898, "train_rows": 16}}),
    "race/pick.json": (RaceResult, {
        "draft": "int4:m", "base": "m", "base_k": 1, "alpha": 0.0, "best_k": 1, "measured_speedup": 0.65,
        "predicted_speedup": 0.76, "vocab_files": {"6": "vocab-6.json"}, "counted_prompts": ["code-4"],
        "ranking": [{"draft": "int4:m", "alpha": 0.0, "best_k": 1, "predicted_speedup": 0.76, "measured_speedup": 0.65,
                     "policy": {"k": 1, "confidence": None, "siblings": 0, "sibling_depth": 1, "lookup": 0},
                     "policy_predicted": 0.79, "worst_over_reference": 1.05, "over_reference": {"all": SPREAD}},
                    {"draft": "m", "alpha": 0.1, "best_k": 2, "predicted_speedup": 0.7, "measured_speedup": None,
                     "policy": None, "policy_predicted": None, "worst_over_reference": None, "over_reference": None}],
        "chosen_by": "race, worst domain over the base at its walked policy"}),
    "export/export.json (draft)": (DraftExport, {
        "draft": "runs/w/distill/best", "draft_path": "p", "target": "t", "target_hf": "t", "target_gguf": "t.gguf",
        "format": "all", "best_k": 2, "best_k_source": "measured (pairing / info)", "provenance": {}, "warnings": [],
        "version": 1, "hf": {"path": "runs/w/export/hf", "files": ["config.json"], "checks": {
            "reload": {"max_abs_diff": 0.0}, "assisted_greedy": {"equal": True, "prompts": 3}}},
        "gguf": [{"path": "draft-q8_0.gguf", "gguf_type": "q8_0", "checks": {"logits": {"top1_agreement": 1.0}}}],
        "serving": {"vllm": "vllm serve t"}, "llama_cpp": {"q8_0": RUN},
        "llama_cpp_target_only": {"tokens_per_s": 10.0, "runs_tokens_per_s": [10.0, 10.0]},
        "llama_cpp_before": {**RUN, "draft": "d", "gguf": "before-q8_0.gguf", "gguf_source": "written here (q8_0)"},
        "llama_cpp_prediction": {"verdict": "predicted best 1.1x"}, "ok": True, "failed": [], "seconds": 0.47}),
    "export/export.json (head, llama.cpp)": (HeadExport, {
        "head": "h", "target": "t", "k": 2, "vllm": "export/vllm", "sglang": "export/sglang", "serving": {"vllm": "v"},
        "checks": {"vllm": ["contract"], "sglang": ["contract"], "gguf": ["contract", "converted"]},
        "gguf": {"path": "head-f16.gguf", "bytes": 10, "converter_input": "export/llama-cpp"},
        "llama_cpp": {"target_gguf": "t.gguf", "head_gguf": "head-f16.gguf", "prompts": 4, "n_predict": 64,
                      "target_alone_tokens_per_s": [10.0, 10.2], "target_alone_mean_tokens_per_s": 10.1,
                      "target_alone_contents": [], "runs": {"2": RUN}, "server_version": "v"},
        "warnings": [], "llama_cpp_prediction": {"verdict": "predicted best 0.9x"}, "version": 1}),
    "pairing/leaderboard.json": (PairLeaderboard, PairLeaderboard(
        "t", {"domains": ["code"], "n_prompts": 2, "prompts": "code", "max_new_tokens": 8},
        [{"draft": "d", "kind": "same-tokenizer", "alpha": 0.5}], machine={"cpu": "c"}, versions={},
        definitions={}, seconds=1.0).to_dict()),
}


@pytest.mark.parametrize("name", RECORDS)
def test_a_written_record_reads_back_to_the_same_json(name: str) -> None:
    kind, written = RECORDS[name]
    d = json.loads(json.dumps(written))  # as the file holds it
    record = kind.from_dict(d, name)
    assert isinstance(record, Record) and record.version == 1
    assert record.to_dict() == {**d, "version": 1}  # a writer without `version` yet: read as 1, written as 1
    if "version" in d:
        assert record.to_dict() == d
    assert kind.from_dict(record.to_dict()) == record


def test_the_typed_fields_say_what_readers_read() -> None:
    distill = DistillResult.from_dict(RECORDS["distill/distill.json"][1])
    assert isinstance(distill.config, TrainSettings) and isinstance(distill.train_summary, TrainSummary)
    assert distill.config.loss == TrainConfig().loss and distill.steps_done() == 40 and distill.speedup_after() == 1.3
    head = HeadResult.from_dict(RECORDS["distill/head.json"][1])
    assert isinstance(head.config, HeadSettings) and isinstance(head.train_summary, HeadTrainSummary)
    assert isinstance(head.data, HeadData) and head.written_data is None and isinstance(head.data_cap, DataCap)
    assert head.config.samples == HeadRunConfig().samples and not head.data_cap.cut()
    raced = RaceResult.from_dict(RECORDS["race/pick.json"][1])
    assert all(isinstance(r, RankedDraft) for r in raced.ranking) and raced.ranking[1].policy is None
    assert RaceResult.from_dict({"draft": "m", "ranking": []}).chosen_by == "ranking"  # before it was recorded
    assert raced.trained == {} and raced.int4 is None  # an older run's distill/fastest.json reads too
    draft = read_export(RECORDS["export/export.json (draft)"][1])
    assert isinstance(draft, DraftExport) and isinstance(draft.hf, HfExport) and isinstance(draft.gguf[0], GgufExport)
    assert isinstance(draft.llama_cpp["q8_0"], LlamaServerRun) and draft.llama_cpp_before.draft == "d"
    assert draft.served() and draft.measured_runs() == [draft.llama_cpp["q8_0"]]
    head_export = read_export(RECORDS["export/export.json (head, llama.cpp)"][1])
    assert isinstance(head_export, HeadExport) and isinstance(head_export.gguf, HeadGguf)
    assert isinstance(head_export.llama_cpp, HeadLlamaCpp) and head_export.llama_cpp.runs["2"].draft_max == 3
    assert not read_export({"vllm": "v", "sglang": "s"}).served()
    assert LadderRung.from_dict({"name": "a", "step": "s", "predicted": None, "over_target": {"all": SPREAD},
                                 "over_below": None}).spread("all", below=True) is None


def test_export_head_writes_its_record_through_the_type(tmp_path: Path) -> None:
    """`export_head` writes export.json through HeadExport, recording what it checked of each folder."""
    from draftsmith.decode.head import save_head
    from draftsmith.decode.runtime.loading import load
    from draftsmith.distill.export.heads import export_head
    from tests import helpers
    from tests.distill.export.test_heads import L, V, make_head

    tok = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *[f"w{i}" for i in range(V - 3)]], eos="</s>", bos="<s>")
    folder = helpers.save_tiny(tmp_path / "target", tok, 0, vocab_size=V, eos_id=2, bos_id=1, layers=L)
    save_head(make_head(load(str(folder)).model), tmp_path / "head")
    returned = export_head(tmp_path / "head", str(folder), tmp_path / "out", k=4)
    written = json.loads((tmp_path / "out" / "export.json").read_text())
    assert returned == written and written["version"] == 1
    assert written["checks"] == {"vllm": ["contract"], "sglang": ["contract"]} and "gguf" not in written
    exported = read_export(written, "export.json")
    assert isinstance(exported, HeadExport) and exported.to_dict() == written and exported.k == 4
    assert exported.checked("vllm").endswith("; not loaded by vLLM or speculators in this run")


def test_the_training_log_reads_typed_and_skips_a_cut_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    rows = [{"step": 1, "loss": 2.0, "lr": 0.001}, {"step": 0, "eval": True, "alpha": 0.5, "alpha_by_domain": {"a": 0.4}},
            {"step": 2, "eval": True, "alpha": 0.6, "alpha_by_domain": {"a": 0.7}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    log = read_log(path)
    assert [r.to_dict() for r in log.steps + log.evals] == rows and log.best_eval(None).step == 2
    assert log.best_eval(0).alpha_in("a") == 0.4 and log.best_eval(0).alpha_in("b", 0) == 0
    assert not read_log(tmp_path / "absent.jsonl") and LogRow.from_dict(rows[0]).eval is False


def test_a_record_from_before_versions_reads_as_version_1_and_a_newer_one_is_refused() -> None:
    old = {"kept": 4, "kept_by_domain": {}, "unique_fraction": 1.0, "rejected": {}}
    assert PromptStats.from_dict(old).version == 1
    for kind, d in [(PromptStats, old), *RECORDS.values()]:
        with pytest.raises(DraftsmithError) as e:
            kind.from_dict({**d, "version": kind.VERSION + 1}, "runs/x/result.json")
        assert "runs/x/result.json" in str(e.value) and f"version {kind.VERSION + 1}" in str(e.value)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad, says", [({"kept": 4}, "not a PromptStats"), ([1, 2], "expected a JSON object"),
                                       ({**RECORDS["data/prompts/stats.json"][1], "version": "2"}, "version '2'")])
def test_a_record_that_does_not_fit_is_a_one_line_error_naming_the_file(bad, says: str) -> None:
    with pytest.raises(DraftsmithError) as e:
        PromptStats.from_dict(bad, "data/prompts/stats.json")
    assert str(e.value).startswith("data/prompts/stats.json") and says in str(e.value) and "\n" not in str(e.value)


def test_a_part_keeps_absent_keys_absent_and_unknown_keys_as_they_are() -> None:
    run = LlamaServerRun.from_dict({"draft_max": 2, "log_tail": ["x"]})
    assert run.speedup_vs_target_only is None and run.extra == {"log_tail": ["x"]}
    assert run.to_dict() == {"draft_max": 2, "log_tail": ["x"]} and isinstance(run, Part) and run
    assert not LlamaServerRun.from_dict({})  # as its JSON object: an empty one is false
    fresh = HeadExport("v", "s", k=2)  # a new record writes its fields, those OMIT_NONE only when set
    assert "gguf" not in fresh.to_dict() and fresh.to_dict()["k"] == 2 and fresh.to_dict()["version"] == 1


DOCS = {"bench*.json": BenchResult, "head.json": HeadResult, "fastest.json": RaceResult,
        "leaderboard.json": PairLeaderboard}


@pytest.mark.parametrize("pattern", DOCS)
def test_the_summaries_in_docs_results_read(pattern: str) -> None:
    """docs/results keeps results trimmed to summaries, written before versions were: each reads, to the same JSON."""
    paths = [p for p in sorted((ROOT / "docs" / "results").rglob(pattern)) if p.parent.name != "floor"]
    assert paths
    for path in paths:
        d = json.loads(path.read_text())
        assert DOCS[pattern].from_dict(d, str(path)).to_dict() == {**d, "version": 1}, path
