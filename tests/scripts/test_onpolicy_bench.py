"""scripts/onpolicy_bench.py runs: as a subprocess, on tiny random Llamas (a target and a smaller draft sharing a
word tokenizer), every path in alternating rounds, into a bench.json with raw seconds and tokens, tokens/s per path,
the ratios, the machine, the versions and the command; `--from` prints it again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import helpers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return helpers.script_world(tmp_path_factory.mktemp("onpolicy"), layers=2, per_domain=2, draft_layers=1)


def run(world: dict, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "scripts/onpolicy_bench.py", *args], cwd=ROOT, env=world["env"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_onpolicy_bench(world: dict, tmp_path: Path) -> None:
    run(world, "--target", world["target"], "--draft", world["draft"], "--prompts", world["prompts"],
        "--per-domain", "1", "--samples", "2", "--max-new-tokens", "4", "--batch-size", "3", "--teacher-topk", "4", "--repeats", "2",
        "--out", str(tmp_path))
    result = json.loads((tmp_path / "bench.json").read_text(encoding="utf-8"))
    assert {"cpu", "cpu_count", "torch_threads"} <= set(result["machine"])
    assert {"torch", "transformers"} <= set(result["versions"])
    assert "onpolicy_bench.py" in result["command"] and result["prompts"] == 4 and result["samples"] == 2
    order = [(r["round"], r["path"]) for r in result["runs"]]
    assert order == [(0, "speculative"), (0, "batched"), (0, "onpolicy"),
                     (1, "onpolicy"), (1, "batched"), (1, "speculative")]  # alternating: drift hits all alike
    for r in result["runs"]:
        assert r["rows"] == 4 and 4 <= r["tokens"] <= 16 and r["seconds"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    onpolicy = [r for r in result["runs"] if r["path"] == "onpolicy"]
    assert all(r["seconds"] == pytest.approx(r["write_seconds"] + r["score_seconds"]) for r in onpolicy)
    assert all(r["prefill_tokens"] > r["tokens"] for r in onpolicy)
    assert set(result["per_path"]) == {"speculative", "batched", "onpolicy"}
    per = result["per_path"]
    assert result["ratios"]["onpolicy_over_speculative"] == pytest.approx(
        per["onpolicy"]["tokens_per_s"] / per["speculative"]["tokens_per_s"])
    best = max(per["speculative"]["tokens_per_s"], per["batched"]["tokens_per_s"])
    assert result["ratios"]["onpolicy_over_best_target"] == pytest.approx(per["onpolicy"]["tokens_per_s"] / best)
    assert result["ratios"]["score_alone_over_best_target"] == pytest.approx(
        per["onpolicy"]["score_tokens_per_s"] / best)
    assert result["ratios"]["score_alone_over_best_target"] > result["ratios"]["onpolicy_over_best_target"]
    assert result["writer"] in ("int4", "int8", "as loaded") and result["goal"] == 5.0
    assert result["device"] == "cpu"
    again = run(world, "--from", str(tmp_path / "bench.json"))
    assert "onpolicy_over_best_target" in again.stdout and "tokens/s" in again.stdout
