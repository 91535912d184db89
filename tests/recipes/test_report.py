"""The run folder's report (`recipes.report.write_report`), rebuilt from whatever stages have written results:
each finished stage gets its section in report.md and the self-contained report.html; a missing result leaves
its section out; a corrupt one is a one-line error naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.recipes.report import write_report
from tests.helpers import write_run_folder

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_has_a_section_per_finished_stage(tmp_path: Path) -> None:
    run = write_run_folder(tmp_path / "tiny-run", candidates={"d1": 0.4, "d2": 0.6}, distilled=("d2", 0.6, 0.75))
    assert write_report(run) == run / "report.md"
    md = (run / "report.md").read_text()
    assert md.startswith("# draftsmith run: tiny-run\n")
    assert "| pair | done | 12 |" in md and "| distill | done | 30 |" in md and "| validate |" not in md
    assert "## Pairing leaderboard" in md and "Target `tiny-target`" in md
    assert "| d1 |" in md and "| d2 |" in md and "0.600" in md
    assert "## Distillation" in md and "0.600 -> 0.750 (gain 0.150)" in md
    # alpha by domain, before (step 0) and after (the best step, 40): overall +/- 0.05 per domain
    assert "| chat | 0.550 | 0.700 | 0.150 |" in md and "| code | 0.650 | 0.800 | 0.150 |" in md
    assert "| all | 0.600 | 0.750 | 0.150 |" in md
    assert "## Validation" not in md and "## Export" not in md  # those stages have not written anything
    assert "## Resolved recipe" in md and "name: tiny-run" in md
    for png in ("alpha_by_domain.png", "training.png"):
        assert f"![{png}](report/{png})" in md
        assert (run / "report" / png).read_bytes().startswith(PNG)
    html = (run / "report.html").read_text()
    assert "<h2>Pairing leaderboard</h2>" in html and "<h2>Distillation</h2>" in html
    assert html.count('src="data:image/png;base64,') == 2 and "report/" not in html  # self-contained


def test_report_of_a_run_with_only_the_pair_stage(tmp_path: Path) -> None:
    run = write_run_folder(tmp_path / "paired", candidates={"d3": 0.5})
    md = write_report(run).read_text()
    assert "## Pairing leaderboard" in md and "| d3 |" in md
    assert "## Distillation" not in md and not (run / "report" / "training.png").exists()


def test_a_corrupt_result_is_a_one_line_error_naming_the_file(tmp_path: Path) -> None:
    run = write_run_folder(tmp_path / "broken", candidates={"d1": 0.4}, distilled=("d1", 0.4, 0.5))
    result = run / "distill" / "distill.json"
    result.write_text('{"target": "tiny-target", "alpha_before"')  # cut short by an interruption
    with pytest.raises(DraftsmithError) as e:
        write_report(run)
    assert str(result) in str(e.value) and "\n" not in str(e.value)
    assert not (run / "report.md").exists()  # no report that silently drops the stage


def test_validation_section_reads_the_typed_result(tmp_path: Path) -> None:
    """validate/bench.json as the validate stage writes it (decode.bench.Validation plus K and cost): the section
    shows every decoder's tok/s, its ratio to the target alone, tau and greedy equality from those fields."""
    from draftsmith.decode.bench import Validation
    from draftsmith.decode.speculative import Stats

    val = Validation(3, ["code-0", "chat-0"], 16, "cpu", {
        "target_only": Stats({1: 32}, 0, 0, 32, 0.1, 4.0),
        "draft_before": Stats({1: 10, 2: 8, 4: 2}, 60, 14, 32, 0.1, 5.0),
        "draft_after": Stats({2: 6, 3: 4, 4: 3}, 39, 19, 32, 0.1, 2.0),
    }, {"draft_before": True, "draft_after": True}, ks={"draft_before": 5})  # the un-distilled one at its own K
    assert Validation.from_dict(val.to_dict()) == val
    bench = {**val.to_dict(), "k_reason": "set by the recipe", "draft_quant": "int8", "cost_ratio": 0.12,
             "machine": {"cpu": "test cpu", "cpu_count": 2}}
    run = write_run_folder(tmp_path / "validated", candidates={"d1": 0.4}, distilled=("d1", 0.4, 0.5), bench=bench)
    md = write_report(run).read_text()
    assert "## Validation: tokens/s of our decoder" in md and "2 held-out prompts x 16 new tokens" in md
    assert "K = 3 (set by the recipe), un-distilled draft at K = 5; " in md
    assert "| target alone | - | 8.000 | 1.00x | 1.000 | - | - |" in md  # 32 tokens in 4 s
    assert "| un-distilled draft | 5 | 6.400 | 0.80x | 1.700 | 0.233 | yes |" in md  # 5 s; tau 34/20; 14/60
    assert "| distilled draft | 3 | 16.000 | 2.00x | 2.769 | 0.487 | yes |" in md
    assert "Distilled vs un-distilled draft (both at the distilled draft's policy): 2.50x tokens/s." in md
    assert (run / "report" / "speed.png").read_bytes().startswith(PNG)



def test_validation_section_splits_speedups_by_domain(tmp_path: Path) -> None:
    """With per-prompt timings (domains given), the section adds each domain's speedups and each repeat's
    distilled-over-un-distilled ratio, overall and per domain, worked out by hand below."""
    from draftsmith.decode.bench import Validation
    from draftsmith.decode.speculative import Stats
    from draftsmith.pairing.validate import after_vs_before

    def st(tokens: int, seconds: float) -> Stats:
        return Stats({1: tokens}, 0, 0, tokens, 0.0, seconds)

    # one repeat: code-0, chat-0 (16 tokens each); target 2 s a prompt, before 1 s, after 0.5 s on code, 1 s on chat
    per = {"target_only": [st(16, 2.0), st(16, 2.0)], "draft_before": [st(16, 1.0), st(16, 1.0)],
           "draft_after": [st(16, 0.5), st(16, 1.0)]}
    merged = {n: s[0].merge(s[1]) for n, s in per.items()}
    val = Validation(3, ["code-0", "chat-0"], 16, "cpu", merged, {"draft_before": True, "draft_after": True},
                     repeats=[merged], groups=["code", "chat"], prompt_stats=[per])
    assert Validation.from_dict(val.to_dict()) == val
    avb = after_vs_before(val)
    assert avb["code"]["median"] == 2.0 and avb["chat"]["median"] == 1.0 and avb["all"]["median"] == pytest.approx(4 / 3)
    bench = {**val.to_dict(), "k_reason": "set by the recipe", "draft_quant": "int8", "after_vs_before": avb,
             "machine": {"cpu": "test cpu", "cpu_count": 2}}
    run = write_run_folder(tmp_path / "validated", candidates={"d1": 0.4}, distilled=("d1", 0.4, 0.5), bench=bench)
    md = write_report(run).read_text()
    assert "| code | 1 | 2.00x (2.00-2.00) | 4.00x (4.00-4.00) |" in md
    assert "| chat | 1 | 2.00x (2.00-2.00) | 2.00x (2.00-2.00) |" in md
    assert ("Distilled vs un-distilled draft (both at the distilled draft's policy): 1.33x tokens/s (each repeat's "
            "ratio, median and range: all 1.33x (1.33-1.33); code 2.00x (2.00-2.00); chat 1.00x (1.00-1.00)).") in md


def test_fastest_validation_names_its_two_drafts(tmp_path: Path) -> None:
    """A fastest-draft run (an older record: kind fastest) whose pick is the whole model (at its own policy) names
    both drafts by their labels, not as a pruned and a whole draft."""
    from draftsmith.decode.bench import Validation
    from draftsmith.decode.speculative import Stats

    def st(tokens: int, seconds: float) -> Stats:
        return Stats({1: tokens}, 0, 0, tokens, 0.0, seconds)

    merged = {"target_only": st(32, 4.0), "draft_before": st(32, 2.0), "draft_after": st(32, 1.6)}
    val = Validation(4, ["code-0", "chat-0"], 16, "cpu", merged, {"draft_before": True, "draft_after": True},
                     repeats=[merged])
    labels = {"draft_before": "whole model (m0), K = 4", "draft_after": "whole model, rounds chosen on dev prompts"}
    bench = {**val.to_dict(), "kind": "fastest", "labels": labels, "k_reason": "set by the recipe",
             "draft_quant": "int8", "machine": {"cpu": "test cpu", "cpu_count": 2}}
    run = write_run_folder(tmp_path / "fastest", candidates={"d1": 0.4}, distilled=("d1", 0.4, 0.5), bench=bench)
    md = write_report(run).read_text()
    assert ("whole model, rounds chosen on dev prompts vs whole model (m0), K = 4 (the same policy search): "
            "1.25x tokens/s") in md
    assert "Pruned vs whole" not in md
    assert "draft weights int8." in md  # one quantisation: said once

    labels = {**labels, "draft_after": "int4 m0"}  # an int4 pick beside the int8 stock: each draft's weights
    bench = {**bench, "labels": labels, "quant_by_draft": {"draft_before": "int8", "draft_after": "int4"}}
    run = write_run_folder(tmp_path / "fastest-int4", candidates={"d1": 0.4}, distilled=("d1", 0.4, 0.5), bench=bench)
    md = write_report(run).read_text()
    assert "draft weights int8 (whole model (m0), K = 4), int4 (int4 m0)" in md
    assert "serve the int4 m0 with draftsmith's decoder" in md


def test_report_puts_our_decoder_beside_llama_cpp(tmp_path: Path) -> None:
    lc = {"speedup_vs_target_only": 0.85, "draft_max": 3, "accepted": 50, "drafted": 60, "prompts": 2,
          "tokens_per_s": 8.5}
    run = write_run_folder(tmp_path / "r", candidates={"d2": 0.6}, distilled=("d2", 0.6, 0.75),
                           bench={"k": 2, "speedup_vs_target_only": {"draft_before": 1.1, "draft_after": 1.4}},
                           export={"llama_cpp": {"q8_0": lc}, "llama_cpp_before": {**lc, "speedup_vs_target_only": 0.7,
                                                                                   "accepted": 40, "draft": "d2"},
                                   "llama_cpp_target_only": {"tokens_per_s": 10.0, "runs_tokens_per_s": [10.0, 10.0]},
                                   "best_k": 3, "best_k_source": "given", "serving": {}})
    (run / "validate" / "bench.json").unlink()  # the validation section needs a full result; this one is partial
    from draftsmith.distill.export.results import read_export
    from draftsmith.pairing.validate import BenchResult
    from draftsmith.recipes.report import side_by_side

    rows = side_by_side(BenchResult.from_dict({"k": 2, "speedup_vs_target_only": {"draft_before": 1.1,
                                                                                   "draft_after": 1.4}}),
                        read_export({"llama_cpp": {"q8_0": lc}, "llama_cpp_before": {**lc, "speedup_vs_target_only": 0.7}}))
    assert rows == [["un-distilled draft", 2, 1.1, 3, 0.7, "50/60"], ["distilled draft (q8_0)", 2, 1.4, 3, 0.85, "50/60"]]
    write_report(run)
    md = (run / "report.md").read_text()
    assert "## Our decoder and llama.cpp, side by side" in md
    assert "| un-distilled draft | - | - | 3 | 0.70x | 40/60 |" in md
    assert "| distilled draft (q8_0) | - | - | 3 | 0.85x | 50/60 |" in md
    assert side_by_side(None, None) == []


def test_a_head_paragraph_names_the_rows_the_target_wrote_and_the_bfloat16_parts() -> None:
    from draftsmith.distill.results import DataCap, HeadData, HeadSettings
    from draftsmith.recipes.report import _data_cap, _dtypes, _written

    cfg = {"samples": 2, "temperature": 0.7, "rows_per_step": 4, "draft_vocab_size": 64}  # what head.json holds
    written = HeadData.from_dict({"rows": 8, "tokens": 900, "new_tokens": 500, "generate_tokens_per_s": 41.2})
    assert _written(written, HeadSettings.from_dict({**cfg, "written_samples": 2})) == (
        ", and 8 rows (900 tokens, 500 generated at 41 tokens/s) answering 4 prompts the target wrote itself")
    assert _written(None, HeadSettings.from_dict(cfg)) == ""
    assert _dtypes(HeadSettings.from_dict({**cfg, "gen_dtype": "bfloat16", "train_dtype": "float32"})) == (
        " (data written in bfloat16)")
    assert _dtypes(HeadSettings.from_dict({**cfg, "gen_dtype": "bfloat16", "train_dtype": "bfloat16"})) == (
        " (data written and training's matmuls in bfloat16)")
    assert _dtypes(HeadSettings.from_dict(cfg)) == ""  # an older head.json: no dtypes recorded, float32

    assert _data_cap(None) == "" == _data_cap(DataCap.from_dict({"seconds": 294.0, "left_out": [], "cut_shards": 0,
                                                                 "skipped_shards": 0}))
    assert _data_cap(DataCap.from_dict({"seconds": 294.0, "left_out": ["its answers to them"], "cut_shards": 2,
                                        "skipped_shards": 1})) == (
        " (the data stopped at its share of the budget, 4.9 min: 2 batches of answers cut short, 1 batches not "
        "written, its answers to them left out; a faster CPU writes it whole)")


def _bench(before: float, after: float, **extra) -> dict:
    return {"k": 2, "speedup_vs_target_only": {"draft_before": before, "draft_after": after},
            "speedup_range": {"draft_before": [before - 0.02, before + 0.01], "draft_after": [after - 0.03, after + 0.02]},
            "repeats": [{}, {}, {}], "prompts": ["a", "b", "c", "d"], "in_sample": False,
            "policies": {"draft_before": {"k": 2}, "draft_after": {"k": 2, "confidence": 0.6, "siblings": 3}},
            **extra}


def test_the_report_opens_with_a_verdict_that_says_when_nothing_pays(tmp_path: Path) -> None:
    run = write_run_folder(tmp_path / "slow", candidates={"d1": 0.4}, distilled=("d1", 0.4, 0.5),
                           bench=_bench(0.85, 0.97),
                           export={"best_k": 2, "best_k_source": "chosen", "serving": {"vLLM": "vllm serve T"}})
    md = write_report(run).read_text()
    first = md.split("\n## ")[0]  # above every section and table
    assert ("**Verdict: no draft beats the target alone here: best 0.97x (distilled draft; median of 3 repeats, "
            "range 0.94x-0.99x, on 4 test prompts never used to train or choose, greedy-equal) — don't serve one.**"
            in first)
    assert md.index("**Verdict:") < md.index("|")  # above the first table
    assert "measured 0.97x the target alone in validation: serving it would slow decoding down" in md
    page = (run / "report.html").read_text()
    assert page.index('class="verdict no"') < page.index("<table")


def test_a_paying_draft_gets_where_and_how_to_serve_it(tmp_path: Path) -> None:
    lc = {"speedup_vs_target_only": 0.6, "draft_max": 2, "accepted": 5, "drafted": 9, "prompts": 2}
    run = write_run_folder(tmp_path / "fast", candidates={"d1": 0.4}, distilled=("d1", 0.4, 0.5),
                           bench=_bench(1.1, 1.34),
                           export={"best_k": 2, "best_k_source": "chosen", "serving": {"vLLM": "vllm serve T"},
                                   "llama_cpp": {"q8_0": lc}})
    md = write_report(run).read_text()
    first = md.split("\n## ")[0]
    assert ("Verdict: serve the distilled draft with draftsmith's decoder at K = 2, its 3 most probable first tokens "
            "side by side below probability 0.6: 1.34x the target alone (median of 3 repeats, range 1.31x-1.36x"
            in first)
    assert "In llama.cpp (llama-server) it measured 0.60x at K = 2: don't use it there on this machine." in first
    assert "serving it would slow" not in md


def test_report_shows_llama_cpp_predicted_beside_measured(tmp_path: Path) -> None:
    from draftsmith.distill.export.llama_predict import EngineCost, curve, parity_row, verdict

    cost = EngineCost(target_token_s=0.1, verify_s={1: 0.12, 2: 0.13}, draft_step_s=0.05, rest_s=0.03)
    rows = curve(cost, {1: 1.8, 2: 2.4}, {1: 0.85, 2: 0.8})
    pred = {"prompts": 3, "n_predict": 64, "calibration_prompts": 3, "cost": cost.to_dict(), "curve": rows,
            "parity": [parity_row(1, (40, 50), (41, 50), 0.8), parity_row(2, (20, 100), (70, 100), 0.7)],
            "verdict": verdict(rows)}
    run = write_run_folder(tmp_path / "r", candidates={"d2": 0.6}, distilled=("d2", 0.6, 0.75),
                           export={"llama_cpp_prediction": pred, "best_k": 3, "best_k_source": "given", "serving": {}})
    write_report(run)
    md = (run / "report.md").read_text()
    assert "predicted best 0.92x at K = 2; measured best 0.85x at K = 1" in md and "don't use a draft" in md
    assert "| 1 | 0.90x | 0.85x | +6% | 0.800 | 0.820 | 0.800 |" in md
    assert "| 2 | 0.92x | 0.80x | +15% | 0.200 (flagged) | 0.700 | 0.700 |" in md
    assert "a draft step 50.0 ms, the rest of a round 30.0 ms" in md


def test_a_ladder_renders_as_a_table_and_a_waterfall_and_the_verdict_names_what_differs(tmp_path: Path) -> None:
    """The race stage's bench.json carries a ladder: the report shows each rung over the one above and over the
    target alone with its prediction, draws ladder.png, and the verdict compares the pick with the stock at its
    walked policy, naming the steps between them."""
    from draftsmith.decode.bench import Validation
    from draftsmith.decode.speculative import Stats
    from draftsmith.pairing.ladder import Rung, ladder
    from draftsmith.pairing.validate import after_vs_before

    def st(seconds: float) -> Stats:
        return Stats({1: 32}, 0, 0, 32, 0.0, seconds)

    reps = [{"target_only": st(4.0), "stock_plain": st(2.5 + d), "draft_before": st(2.0 + d),
             "int4": st(1.8 + d), "draft_after": st(1.6 + d)} for d in (0.0, 0.1, -0.1)]
    merged = {n: Stats({1: 96}, 0, 0, 96, 0.0, sum(r[n].seconds for r in reps)) for n in reps[0]}
    val = Validation(4, ["code-0"], 32, "cpu", merged, {n: True for n in merged if n != "target_only"},
                     repeats=reps)
    rungs = [Rung("stock_plain", "stock m0 as loaded, plain K = 4", 1.5), Rung("draft_before", "its walked policy",
                                                                             1.9),
             Rung("int4", "int4 weights", 2.1), Rung("draft_after", "vocabulary pruned to 64 ids", 2.4)]
    labels = {"stock_plain": "stock m0 (int8), plain K = 4", "draft_before": "stock m0 at its walked policy",
              "int4": "int4 m0", "draft_after": "int4 m0 pruned to 64 ids"}
    bench = {**val.to_dict(), "kind": "race", "labels": labels, "k_reason": "raced on the dev prompts",
             "draft_quant": "int8", "machine": {"cpu": "test cpu", "cpu_count": 2}, "ladder": ladder(val, rungs),
             "after_vs_before": after_vs_before(val)}
    run = write_run_folder(tmp_path / "ladder", candidates={"d1": 0.4}, distilled=("d1", 0.4, 0.5), bench=bench)
    md = write_report(run).read_text()
    assert "Where the speedup comes from: the ladder" in md and (run / "report" / "ladder.png").is_file()
    assert "| int4 m0 | int4 weights | 2.10 | 1.11x (1.11-1.12) | 2.22x (2.11-2.35) |" in md
    assert "| stock m0 (int8), plain K = 4 | stock m0 as loaded, plain K = 4 | 1.50 | - |" in md
    assert ("The race's pick (int4 m0 pruned to 64 ids) over the stock m0 at its walked policy (the same policy "
            "search on the same dev prompts; what differs: int4 weights, vocabulary pruned to 64 ids): all 1.25x") in md


def test_the_speed_chart_title_fits_in_its_picture() -> None:
    """The title of speed.png spans the figure, not the axes: with long decoder labels the axes start far to the
    right, and a title over them ran past the picture's edge ("decoders, K=2 (some at their")."""
    from draftsmith.recipes.report import _plt, speed_figure

    names = ["int4 qwen2.5-coder-0.5b-instruct pruned to 65536 ids", "stock qwen2.5-coder-0.5b-instruct (int8), "
             "plain K = 4", "target alone"]
    title = "decoders, K=7 (some at their own K)"

    def inside(fig, texts) -> bool:
        fig.tight_layout()  # as png_bytes lays every figure out
        fig.canvas.draw()
        box = fig.bbox
        return all(box.x0 - 1 <= t.get_window_extent().x0 and t.get_window_extent().x1 <= box.x1 + 1 for t in texts)

    fig = speed_figure(names, [6.6, 5.7, 3.7], title)
    assert inside(fig, [fig._suptitle, *fig.axes[0].get_yticklabels()])
    plt = _plt()
    old, ax = plt.subplots(figsize=(6, 2.8))  # the chart as it was: the title over the axes
    ax.barh(names, [6.6, 5.7, 3.7]), ax.set_title(title)
    assert not inside(old, [ax.title])  # the check can fail: this is the cut-off title
    plt.close(fig), plt.close(old)


def _head_export(**extra) -> dict:
    return {"head": "h/best", "target": "t", "k": 2, "vllm": "/r/export/vllm", "sglang": "/r/export/sglang",
            "serving": {"vllm": "vllm serve T", "sglang": "python -m sglang.launch_server"}, **extra}


def test_the_export_table_says_what_was_checked_of_each_head_folder(tmp_path: Path) -> None:
    """The export stage checks each head folder against the format its engine reads (config fields, weight names,
    shapes, dtypes, the id map); it loads neither in vLLM, speculators nor SGLang (the test suite loads such a
    folder with speculators' own library, not the run). The table says so, and says "loaded by" only where
    export.json records a load."""
    run = write_run_folder(tmp_path / "head", export=_head_export())  # written before `checks` was recorded
    md = write_report(run).read_text()
    assert ("| vLLM speculators | /r/export/vllm | config and weights, field by field, against the speculators format "
            "vLLM reads; not loaded by vLLM or speculators in this run |") in md
    assert ("| SGLang EAGLE-3 | /r/export/sglang | config and weights, field by field, against SGLang's "
            "LlamaForCausalLMEagle3; not loaded by SGLang in this run |") in md
    assert "config contract" not in md and "GGUF" not in md

    gguf = {"path": "/r/export/head-f16.gguf", "bytes": 10, "converter_input": "/r/export/llama-cpp"}
    run = write_run_folder(tmp_path / "loaded", export=_head_export(
        gguf=gguf, checks={"vllm": ["contract", "loaded:speculators 0.9.0"], "sglang": ["contract"],
                           "gguf": ["contract", "converted"]}))
    md = write_report(run).read_text()
    assert ("| vLLM speculators | /r/export/vllm | config and weights, field by field, against the speculators format "
            "vLLM reads; loaded by speculators 0.9.0 |") in md
    assert ("| GGUF (eagle3) | /r/export/head-f16.gguf | converter input checked field by field; converted by "
            "llama.cpp's converter |") in md  # llama-server did not serve it here: the table does not say it did


def test_the_report_only_renders_its_results() -> None:
    """Issue 53, item 7: stage results are read through their types (no guessing at keys in the renderer), and the
    verdict is the validate stage's."""
    import draftsmith.recipes.report as report
    from draftsmith.pairing import validate

    source = Path(report.__file__).read_text()
    assert source.count(".get(") <= 10
    assert report.verdict is validate.verdict and "\ndef verdict" not in source
