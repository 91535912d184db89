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

import distill.export.llama_cpp as lc
from decode import zoo
from decode.errors import DraftsmithError

NAME = "smollm2-135m-instruct"


def test_draft_flags_follow_the_servers_help() -> None:
    new = ("--spec-draft-n-max N ... --spec-draft-n-min N ... --spec-draft-p-min, --draft-p-min P ... "
           "--spec-type none,draft-simple,draft-eagle3")
    assert lc.draft_flags(new, 4) == ["--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min",
                                      "0", "--draft-p-min", "0.0"]
    assert lc.draft_flags("--draft-max N --draft-min N", 2) == ["--draft-max", "2", "--draft-min", "0"]


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
@pytest.mark.skipif(not _llama_cpp_available(), reason="llama.cpp wheel not cached (~/.cache/draftsmith/llama-cpp)")
def test_llama_server_accepts_an_exported_draft(tmp_path: Path) -> None:
    from decode.loading import load
    from decode.textgen import prompt_ids
    from distill.export.gguf import write_gguf

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


def test_prompt_lists_are_told_apart_from_token_ids() -> None:
    assert lc._prompts("hi") == ["hi"] and lc._prompts([1, 2, 3]) == [[1, 2, 3]]
    assert lc._prompts(["a", [1, 2]]) == ["a", [1, 2]]
