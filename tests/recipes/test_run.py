"""A tiny-model recipe through the real `draftsmith run` command: every stage writes its part of the run folder,
a run killed mid-distillation resumes to the same final weights as an uninterrupted run, finished stages are
skipped, changed settings are refused with the keys that changed, and `draftsmith leaderboard` merges runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftsmith.decode.runtime.quant import int4_chunk
from draftsmith.decode.spec import DraftSpec
from tests import helpers

DRAFTSMITH = Path(sys.executable).parent / "draftsmith"
WORDS = "the a of to and in is it that for on with as was be by this are or at from code data list sort print".split()


def save_tiny(path: Path, seed: int, layers: int) -> Path:
    tok = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *WORDS], eos="</s>", bos="<s>", split_punctuation=True)
    return helpers.save_tiny(path, tok, seed, eos_id=2, bos_id=1, layers=layers, head_scale=4.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("recipe")
    target = save_tiny(root / "target", 0, 3)
    other = save_tiny(root / "other", 1, 1)
    prompts = root / "prompts.jsonl"
    rows = [(d, " ".join(WORDS[(5 * i + j) % len(WORDS)] for j in range(2 + i % 3)))
            for i in range(6) for d in ("code", "chat")]
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in rows))
    recipe = {
        "name": "tiny", "target": str(target), "prompts": str(prompts),
        "pair": {"candidates": [f"derive:{target}:keep=1", str(other)], "prompts_per_domain": 2, "max_new_tokens": 8,
                 "draft_quant": None},
        "distill": {"draft": "best", "max_new_tokens": 12, "eval_per_domain": 2,
                    "train": {"steps": 80, "batch_size": 2, "lr": 1e-3, "warmup_steps": 2, "eval_every": 40,
                              "save_every": 5}},
        "validate": {"prompts_per_domain": 1, "max_new_tokens": 8, "max_k": 4, "draft_quant": None},
        "export": {"formats": ["hf"]},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return {"root": root, "recipe": path, "env": {**os.environ, "DRAFTSMITH_CACHE": str(root / "cache")}}


def draftsmith(world: dict, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(DRAFTSMITH), *args], capture_output=True, text=True, timeout=900,
                          env=env or world["env"])


def two_test_prompts(root: Path, name: str) -> Path:
    """A test split of one code and one chat prompt (ids t0, t1) the tiny recipes time."""
    test = root / f"test-{name}.jsonl"
    test.write_text("".join(json.dumps({"id": f"t{i}", "prompt": p, "domain": d}) + "\n" for i, (d, p) in
                            enumerate([("code", "sort the list of data"), ("chat", "print this code for a list")])))
    return test


def run_recipe_dict(world: dict, recipe: dict, out: Path) -> Path:
    """`draftsmith run` of `recipe` (written beside the world's files) into `out`, which it returns; it must pass."""
    path = world["root"] / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    r = draftsmith(world, "run", str(path), "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def whole(world: dict) -> Path:
    out = world["root"] / "runs" / "whole"
    r = draftsmith(world, "run", str(world["recipe"]), "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_a_recipe_run_fills_the_run_folder(whole: Path) -> None:
    state = json.loads((whole / "state.json").read_text())["stages"]
    assert [s for s in state] == ["pair", "distill", "validate", "export"]
    assert all(e["status"] == "done" for e in state.values())
    for rel in ("recipe.yaml", "pairing/leaderboard.json", "pairing/leaderboard.html", "distill/data",
                "distill/best/model.safetensors", "distill/log.jsonl", "validate/bench.json",
                "export/export.json", "report.md", "report.html", "report/training.png", "report/speed.png"):
        assert (whole / rel).exists(), rel
    resolved = yaml.safe_load((whole / "recipe.yaml").read_text())
    assert resolved["distill"]["train"]["steps"] == 80 and resolved["distill"]["train"]["loss"] == "fkl"
    bench = json.loads((whole / "validate" / "bench.json").read_text())
    assert set(bench["tok_per_s"]) == {"target_only", "draft_before", "draft_after"}
    assert bench["greedy_equal"] == {"draft_before": True, "draft_after": True}
    assert bench["k_reason"].startswith("best predicted") and bench["predicted_speedup"] > 0  # K's prediction kept
    # a prompt file without test_prompts has no test split: the held-out prompts are timed, and the result says so
    assert bench["in_sample"] and bench["prompt_roles"]["timed_on"] == bench["prompt_roles"]["chosen_on"]
    assert len(bench["repeats"]) == 3 and set(bench["speedup_range"]) == {"draft_before", "draft_after"}
    report = (whole / "report.md").read_text()
    for needle in ("Pairing leaderboard", "Distillation", "alpha before", "tok/s", "vs target alone", "Export"):
        assert needle in report, needle
    # the leaderboard's best token-level candidate is the one distilled
    board = json.loads((whole / "pairing" / "leaderboard.json").read_text())
    top = next(c["draft"] for c in board["candidates"] if c["compatible"])
    assert json.loads((whole / "distill" / "distill.json").read_text())["draft"] == top


def test_finished_stages_are_skipped_and_changed_settings_refused(world: dict, whole: Path) -> None:
    (whole / "report.md").unlink()
    r = draftsmith(world, "run", str(world["recipe"]), "--out", str(whole), "--stages", "pair,validate")
    assert r.returncode == 0, r.stderr
    assert "[pair] done earlier, skipped" in r.stdout and "[validate] done earlier, skipped" in r.stdout
    assert "[distill]" not in r.stdout
    assert "Pairing leaderboard" in (whole / "report.md").read_text()  # every stage skipped: the report made anew
    r = draftsmith(world, "run", str(world["recipe"]), "distill.train.steps=81", "--out", str(whole))
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line and "distill.train.steps: 80 -> 81" in line and "--restart distill" in line, line


def run_and_kill(cmd: list[str], env: dict, ready) -> int:
    """Run `cmd`, SIGKILL it (harsher than Ctrl-C: nothing gets to clean up) as soon as `ready()` holds, and
    return its exit code (-SIGKILL when it was killed; within 10 minutes)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ready():
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return proc.returncode


def _final_weights(run: Path) -> tuple[str, dict[str, torch.Tensor]]:
    last = sorted((run / "distill" / "checkpoints").iterdir(), key=lambda p: int(p.name[5:]))[-1]
    return last.name, load_file(str(last / "student.safetensors"))


def test_killed_mid_distill_then_rerun_ends_with_the_same_weights(world: dict, whole: Path) -> None:
    out = world["root"] / "runs" / "killed"
    ckpts = out / "distill" / "checkpoints"
    code = run_and_kill([str(DRAFTSMITH), "run", str(world["recipe"]), "--out", str(out)], world["env"],
                        lambda: ckpts.is_dir() and any(int(p.name[5:]) >= 10 for p in ckpts.iterdir()
                                                       if p.name.startswith("step-") and p.name[5:].isdigit()))
    assert code == -signal.SIGKILL, "the run ended before it could be killed mid-distillation"
    state = json.loads((out / "state.json").read_text())["stages"]
    assert state["pair"]["status"] == "done" and state["distill"]["status"] == "running"

    r = draftsmith(world, "run", str(world["recipe"]), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[pair] done earlier, skipped" in r.stdout and "[distill] resuming" in r.stdout
    (step_a, a), (step_b, b) = _final_weights(whole), _final_weights(out)
    assert step_a == step_b == "step-80"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed run differs"
    best_a = load_file(str(whole / "distill" / "best" / "model.safetensors"))
    best_b = load_file(str(out / "distill" / "best" / "model.safetensors"))
    assert all(torch.equal(best_a[k], best_b[k]) for k in best_a)


def test_leaderboard_merges_two_runs_into_one_table(world: dict, whole: Path, tmp_path: Path) -> None:
    # two run folders of its own, whichever tests ran before: the finished run under two names
    first, other = shutil.copytree(whole, tmp_path / "first"), shutil.copytree(whole, tmp_path / "other")
    out = tmp_path / "board"
    r = draftsmith(world, "leaderboard", str(first), str(other), "--out", str(out))
    assert r.returncode == 0, r.stderr
    merged = json.loads((out / "leaderboard.json").read_text())
    assert {row["run"] for row in merged["rows"]} == {str(first), str(other)}
    assert any(row["kind"] == "distilled" for row in merged["rows"])
    md = (out / "leaderboard.md").read_text()
    assert md.count("| target | draft |") == 1 and (out / "leaderboard.html").is_file()
    assert draftsmith(world, "leaderboard", str(world["root"] / "nope")).returncode == 2


def test_gen_data_on_two_processes_equals_one_process(world: dict) -> None:
    """`accelerate launch --multi_gpu --num_processes 2 ... gen-data` (on CPU: torchrun's launcher, gloo): each process samples its half of the prompts (each row
    seeded by its place in the whole list), the main process merges the halves and builds the teacher cache; the
    dataset and the cache equal a single process's. (Batches of 3 over 6 prompts: both runs decode the same
    batches, one thread per process, so float32 rounding is the same too: with two threads, on the AMD EPYC of
    run 11, the teacher's log-probabilities came out different in the last bits, the tokens the same.)"""
    import datasets
    from safetensors.torch import load_file

    target = str(world["root"] / "target")
    common = ["gen-data", "--target", target, "--draft", f"derive:{target}:keep=1", "--prompts",
              str(world["root"] / "prompts.jsonl"), "--limit-per-domain", "3", "--max-new-tokens", "6",
              "--plain-data", "--batch-size", "3", "--teacher", "cache", "--teacher-topk", "4"]
    one, two = world["root"] / "dp-one", world["root"] / "dp-two"
    one_thread = {**world["env"], "OMP_NUM_THREADS": "1"}  # as each of the two processes has
    r = draftsmith(world, *common, "--out", str(one), env=one_thread)
    assert r.returncode == 0, r.stderr[-2000:]
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "draftsmith.recipes.cli"]
    r = subprocess.run([*launch, *common, "--out", str(two)], capture_output=True, text=True, timeout=900,
                       env=one_thread)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("6 rows in") == 1 and "on 2 processes" in r.stdout and "kept while generating" in r.stdout
    a, b = (datasets.load_from_disk(str(f / "dataset")).to_list() for f in (one, two))
    assert len(a) == 6 and a == b and {row["domain"] for row in a} == {"code", "chat"}
    assert not (two / "shards").exists() and json.loads((two / "stats.json").read_text())["processes"] == 2
    caches = [sorted((f / "teacher-topk").rglob("*.safetensors")) for f in (one, two)]
    assert caches[0] and len(caches[0]) == len(caches[1])
    for x, y in zip(*caches):
        tx, ty = load_file(str(x)), load_file(str(y))
        assert tx.keys() == ty.keys() and all(torch.equal(tx[k], ty[k]) for k in tx)


def test_gen_data_cli_writes_a_resumable_dataset_with_the_flags_it_was_given(world: dict) -> None:
    """`draftsmith gen-data` alone: the flags reach the rows and the folder's settings; a rerun loads, and a
    rerun with other settings is a one-line refusal that leaves the rows alone."""
    import datasets

    out = world["root"] / "gen-data"
    target = str(world["root"] / "target")
    args = ("gen-data", "--target", target, "--draft", f"derive:{target}:keep=1", "--prompts",
            str(world["root"] / "prompts.jsonl"), "--limit-per-domain", "2", "--data", "mixed", "--mix", "0.5",
            "--max-new-tokens", "5", "--plain-data", "--batch-size", "3", "--teacher", "cache", "--teacher-topk", "4",
            "--out", str(out))
    r = draftsmith(world, *args)
    assert r.returncode == 0 and "4 rows in" in r.stdout, r.stderr[-2000:]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows"] == 4 and stats["tokens_per_s"] > 0 and "tokens/s at batch 3" in r.stdout
    assert "teacher top-4 cache" in r.stdout and len(list((out / "teacher-topk").glob("*/done.json"))) == 1
    ds = datasets.load_from_disk(str(out / "dataset"))
    from draftsmith.distill.data import training_rows
    from draftsmith.distill.teacher_cache import TeacherTopK

    cache = TeacherTopK(next((out / "teacher-topk").glob("*/done.json")).parent, 10**6)
    assert len(cache) == len(training_rows(ds)) and cache.k == 4  # the cache training on this data will find
    assert len(ds) == 4 and sorted(ds["source"]) == ["draft", "draft", "target", "target"]
    assert all(1 <= len(c) <= 5 for c in ds["continuation_ids"])
    settings = json.loads((out / "settings.json").read_text())
    assert settings["speculative"] is False and settings["mix"] == 0.5 and settings["prompts"] == 4
    assert draftsmith(world, *args).returncode == 0  # finished: loaded again
    r = draftsmith(world, *[a if a != "5" else "6" for a in args])
    assert r.returncode == 2 and "other settings (max_new_tokens)" in r.stderr and "Traceback" not in r.stderr
    assert datasets.load_from_disk(str(out / "dataset")).to_list() == ds.to_list()


def test_a_head_recipe_runs_every_stage(world: dict) -> None:
    """`distill.draft: head`: the distill stage trains an EAGLE-3 head on the target's text and features, validate
    times it beside the target alone and the pair stage's best standalone draft (greedy-equal), export writes
    the vLLM and SGLang folders; the report and the cross-run leaderboard show the head."""
    target = save_tiny(world["root"] / "target8", 0, 8)  # aux layers [2, 4, 5]
    test = world["root"] / "test-prompts.jsonl"  # timed only: never trained on, never used to choose
    test.write_text("".join(json.dumps({"id": f"t{i}", "prompt": p, "domain": d}) + "\n" for i, (d, p) in
                            enumerate([("code", "sort the list of data"), ("chat", "print this code for a list")])))
    recipe = {
        "name": "tiny-head", "target": str(target), "prompts": str(world["root"] / "prompts.jsonl"),
        "test_prompts": str(test),
        "pair": {"candidates": [f"derive:{target}:keep=2"], "prompts_per_domain": 2, "max_new_tokens": 8,
                 "draft_quant": None, "calibrate_prompts": 0},
        "distill": {"draft": "head", "eval_per_domain": 2},
        "head": {"samples": 2, "max_new_tokens": 8, "gen_batch_size": 4, "draft_vocab_size": 16, "epochs": 2,
                 "rows_per_step": 2, "train_minutes": 0, "eval_every": 4,
                 "gen_dtype": "bfloat16", "train_dtype": "bfloat16"},
        "validate": {"prompts_per_domain": 1, "max_new_tokens": 8, "max_k": 3, "draft_quant": None},
        "export": {"formats": ["hf"]},
    }
    path = world["root"] / "tiny-head.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = world["root"] / "runs" / "head"
    r = draftsmith(world, "run", str(path), "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    head = json.loads((out / "distill" / "head.json").read_text())
    assert head["kind"] == "head" and head["aux_layers"] == [2, 4, 5] and len(head["agreement_after"]) == 3
    assert (out / "distill" / "head" / "best" / "model.safetensors").is_file()
    bench = json.loads((out / "validate" / "bench.json").read_text())
    assert set(bench["tok_per_s"]) == {"target_only", "draft_before", "draft_after"}
    assert bench["greedy_equal"] == {"draft_before": True, "draft_after": True}
    assert bench["draft"] == f"derive:{target}:keep=2" and "best predicted" in bench["k_reason"]
    roles = bench["prompt_roles"]
    assert bench["prompts"] == roles["timed_on"] == ["t0", "t1"] and not bench["in_sample"]
    assert roles["chosen_on"] and not set(roles["chosen_on"]) & set(roles["timed_on"])
    board = json.loads((out / "pairing" / "leaderboard.json").read_text())
    standalone_k = board["candidates"][0]["best_k"]  # the standalone draft runs at the pair stage's best K
    assert bench.get("ks", {}).get("draft_before", bench["k"]) == standalone_k
    gated = bench["confidence"]  # validate predicts from the held-out rows, rounds that stop early included
    assert "rounds walked on the held-out references" in bench["k_reason"] and bench["predicted_speedup_gated"]
    sib = f", {bench['siblings']} siblings" if bench["siblings"] else ""  # or side by side below it
    assert bench["predicted_speedup"] == (bench["predicted_speedup_gated"][f"K={bench['k']} below {gated}{sib}"]
                                          if gated else bench["predicted_speedup_by_k"][str(bench["k"])]) > 0
    assert any(key.endswith(", 2 siblings") for key in bench["predicted_speedup_gated"])  # they were predicted
    assert max(bench["predicted_speedup_gated"].values()) <= bench["predicted_speedup"] + 1e-12
    assert max(map(int, bench["stats"]["draft_before"]["tau_hist"])) <= standalone_k + 1
    for rel in ("export/vllm/config.json", "export/sglang/config.json", "report/head_agreement.png"):
        assert (out / rel).is_file(), rel
    report = (out / "report.md").read_text()
    for needle in ("Draft head (EAGLE-3 style)", "| head |", "standalone draft (derive:", "vLLM speculators",
                   "Head vs standalone draft"):
        assert needle in report, needle
    r = draftsmith(world, "leaderboard", str(out), "--out", str(world["root"] / "head-board"))
    assert r.returncode == 0, r.stderr
    rows = json.loads((world["root"] / "head-board" / "leaderboard.json").read_text())["rows"]
    (head_row,) = [row for row in rows if row["kind"] == "head"]
    assert head_row["predicted_speedup"] == bench["predicted_speedup"] and head_row["measured_speedup"] > 0


def _head_recipe(world: dict) -> Path:
    """A head recipe whose training is decided by its steps alone (no time budget), so that two runs agree."""
    target = save_tiny(world["root"] / "target8", 0, 8)
    recipe = {
        "name": "tiny-head-resume", "target": str(target), "prompts": str(world["root"] / "prompts.jsonl"),
        "pair": {"candidates": [f"derive:{target}:keep=2"]},
        "distill": {"draft": "head", "eval_per_domain": 2},
        "head": {"samples": 2, "max_new_tokens": 8, "gen_batch_size": 4, "draft_vocab_size": 16, "epochs": 6,
                 "rows_per_step": 2, "train_minutes": 0, "eval_every": 3},
    }
    path = world["root"] / "tiny-head-resume.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _head_weights(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    head = run / "distill" / "head"
    return {"last": load_file(str(head / "checkpoint" / "head.safetensors")),
            "best": load_file(str(head / "best" / "model.safetensors"))}


def test_killed_mid_head_training_then_rerun_ends_with_the_same_weights(world: dict) -> None:
    """`draftsmith run` on a head recipe, killed once head training has checkpointed, then run again: it resumes
    (data kept, training from its checkpoint) and ends with the weights of an uninterrupted run, bit for bit."""
    path = _head_recipe(world)
    whole = world["root"] / "runs" / "head-whole"
    r = draftsmith(world, "run", str(path), "--out", str(whole), "--stages", "distill")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = json.loads((whole / "distill" / "head" / "summary.json").read_text())["steps"]
    assert steps >= 30

    out = world["root"] / "runs" / "head-killed"
    trainer = out / "distill" / "head" / "checkpoint" / "trainer.json"
    def checkpointed() -> bool:
        try:
            return 6 <= (json.loads(trainer.read_text())["step"] if trainer.is_file() else 0) < steps
        except (OSError, ValueError):  # caught mid-write: look again
            return False

    code = run_and_kill([str(DRAFTSMITH), "run", str(path), "--out", str(out), "--stages", "distill"], world["env"],
                        checkpointed)
    assert code == -signal.SIGKILL, "the run ended before it could be killed mid-training"
    assert json.loads((out / "state.json").read_text())["stages"]["distill"]["status"] == "running"

    r = draftsmith(world, "run", str(path), "--out", str(out), "--stages", "distill")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[distill] resuming" in r.stdout
    assert json.loads((out / "distill" / "head" / "summary.json").read_text())["steps"] == steps
    logged = [json.loads(line) for line in (out / "distill" / "head" / "log.jsonl").read_text().splitlines()]
    assert sum(1 for e in logged if e.get("step") == 1 and "loss" in e) == 1, "training started over, not resumed"
    a, b = _head_weights(whole), _head_weights(out)
    for which in ("last", "best"):
        assert a[which].keys() == b[which].keys()
        assert all(torch.equal(a[which][k], b[which][k]) for k in a[which]), f"resumed run differs ({which})"


def test_a_recipe_with_a_data_section_trains_on_what_the_target_wrote(world: dict) -> None:
    """`data: {n: 4}`: the data stage has the target write 4 requests (gen-prompts) and answer them with its top-k
    kept (gen-data); distill trains on those rows, held-out prompts still from the recipe's prompts."""
    from tests.distill.test_prompt_gen import EOS, chat_tokenizer

    target = helpers.save_tiny(world["root"] / "chat-target", chat_tokenizer(), 0, vocab_size=EOS + 1, eos_id=EOS)
    recipe = {
        "name": "tiny-data", "target": str(target), "prompts": str(world["root"] / "prompts.jsonl"),
        "pair": {"candidates": [f"derive:{target}:keep=1"], "prompts_per_domain": 2, "max_new_tokens": 6,
                 "draft_quant": None, "calibrate_prompts": 0},
        "data": {"n": 4, "domains": ["code", "chat"], "max_prompt_tokens": 24, "batch_size": 4, "max_new_tokens": 5},
        "distill": {"draft": "best", "max_new_tokens": 6, "eval_per_domain": 2, "gen_batch_size": 4,
                    "train": {"steps": 4, "batch_size": 2, "eval_every": 4, "save_every": 2, "teacher": "cache",
                              "teacher_topk": 4}},
        "validate": {"prompts_per_domain": 1, "max_new_tokens": 6, "k": 1, "draft_quant": None},
        "export": {"formats": ["hf"]},
    }
    path = world["root"] / "tiny-data.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = world["root"] / "runs" / "data"
    r = draftsmith(world, "run", str(path), "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    state = json.loads((out / "state.json").read_text())["stages"]
    assert list(state) == ["pair", "data", "distill", "validate", "export"]
    assert state["data"]["result"]["prompts"] == 4 and state["data"]["result"]["rows"] == 4
    distilled = json.loads((out / "distill" / "distill.json").read_text())
    assert distilled["data_dir"] == str(out / "data" / "rows") and distilled["data_rows"] == 4
    assert any((out / "data" / "rows" / "teacher-topk").glob("*/done.json"))
    assert json.loads((out / "data" / "rows" / "settings.json").read_text())["max_new_tokens"] == 5
    report = (out / "report.md").read_text()
    assert "## Data the target wrote" in report and "4 requests kept (code 2, chat 2)" in report


def test_a_race_stage_ranks_pruned_variants_and_writes_the_winner(world: dict) -> None:
    """A race stage (no distill stage: nothing trained) counts the target's text on dev prompts the ranking does not
    read, writes kept-ids files, ranks the whole model beside its pruned variants, and writes the winner's spec to
    RUN/draft.txt, which `draftsmith pair --candidates` takes; validate times the winner beside the whole model
    on test prompts, greedy-equal."""
    root = world["root"]
    test = two_test_prompts(root, "race")
    target, base = root / "target", root / "other"
    recipe = {
        "name": "tiny-race", "target": str(target), "prompts": str(root / "prompts.jsonl"),
        "test_prompts": str(test), "stages": ["pair", "race", "validate"],
        "pair": {"candidates": [str(base)], "prompts_per_domain": 2, "max_new_tokens": 8, "draft_quant": None,
                 "calibrate_prompts": 0, "validate": 2, "validate_prompts": 1},
        "distill": {"eval_per_domain": 2},  # the dev prompts: each domain's first 2
        "race": {"sizes": [6, 20], "prompts_per_domain": 2, "max_new_tokens": 8, "calib": True},
        "validate": {"prompts_per_domain": 1, "max_new_tokens": 8, "max_k": 3, "draft_quant": None},
    }
    out = run_recipe_dict(world, recipe, root / "runs" / "race")
    made = json.loads((out / "race" / "pick.json").read_text())
    int4 = bool(int4_chunk())  # the tiny models' rows (32 wide) take draftsmith's int4 kernel where it is built
    assert made["base"] == str(base) and len(made["ranking"]) == 3 + int4  # whole, [int4,] two pruned variants
    assert any(DraftSpec.parse(r["draft"]).kind == "int4" for r in made["ranking"]) == int4
    # the int4 copy (and the pruned variants of it) GPTQ-rounded on the counted prompts and answers
    calib = out / "race" / "calib.json"
    assert calib.is_file() == int4 and all(f"int4:{base}:calib={calib}" in r["draft"]
                                           for r in made["ranking"] if "int4:" in r["draft"])
    assert len(made["counted_prompts"]) == 4  # prompts 3-4 of each domain: the ranking reads 1-2
    # all of them raced side by side, each at its own walked policy, on dev prompts, the whole model among them at
    # its own walked policy (the fair reference: the same search); the one whose worst domain ran fastest over it won
    race = json.loads((out / "race" / "race.json").read_text())
    assert made["chosen_by"] == "race, worst domain over the base at its walked policy"
    assert sorted(race["drafts"]) == sorted(r["draft"] for r in made["ranking"])
    assert race["reference"] == {"draft": str(base), "policy": "walked", "name": race["reference"]["name"]}
    assert race["drafts"][str(base)]["worst_over_reference"] == 1.0  # the reference over itself
    assert len(race["validation"]["greedy_equal"]) == len(race["drafts"])  # no fixed-K decoder beside them
    for r in race["drafts"].values():
        assert r["greedy_equal"] and len(r["measured_speedup_repeats"]) == 3
        assert set(r["over_reference"]) == {"all", "code", "chat"}
        assert r["worst_over_reference"] == min(r["over_reference"][g]["median"] for g in ("code", "chat"))
    worst = {d: r["worst_over_reference"] for d, r in race["drafts"].items()}
    assert worst[made["draft"]] >= 0.98 * max(worst.values())  # the best worst domain, or within its 2% tie
    assert set(race["timed_on"]) <= set(race["chosen_on"]) and not set(race["timed_on"]) & {"t0", "t1"}
    assert made["measured_speedup"] == race["drafts"][made["draft"]]["measured_speedup"]
    for n in (6, 20):
        kept = json.loads((out / "race" / f"vocab-{n}.json").read_text())
        assert len(kept["ids"]) == n
    line = (out / "draft.txt").read_text().strip()
    assert line == made["draft"] and "\n" not in line
    bench = json.loads((out / "validate" / "bench.json").read_text())
    assert all(bench["greedy_equal"].values()) and bench["prompts"] == ["t0", "t1"] and not bench["in_sample"]
    # the ladder: the stock model at its ranking's plain K, then at its walked policy (draft_before, the fair
    # baseline), then its int4 copy, then the best pruned variant; each raced rung at the policy the race walked
    rungs = [r["name"] for r in bench["ladder"]["rungs"]]
    assert rungs[:2] == ["stock_plain", "draft_before"] and len(rungs) == 3 + int4 and set(rungs) == set(
        bench["greedy_equal"])
    assert bench["policies"]["stock_plain"] == {"k": made["base_k"], "confidence": None, "siblings": 0,
                                                "sibling_depth": 1, "lookup": 0}
    assert bench["policies"]["draft_before"] == race["drafts"][str(base)]["policy"] and "raced" in bench["k_reason"]
    spec = {"draft_before": str(base), **{n: made["draft"] for n in ["draft_after"] if n in rungs}}
    for name, s in spec.items():
        assert bench["policies"][name] == race["drafts"][s]["policy"]
    assert ("draft_after" in rungs) == (made["draft"] != str(base))
    for r in bench["ladder"]["rungs"]:
        assert set(r["over_target"]) == {"all", "code", "chat"} and len(r["over_target"]["all"]["repeats"]) == 3
        assert (r["over_below"] is None) == (r["name"] == "stock_plain")
    assert len(bench["prompt_roles"]["timed_sha256"]) == 64
    report = (out / "report.md").read_text()
    assert "the ladder" in report and (out / "report" / "ladder.png").is_file()
    again = draftsmith(world, "pair", "--target", str(target), "--candidates", line, "--prompts",
                       str(root / "prompts.jsonl"), "--prompts-per-domain", "1", "--max-new-tokens", "4",
                       "--draft-quant", "null", "--calibrate-prompts", "0", "--out", str(root / "runs" / "again"))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert (out / "report.md").is_file()


def test_a_recipe_whose_candidates_are_int4_pruned_and_head_specs_runs(world: dict, tmp_path: Path) -> None:
    """Every draft kind the CLI takes is a recipe candidate too: `int4:` (where the int4 kernel is built),
    `prune:...:vocab=` and `head:` validate and rank in the pair stage of `draftsmith run`."""
    from draftsmith.pairing.prune import build_vocab
    from tests.pairing.test_leaderboard import save_random_head

    root = world["root"]
    target, other = root / "target", root / "other"
    kept = tmp_path / "kept.json"
    build_vocab(torch.ones(json.loads((target / "config.json").read_text())["vocab_size"]), kept, coverage=None, size=20)
    head = save_random_head(tmp_path / "head", target)
    specs = ([f"int4:{other}"] if int4_chunk() else []) + [f"prune:{other}:vocab={kept}", f"head:{head}"]
    recipe = {"name": "tiny-kinds", "target": str(target), "prompts": str(root / "prompts.jsonl"), "stages": ["pair"],
              "pair": {"candidates": specs, "prompts_per_domain": 2, "max_new_tokens": 6, "draft_quant": None,
                       "calibrate_prompts": 1, "calibrate_tokens": 4}}
    out = run_recipe_dict(world, recipe, root / "runs" / "kinds")
    board = json.loads((out / "pairing" / "leaderboard.json").read_text())
    assert sorted(c["draft"] for c in board["candidates"]) == sorted(specs)
    assert all(c["alpha"] is not None for c in board["candidates"])


@pytest.mark.parametrize("lora_r", [4, 0], ids=["lora", "groups"])
def test_a_trained_draft_races_beside_its_untrained_self_and_tops_the_ladder(world: dict, lora_r: int) -> None:
    """distill -> race -> validate (recipes/qwen-distill.yaml's shape): the distill stage trains the served draft
    (where the int4 kernel is built, LoRA over the int4 copy's own weights, or its group pairs, on rows that int4
    copy wrote, and picks the form it serves in); the race ranks and races it beside the stock draft and its
    untrained int4 copy, each at its walked policy; validate times the ladder on test prompts with the trained rung
    last (the groups run passes over each domain's first test prompt: `skip_per_domain`), compares it with its
    untrained self in every repeat and measures both drafts' agreement on the test answers; draft.txt holds the
    trained spec and the untrained one; the learning curve and its fit are in distill.json."""
    root = world["root"]
    test = two_test_prompts(root, f"trained-{lora_r}")
    skip = 0 if lora_r else 1
    if skip:  # a second prompt a domain, the one timed
        with test.open("a") as f:
            f.writelines(json.dumps({"id": f"t{i}", "prompt": p, "domain": d}) + "\n" for i, (d, p) in
                         enumerate([("code", "sort the data list"), ("chat", "print a list for this code")], 2))
    target, base = root / "target", root / "other"
    int4 = bool(int4_chunk())
    draft = f"int4:{base}" if int4 else str(base)
    recipe = {
        "name": f"tiny-trained-{lora_r}", "target": str(target), "prompts": str(root / "prompts.jsonl"),
        "test_prompts": str(test), "stages": ["distill", "race", "validate"],
        "pair": {"candidates": [str(base)], "prompts_per_domain": 2, "max_new_tokens": 8, "draft_quant": None,
                 "calibrate_prompts": 0},
        "distill": {"draft": draft, "data": "draft", "onpolicy_quant": "int4" if int4 else None,
                    "max_new_tokens": 8, "eval_per_domain": 2,
                    "train": {"steps": 6, "batch_size": 2, "lr": 1e-2, "warmup_steps": 1, "eval_every": 2,
                              "save_every": 2, "lora_r": lora_r, "lora_alpha": 8}},
        "race": {"base": str(base), "top": 4, "timed_prompts": 1},
        "validate": {"prompts_per_domain": 1, "max_new_tokens": 8, "max_k": 3, "draft_quant": None,
                     "skip_per_domain": skip},
    }
    out = run_recipe_dict(world, recipe, root / "runs" / f"trained-{lora_r}")
    distilled = json.loads((out / "distill" / "distill.json").read_text())
    curve = distilled["curve"]
    assert [p["tokens"] for p in curve["points"]][0] == 0 and len(curve["points"]) == 4  # before, steps 2, 4, 6
    assert curve["fit"]["points"] == 3 and curve["tokens_seen"] == curve["points"][-1]["tokens"] > 0
    trained = distilled["served_spec"] if int4 else str(out / "distill" / "best")
    if int4:  # the adapter unmerged, or merged and re-quantised: the one that measured faster at equal agreement;
        # or the trained groups, as they are
        forms = {"unmerged", "merged"} if lora_r else {"groups"}
        assert set(distilled["served"]["forms"]) == forms and distilled["config"]["base_quant"] == "int4"
        assert trained == distilled["served"]["forms"][distilled["served"]["pick"]]["spec"]
    made = json.loads((out / "race" / "pick.json").read_text())
    assert made["trained"] == {trained: draft}
    assert (out / "draft.txt").read_text().splitlines() == [trained, draft]
    race = json.loads((out / "race" / "race.json").read_text())
    assert {trained, draft, str(base)} <= set(race["drafts"])  # the trained draft and its untrained self raced
    bench = json.loads((out / "validate" / "bench.json").read_text())
    assert all(bench["greedy_equal"].values()) and bench["prompts"] == (["t2", "t3"] if skip else ["t0", "t1"])
    rungs = bench["ladder"]["rungs"]
    last = rungs[-1]["name"]
    assert rungs[-1]["step"].startswith("trained") and [r["name"] for r in rungs][:2] == ["stock_plain", "draft_before"]
    untrained = next(r["name"] for r in rungs if bench["labels"][r["name"]] == bench["labels"][last].removesuffix(
        ", trained"))
    assert bench["versus"][last]["versus"] == untrained
    assert set(bench["versus"][last]["spread"]) == {"all", "code", "chat"}
    assert set(bench["agreement_on_test"]) == {last, untrained}
    assert bench["agreement_on_test"][last]["spec"] == trained
    assert set(bench["agreement_on_test"][last]["alpha_by_domain"]) == {"code", "chat"}
    report = (out / "report.md").read_text()
    assert "what differs: training" in report and "alpha against the tokens trained on" in report
    assert ("own group pairs" in report) == (int4 and not lora_r)  # what trained, said


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stage_process_asks_to_end_with_its_parent() -> None:
    """A validate stage runs in a spawned process; it asks the kernel for SIGTERM when the recipe process ends, so
    a killed run leaves no orphan timing decoders (one did, and slowed the next run's every stage 3x). The control:
    a process that does not ask reads 0."""
    code = ("import ctypes, signal, sys\n"
            "libc = ctypes.CDLL(None)\n"
            "if sys.argv[1] == 'ask':\n"
            "    from draftsmith.recipes.runner import _end_with_parent\n"
            "    _end_with_parent()\n"
            "sig = ctypes.c_int(-1)\n"
            "libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG\n"
            "print(sig.value)\n")
    got = {how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, check=True,
                               cwd=Path(__file__).resolve().parents[2]).stdout.strip()
           for how in ("ask", "no")}
    assert got == {"ask": str(int(signal.SIGTERM)), "no": "0"}
