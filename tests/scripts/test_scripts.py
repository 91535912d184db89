"""Every benchmark script in scripts/ runs: each one, as a subprocess, in its tiny mode on a tiny random Llama
(seconds), exits 0 and writes the JSON its docs page cites, with the machine and the versions. And no script
reaches into a private name of the package: scripts call the public API only."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import helpers

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
PACKAGES = ("decode", "pairing", "distill", "recipes")
TESTED = {"allocator_bench.py", "distill_table.py", "draft_agreement.py", "gptq_agreement.py", "head_data_bench.py",
          "head_train_bench.py", "kernel_bench.py", "linear_bench.py", "native_bench.py", "onpolicy_bench.py", "q4_prefetch.py"}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A 4-layer Llama with BOS/EOS and a word tokenizer (a head reads target layers [2, L/2, L-3]: L >= 4), a
    prompts file of 3 prompts in each of two domains, and a model cache of its own."""
    return helpers.script_world(tmp_path_factory.mktemp("scripts"), layers=4, per_domain=3)


def run_script(world: dict, name: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, f"scripts/{name}", *args], cwd=ROOT, env=world["env"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def read_result(path: Path) -> dict:
    result = json.loads(path.read_text(encoding="utf-8"))
    assert {"cpu", "cpu_count", "torch_threads"} <= set(result["machine"])
    assert {"torch", "transformers"} <= set(result["versions"])
    return result


def test_linear_bench(world: dict, tmp_path: Path) -> None:
    run_script(world, "linear_bench.py", "--target", world["target"], "--context", "16", "--max-rows", "2",
               "--repeats", "1", "--reps", "1", "--out", str(tmp_path))
    result = read_result(tmp_path / "bench.json")
    assert {"target", "context", "median_ms", "v", "one_row_vs_dnn", "seconds"} <= set(result)
    assert set(result["median_ms"]) == {"dnn", "xw", "wx"}
    assert all(set(per) == {"1", "2"} for per in result["median_ms"].values())
    assert result["one_row_vs_dnn"]["dnn"] == 1.0


def test_native_bench(world: dict, tmp_path: Path) -> None:
    from draftsmith.decode.runtime import native

    if native.kernels() is None:
        pytest.skip(f"no native kernels here: {native.why_not()}")
    run_script(world, "native_bench.py", "--draft", world["target"], "--context", "8", "--steps", "2",
               "--repeats", "1", "--out", str(tmp_path))
    result = read_result(tmp_path / "bench.json")
    assert set(result["median_ms"]) == {"native", "fbgemm"} and len(result["fbgemm_over_native"]) == 1


def test_kernel_bench(world: dict, tmp_path: Path) -> None:
    from draftsmith.decode.runtime import native

    out, md = tmp_path / "kernels.json", tmp_path / "kernels.md"
    run_script(world, "kernel_bench.py", "--models", world["target"], "--rows", "1,2", "--repeats", "1", "--warmup",
               "0", "--out", str(out), "--markdown", str(md))
    result = read_result(out)
    assert {"command", "rows", "repeats", "torchao", "models", "seconds"} <= set(result)
    assert "scripts/kernel_bench.py" in result["command"] and result["rows"] == [1, 2]
    (model, rec), = result["models"].items()
    assert rec["linears"] == 4 * 7 + 1 and list(rec["families"]) == ["int4", "int8", "float"]
    built = native.kernels() is not None
    for fam, fr in rec["families"].items():
        ours = fr["ours"]
        assert fr["backends"][ours]["ran"] == built
        assert all(b["ran"] or b["why_not"] for b in fr["backends"].values())
        ran = {n for n, b in fr["backends"].items() if b["ran"]}
        assert set(fr["output_check"]) == ran and all(c["ok"] for c in fr["output_check"].values()), fr["output_check"]
        assert set(fr["rows"]) == {"1", "2"}
        for T, cell in fr["rows"].items():
            timed = set(cell["median_ms"])
            assert timed <= ran and ran - timed <= set(fr["timed_less"].get(T, {}))  # dropped only where recorded
            assert all(len(ms) == 1 for ms in cell["ms"].values())
            if built:
                assert cell["verdict"]["decision"] in ("use library", "keep ours")
                for n, r in cell["ratio_vs_ours"].items():
                    assert r == pytest.approx(cell["median_ms"][n] / cell["median_ms"][ours], rel=1e-3)
            else:
                assert cell["verdict"]["decision"] == "no verdict"
    page = md.read_text(encoding="utf-8")
    assert f"### {model}: int4" in page and "| rows | " in page and "Verdict: " in page
    again = subprocess.run([sys.executable, "scripts/kernel_bench.py", "--from", str(out)], cwd=ROOT,
                           env=world["env"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == page  # re-rendered from the JSON, nothing timed


def kernel_bench():
    """scripts/kernel_bench.py as a module (its pure functions; registered: its dataclasses look themselves up)."""
    name = "draftsmith_script_kernel_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / "kernel_bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_kernel_bench_ratio_and_verdict_rule() -> None:
    kb = kernel_bench()
    assert kb.ratios({"ours": 2.0, "a": 2.2, "b": 1.0}, "ours") == {"a": 1.1, "b": 0.5}
    assert kb.ratios({"a": 1.0}, "ours") == {}  # ours not timed: no ratios
    use = kb.verdict({"a": 1.10})  # within 10%: the library op replaces ours
    assert (use["decision"], use["library"], use["ratio"]) == ("use library", "a", 1.10)
    keep = kb.verdict({"a": 1.11, "b": 1.5})
    assert (keep["decision"], keep["library"], keep["ratio"]) == ("keep ours", "a", 1.11)
    assert kb.verdict({"a": 1.5, "b": 1.05})["library"] == "b"  # the fastest library op is the one named
    assert kb.verdict({"a": 0.5, "b": 1.05}, exclude={"a"})["library"] == "b"  # a wrong output is no candidate
    assert kb.verdict({"a": 0.5}, exclude={"a"}) == kb.verdict({})
    assert kb.verdict({})["decision"] == "keep ours" and kb.verdict({})["library"] is None
    assert kb.verdict({"a": 1.2}, margin=1.25)["decision"] == "use library"

    cell = kb.summarize({"ours": [0.002, 0.001, 0.003], "lib": [0.0021, 0.0022, 0.0020], "slow": [0.01]}, "ours")
    assert cell["median_ms"] == {"ours": 2.0, "lib": 2.1, "slow": 10.0}
    assert cell["min_ms"]["ours"] == 1.0 and cell["max_ms"]["ours"] == 3.0 and cell["ms"]["lib"] == [2.1, 2.2, 2.0]
    assert cell["ratio_vs_ours"] == {"lib": 1.05, "slow": 5.0}
    assert (cell["verdict"]["decision"], cell["verdict"]["library"]) == ("use library", "lib")
    wrong = kb.summarize({"ours": [0.002], "lib": [0.0021]}, "ours", exclude={"lib"})
    assert wrong["verdict"]["decision"] == "keep ours"
    assert kb.summarize({"lib": [0.001]}, "ours")["verdict"]["decision"] == "no verdict"

    cells = {"1": kb.summarize({"ours": [1.0], "a": [2.0]}, "ours"), "2": kb.summarize({"ours": [1.0], "a": [2.0]},
             "ours"), "8": kb.summarize({"ours": [2.0], "a": [1.0]}, "ours")}
    assert kb.family_summary(cells) == "keep ours at T = 1, 2; use a at T = 8"


def test_draft_agreement(world: dict, tmp_path: Path) -> None:
    from draftsmith.decode.runtime.quant import int4_ok

    variants = ["float", "int8", "int8 fbgemm prefill"] + (["int4", "int4 fbgemm prefill"] if int4_ok() else [])
    run_script(world, "draft_agreement.py", "--target", world["target"], "--draft", world["target"], "--prompts",
               world["prompts"], "--per-domain", "1", "--max-new-tokens", "4", "--variants", ",".join(variants),
               "--out", str(tmp_path))
    result = read_result(tmp_path / "agreement.json")
    assert list(result["variants"]) == variants
    assert result["variants"]["float"]["by_domain"]["code"]["rate"] == 1.0  # the target against itself


def test_gptq_agreement(world: dict, tmp_path: Path) -> None:
    from draftsmith.decode.runtime.quant import int4_ok

    if not int4_ok():
        pytest.skip("no int4 kernel here")
    run_script(world, "gptq_agreement.py", "--target", world["target"], "--draft", world["target"], "--prompts",
               world["prompts"], "--calib-skip", "1", "--calib-per-domain", "1", "--calib-tokens", "4", "--skip", "2",
               "--max-new-tokens", "4", "--out", str(tmp_path))
    result = read_result(tmp_path / "gptq-agreement.json")
    assert list(result["drafts"]) == ["int4", "int4 GPTQ", "int8"] and len(result["measured_on"]) == 2
    assert not set(result["calibrated_on"]) & set(result["measured_on"])


def test_q4_prefetch(world: dict, tmp_path: Path) -> None:
    from draftsmith.decode.runtime.quant import int4_ok

    if not int4_ok():
        pytest.skip("no int4 kernel here")
    run_script(world, "q4_prefetch.py", "--draft", world["target"], "--context", "8", "--steps", "2", "--passes", "1",
               "--out", str(tmp_path))
    result = read_result(tmp_path / "q4-prefetch.json")
    assert result["chosen"] in (1024, 2048, 4096, 8192) and set(result["step_ms_median"]) == {"1024", "2048", "4096",
                                                                                               "8192"}


def test_head_data_bench(world: dict, tmp_path: Path) -> None:
    run_script(world, "head_data_bench.py", "--target", world["target"], "--prompts", world["prompts"], "--limit", "4",
               "--samples", "1", "--max-new-tokens", "4", "--batch-sizes", "2,4", "--repeats", "1", "--out",
               str(tmp_path))
    result = read_result(tmp_path / "bench.json")
    assert {"target", "rows", "runs", "tokens_per_s", "ratio_vs_first"} <= set(result)
    assert result["rows"] == 4 and [r["batch_size"] for r in result["runs"]] == [2, 4]
    assert set(result["tokens_per_s"]) == {"2", "4"} and result["ratio_vs_first"]["2"] == 1.0


def test_head_train_bench(world: dict, tmp_path: Path) -> None:
    run_script(world, "head_train_bench.py", "--target", world["target"], "--steps", "2", "--repeats", "1",
               "--draft-vocab", "16", "--out", str(tmp_path))
    result = read_result(tmp_path / "bench.json")
    assert {"target", "steps", "seconds_per_step", "median_seconds_per_step", "aux_layers"} <= set(result)
    assert result["aux_layers"] == [2, 2, 1] and result["draft_vocab_size"] == 16
    assert len(result["seconds_per_step"]) == 1 and result["median_seconds_per_step"] > 0


def test_allocator_bench(world: dict, tmp_path: Path) -> None:
    run_script(world, "allocator_bench.py", "--target", world["target"], "--prompts", "4", "--samples", "1",
               "--max-new-tokens", "4", "--steps", "2", "--draft-vocab", "16", "--settings", "system,keep",
               "--out", str(tmp_path))
    result = read_result(tmp_path / "bench.json")
    assert {"runs", "args", "ratio_keep_over_system"} <= set(result)
    assert [r["setting"] for r in result["runs"]] == ["system", "keep"]
    assert result["runs"][0]["allocator"] == "system"
    assert {"data_tokens_per_s", "train_tokens_per_s"} == set(result["ratio_keep_over_system"])
    assert "allocator" not in result["machine"]  # each run says its own


def test_distill_table(world: dict, tmp_path: Path) -> None:
    run_script(world, "distill_table.py", "--target", world["target"], "--draft", f"derive:{world['target']}:keep=1",
               "--prompts", world["prompts"], "--eval-per-domain", "1", "--max-new-tokens", "4", "--steps", "2",
               "--runs", "fkl-target,fkl-draft", "--earlier-target-data", "", "--root", str(tmp_path),
               "--data-root", str(tmp_path), "--docs", str(tmp_path / "distill-table"))
    result = read_result(tmp_path / "distill-table.json")
    assert {"target", "draft", "train_prompts", "held_out_prompts", "data", "train_config", "command",
            "runs"} <= set(result)
    assert (result["train_prompts"], result["held_out_prompts"]) == (4, 2)
    assert [r["run"] for r in result["runs"]] == ["fkl-target", "fkl-draft"]
    for r in result["runs"]:
        assert {"alpha_before", "alpha_after", "alpha_gain", "loss_final", "train_tokens"} <= set(r)
        assert Path(r["out"]).parent == tmp_path and r["config"]["steps"] == 2
    assert set(result["data"]) == {"target", "draft"}
    assert all(Path(d["folder"]).parent == tmp_path for d in result["data"].values())
    md = (tmp_path / "distill-table.md").read_text(encoding="utf-8")
    assert f"Target `{world['target']}`" in md and "| fkl |" in md and "| rkl | not run" in md


def scripts() -> list[Path]:
    return sorted(SCRIPTS.glob("*.py"))


def test_every_script_has_a_smoke_test_and_a_run_command() -> None:
    assert {p.name for p in scripts()} == TESTED
    for path in scripts():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert doc and f"scripts/{path.name}" in doc, f"{path.name}: the docstring gives no run command"


@pytest.mark.parametrize("path", scripts(), ids=lambda p: p.name)
def test_scripts_import_no_private_name(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{path.name}: from {node.module} import {', '.join(private)}"
            for a in node.names:
                assert (node.module, a.name) not in seen, f"{path.name}: {node.module}.{a.name} imported twice"
                seen.add((node.module, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    assert not any(part.startswith("_") for part in a.name.split(".")), f"{path.name}: {a.name}"
