"""The real `draftsmith` command, as users run it (.venv/bin/draftsmith)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.decode.spec import DraftSpec

DRAFTSMITH = Path(sys.executable).parent / "draftsmith"


def run(*args: str, env_cache: Path | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    if env_cache is not None:
        env["DRAFTSMITH_CACHE"] = str(env_cache)
    return subprocess.run([str(DRAFTSMITH), *args], capture_output=True, text=True, timeout=600, env=env)


def test_models_list_names_every_zoo_model() -> None:
    r = run("models", "list")
    assert r.returncode == 0, r.stderr
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        assert name in r.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (("models", "path", "no-such-model"), "known models"),
        (("decode", "--target", "no-such-model", "--no-draft", "--prompt", "hi"), "expected a zoo model name"),
        (("decode", "--target", "README.md", "--no-draft", "--prompt", "hi"), "not a .gguf file"),
        (("export", "--draft", "no-such-model", "--target", "no-such-model", "--out", "x"), "expected a zoo model name"),
        (("export", "--draft", "d", "--target", "t", "--gguf-type", "q4", "--out", "x"), "GGUF type q4"),
        (("run", "no-such-recipe.yaml"), "cannot read the recipe"),
        (("leaderboard", "no-such-run"), "not a folder"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path: Path) -> None:
    r = run(*args, env_cache=tmp_path / "cache")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("draftsmith: error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_bad_allocator_setting_is_one_line_exit_2(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_MALLOC", "jemalloc")
    r = run("models", "list", env_cache=tmp_path / "cache")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("draftsmith: error: DRAFTSMITH_MALLOC: malloc must be keep or system")


def test_corrupt_and_truncated_gguf_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf at all" * 100)
    r = run("decode", "--target", str(bad), "--no-draft", "--prompt", "hi", env_cache=tmp_path / "cache")
    assert r.returncode == 2 and "not a valid GGUF" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.integration
def test_decode_json_on_real_smollm2() -> None:
    r = run("decode", "--target", "smollm2-135m-instruct", "--draft", "smollm2-135m-instruct", "--prompt",
            "Write a Python function that adds two numbers.", "--max-new-tokens", "12", "--k", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["new_tokens"] == len(out["tokens"]) <= 12
    assert out["text"] and out["stats"]["tau_definition"].startswith("tokens emitted per target forward")


def test_gen_prompts_writes_with_a_bfloat16_copy_when_asked(tmp_path: Path) -> None:
    from tests import helpers
    from tests.distill.test_prompt_gen import EOS, chat_tokenizer

    target = helpers.save_tiny(tmp_path / "chat", chat_tokenizer(), 0, vocab_size=EOS + 1, eos_id=EOS)
    out = tmp_path / "prompts"
    r = run("gen-prompts", "--target", str(target), "--n", "2", "--domains", "code", "--max-prompt-tokens", "24",
            "--batch-size", "4", "--dtype", "bfloat16", "--out", str(out), env_cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "settings.json").read_text())["dtype"] == "bfloat16" and "prompts (code" in r.stdout


# --- decode in-process: heads and the inputs it refuses ---------------------------------------------------------


@pytest.fixture
def tiny_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A tiny target, a standalone draft with its tokenizer, and a random EAGLE-3 head on the target."""
    from tests.pairing.test_leaderboard import WORDS, save_random_head, save_tiny

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    vocab = len(WORDS) + 3
    target = save_tiny(tmp_path / "target", 0, 3, vocab)
    return {"target": target, "draft": save_tiny(tmp_path / "draft", 1, 1, vocab),
            "head": save_random_head(tmp_path / "head", target)}


def decode(capsys, *args: str) -> tuple[int, str, str]:
    from draftsmith.recipes.cli import main

    code = main(["decode", "--no-chat", "--prompt", "sort the list of data", "--max-new-tokens", "12", *args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *args: str) -> str:
    code, out, err = decode(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]  # not transformers' bars
    assert code == 2 and not out and len(lines) == 1 and lines[0].startswith("draftsmith: error:"), err
    return lines[0]


@pytest.mark.parametrize("how", ["head:{head}", "{head}"])
@pytest.mark.parametrize("policy", [("--k", "3"), ("--k", "3", "--confidence", "0.5", "--siblings", "2",
                                                   "--sibling-depth", "2")])
def test_decode_with_a_head_equals_the_target_alone(tiny_pair, capsys, monkeypatch, how: str,
                                                   policy: tuple[str, ...]) -> None:
    from draftsmith.decode.head import HeadDraft

    real, sibling_steps = HeadDraft.forward_siblings, []
    monkeypatch.setattr(HeadDraft, "forward_siblings", lambda self, *a: sibling_steps.append(1) or real(self, *a))
    target = ("--target", str(tiny_pair["target"]))
    code, out, err = decode(capsys, *target, "--no-draft", "--json")
    assert code == 0, err
    alone = json.loads(out)
    code, out, err = decode(capsys, *target, "--draft", how.format(head=tiny_pair["head"]), *policy, "--json")
    assert code == 0, err
    with_head = json.loads(out)
    assert with_head["tokens"] == alone["tokens"] and len(alone["tokens"]) == 12
    assert with_head["stats"]["acceptance_rate"] is not None
    assert bool(sibling_steps) == ("--siblings" in policy)  # the random head is unsure: depth-2 sibling rounds ran


def test_decode_sibling_depth_2_with_a_standalone_draft_is_one_line(tiny_pair, capsys) -> None:
    line = one_line_error(capsys, "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"]),
                          "--confidence", "0.5", "--siblings", "2", "--sibling-depth", "2")
    assert "--sibling-depth 2 needs a draft head" in line


def test_decode_a_prompt_past_max_seq_len_is_one_line(tiny_pair, capsys) -> None:
    line = one_line_error(capsys, "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"]),
                          "--max-seq-len", "10")
    assert line.endswith("the prompt (5 tokens) plus --max-new-tokens 12 needs 17 positions; --max-seq-len is 10")


def test_decode_a_head_that_does_not_fit_the_target_is_one_line(tiny_pair, capsys) -> None:
    line = one_line_error(capsys, "--target", str(tiny_pair["draft"]), "--draft", f"head:{tiny_pair['head']}")
    assert "head" in line and "layers" in line


def test_vocab_then_decode_with_the_pruned_draft_equals_the_target_alone(tiny_pair, capsys, tmp_path: Path) -> None:
    """`draftsmith vocab` on the target's own continuations, then `decode --draft prune:DRAFT:vocab=FILE`: the
    target's own tokens, int8 and not."""
    from draftsmith.recipes.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": "code"}) + "\n"
                               for p in ("sort the list of data", "print the code")))
    kept = tmp_path / "kept.json"
    code = main(["vocab", "--target", str(tiny_pair["target"]), "--prompts", str(prompts), "--size", "6",
                 "--max-new-tokens", "8", "--out", str(kept)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert "kept 6 of" in printed and len(json.loads(kept.read_text())["ids"]) == 6
    target = ("--target", str(tiny_pair["target"]))
    code, out, err = decode(capsys, *target, "--no-draft", "--json")
    alone = json.loads(out)["tokens"]
    for quant in ("int8", "none"):
        code, out, err = decode(capsys, *target, "--draft", f"prune:{tiny_pair['draft']}:vocab={kept}", "--k", "3",
                                "--draft-quant", quant, "--json")
        assert code == 0, err
        assert json.loads(out)["tokens"] == alone
    # bench with the same spec: our decoder runs the pruned runner, transformers' assisted generation the whole draft
    report = tmp_path / "bench.json"
    code = main(["bench", *target, "--draft", f"prune:{tiny_pair['draft']}:vocab={kept}", "--prompts", str(prompts),
                 "--n-prompts", "2", "--max-new-tokens", "8", "--k", "2", "--policy", "K=3 stop<0.6 siblings=2",
                 "--repeats", "2", "--out", str(report)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    r = json.loads(report.read_text())
    walked = "speculative K=3 stop<0.6 siblings=2"  # a policy named in advance, timed beside each K (a tree verify)
    assert DraftSpec.parse(r["draft"]).kind == "prune" and r["greedy_equal"]
    assert set(r["modes"]) >= {"speculative_k2", walked, "hf_assisted"}
    assert r["modes"][walked]["policy"] == "K=3 stop<0.6 siblings=2" and r["modes"][walked]["k"] == 3
    assert all(row[f"{walked}_eq_target_only"] for row in r["greedy_equal_per_prompt"])
    low, high = r["speedup_vs_hf_assisted_range"]  # 2 repeats: the median of the two ratios, with their range
    assert r["repeats"] == 2 and low <= r["speedup_vs_hf_assisted"] <= high and "median of 2 repeats" in printed
    for mode in ("speculative_k2", walked):  # every mode's ratios, not only the fastest's
        each = r["per_mode"][mode]["vs_hf_assisted"]
        assert len(each["repeats"]) == 2 and each["range"][0] <= each["median"] <= each["range"][1]
        assert f"{mode}: vs target only" in printed
    best = max(("speculative_k2", walked), key=lambda m: r["modes"][m]["tok_per_s"])
    assert r["per_mode"][best]["vs_hf_assisted"]["median"] == pytest.approx(r["speedup_vs_hf_assisted"])
    assert len(r["modes"]["target_only"]["per_prompt"]) == 4
    # the plot beside the report draws each mode's rate per repeat, and its ratios as the report defines them
    from draftsmith.decode.bench import mode_rates

    assert report.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    rates = {m: mode_rates(r["modes"][m]) for m in (best, "target_only")}
    assert len(rates[best]) == 2 and rates[best][0] == pytest.approx(
        sum(p["tokens"] for p in r["modes"][best]["per_prompt"] if p["repeat"] == 0)
        / sum(p["seconds"] for p in r["modes"][best]["per_prompt"] if p["repeat"] == 0))
    ratios = [a / b for a, b in zip(rates[best], rates["target_only"])]
    assert statistics.median(ratios) == pytest.approx(r["per_mode"][best]["vs_target_only"]["median"])


@pytest.mark.parametrize("content,needle", [(None, "no such kept-vocabulary file"), ("{", "not valid JSON"),
                                            ('{"format": "draftsmith-kept-vocab", "version": 1, "vocab_size": 5, '
                                             '"n": 1, "ids": [1]}', "built for a vocabulary of 5 ids")])
def test_decode_with_a_bad_kept_vocabulary_is_one_line(tiny_pair, capsys, tmp_path: Path, content, needle) -> None:
    kept = tmp_path / "kept.json"
    if content is not None:
        kept.write_text(content)
    line = one_line_error(capsys, "--target", str(tiny_pair["target"]), "--draft",
                          f"prune:{tiny_pair['draft']}:vocab={kept}")
    assert needle in line


def test_export_refuses_a_pruned_draft_with_the_reason(capsys, tmp_path: Path) -> None:
    from draftsmith.recipes.cli import main

    code = main(["export", "--draft", "prune:m:vocab=kept.json", "--target", "t", "--out", str(tmp_path / "x")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "llama.cpp's draft-simple" in lines[0] and "MODEL whole" in lines[0]
    assert not (tmp_path / "x").exists()


def test_grid_times_a_head_at_every_policy_in_one_run(tiny_pair, capsys, tmp_path: Path) -> None:
    """`draftsmith grid` (what scripts/head_run.py's bench did): every policy beside the target alone, one run."""
    from draftsmith.recipes.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "sort the list of data", "domain": "code"}) + "\n")
    out = tmp_path / "grid.json"
    code = main(["grid", "--target", str(tiny_pair["target"]), "--draft", f"head:{tiny_pair['head']}",
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--k", "1,2", "--confidence", "0,0.5",
                 "--siblings", "0,2", "--sibling-depth", "1,2", "--quant", "none,int8", "--out", str(out)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out.read_text())
    names = ["K=1", "K=1 stop<0.5 siblings=2", "K=2", "K=2 stop<0.5", "K=2 stop<0.5 siblings=2",
             "K=2 stop<0.5 siblings=2 children"]
    assert list(result["policies"]) == [f"{n} {q}" for q in ("none", "int8") for n in names]
    assert all(result["greedy_equal"].values()) and "target alone" in printed and "K=2 stop<0.5 int8" in printed
    code = main(["grid", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"]), "--k", "0"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "it/s]" not in line]
    assert code == 2 and len(lines) == 1 and "k must list integers >= 1" in lines[0]


def test_decode_siblings_on_a_target_the_generic_runner_serves_is_one_line(tmp_path: Path, capsys,
                                                                           monkeypatch) -> None:
    """A target outside the lean runner (here a Llama with gelu; Gemma-3 in the zoo) runs in transformers, which
    cannot verify a tree: siblings are a one-line error, exit 2, before any decoding."""
    from tests import helpers
    from tests.pairing.test_leaderboard import WORDS, tiny_tokenizer

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    vocab = len(WORDS) + 3
    target = helpers.save_tiny(tmp_path / "gelu", tiny_tokenizer(), 0, vocab_size=vocab, eos_id=2, bos_id=1,
                               layers=2, hidden_act="gelu")
    draft = helpers.save_tiny(tmp_path / "draft", tiny_tokenizer(), 1, vocab_size=vocab, eos_id=2, bos_id=1, layers=1)
    line = one_line_error(capsys, "--target", str(target), "--draft", str(draft), "--confidence", "0.5",
                          "--siblings", "2")
    assert "--siblings needs a target the lean runner can run" in line
    code, out, err = decode(capsys, "--target", str(target), "--draft", str(draft), "--k", "2", "--json")
    assert code == 0 and len(json.loads(out)["tokens"]) == 12, err  # without siblings it decodes


def test_models_llama_cpp_builds_the_engine_once_and_prints_where(monkeypatch, capsys, tmp_path: Path) -> None:
    import draftsmith.distill.export.llama_cpp as lc
    from draftsmith.recipes.cli import main

    calls = []
    monkeypatch.setattr(lc, "find_llama_server", lambda **kw: calls.append("server") or tmp_path / "llama-server")
    monkeypatch.setattr(lc, "converter_dir", lambda **kw: calls.append("src") or tmp_path / "src")
    assert main(["models", "llama-cpp"]) == 0
    assert calls == ["server", "src"] and capsys.readouterr().out.split() == [str(tmp_path / "llama-server"),
                                                                             str(tmp_path / "src")]
