"""Two CPU processes under `accelerate launch` train like one process with the same global batch.

This file is also the script both processes run (`python -m tests.distill.test_multiprocess FOLDER`): it
trains with the online teacher and with a teacher cache built by both ranks. The test compares each
step's loss, token count and gradient norm, the evaluations and the final weights with a one-process run.
They agree up to float rounding, not bit for bit: each rank sums its share of the tokens and DDP adds the
two gradients, an order of additions one process does not use.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# per-process micro-batch: 2 processes x 2 rows here = 4 rows in the one-process run
CONFIG = dict(loss="fkl", steps=3, batch_size=2, grad_accum=2, lr=1e-2, warmup_steps=0, eval_every=2, save_every=2,
              seed=0, teacher_topk=64)


def run(folder: Path, name: str, teacher: str, batch_size: int) -> dict:
    """One training run on the models and data in `folder` (what each launched process does, and the reference)."""
    from draftsmith.decode.runtime.loading import load
    from draftsmith.distill.train import TrainConfig, train

    target, draft = load(folder / "target"), load(folder / "draft")
    data = datasets.load_from_disk(str(folder / "data"))
    refs = datasets.load_from_disk(str(folder / "refs"))
    cfg = TrainConfig(**{**CONFIG, "teacher": teacher, "batch_size": batch_size})
    return train(target, draft, data, refs, folder / name, cfg, progress=False,
                 teacher_cache_dir=folder / f"{name}-cache")


def main(folder: str) -> None:
    import draftsmith.distill.teacher_cache as tc
    from accelerate import PartialState

    torch.set_num_threads(1)
    tc.ROWS_PER_SHARD = 2  # several shards, so both ranks build some
    folder = Path(folder)
    for teacher in ("online", "cache"):
        summary = run(folder, f"two-{teacher}", teacher, CONFIG["batch_size"])
        state = PartialState()
        assert state.num_processes == 2, "launched as one process"
        (folder / f"two-{teacher}.rank{state.process_index}.json").write_text(json.dumps(summary))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_folders(folder: Path) -> None:
    """Target and draft saved as HF folders (each process loads them), training data and held-out references."""
    from draftsmith.decode.runtime.loading import load
    from draftsmith.decode.prompts import Prompt
    from draftsmith.pairing.reference import reference_continuations
    from tests import helpers

    words = [f"w{i}" for i in range(40)]
    eos = len(words)
    tok = helpers.word_tokenizer([*words, "<eos>", "[UNK]"], eos="<eos>")
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        helpers.tiny_llama(seed, eos + 1, eos_id=eos, layers=layers).save_pretrained(folder / name)
        tok.save_pretrained(folder / name)
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 9, (13, 2), generator=g).tolist()  # 13 rows: the epochs do not align with batches
    rows = {"prompt_ids": [torch.randint(0, eos, (p,), generator=g).tolist() for p, _ in sizes],
            "continuation_ids": [torch.randint(0, eos + 1, (c,), generator=g).tolist() for _, c in sizes]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(folder / "data"))
    prompts = [Prompt(str(i), ("code", "chat")[i % 2], " ".join(words[3 * i : 3 * i + 1 + i % 3])) for i in range(4)]
    refs = reference_continuations(load(folder / "target"), prompts, max_new_tokens=8, cache_root=folder / "ref-cache",
                                   progress=False)
    refs.save_to_disk(str(folder / "refs"))


def _log(out: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    return [x for x in lines if "eval" not in x], [x for x in lines if "eval" in x]


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(tmp_path) -> None:
    from safetensors.torch import load_file

    _tiny_folders(tmp_path)
    # `accelerate launch --cpu --num_processes 2` starts ONE process unless given an mpirun hostfile; the
    # torchrun launcher (--multi_gpu) with ACCELERATE_USE_CPU=1 starts two CPU processes joined by gloo.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "",
           "HF_HOME": str(tmp_path / "hf-home"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m", "tests.distill.test_multiprocess", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]

    one = run(tmp_path, "one", "online", 2 * CONFIG["batch_size"])  # the same global batch in one process
    steps1, evals1 = _log(tmp_path / "one")
    w1 = load_file(str(tmp_path / "one" / "checkpoints" / "step-3" / "student.safetensors"))
    for teacher in ("online", "cache"):
        out = tmp_path / f"two-{teacher}"
        ranks = [json.loads((tmp_path / f"two-{teacher}.rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0] == ranks[1]  # every rank ends with the same summary (evaluations included)
        assert ranks[0]["alpha_after"] == one["alpha_after"] and ranks[0]["best_step"] == one["best_step"]
        steps2, evals2 = _log(out)  # rank 0 alone wrote the log: one line per step and per evaluation
        assert [x["step"] for x in steps2] == [1, 2, 3] and [x["step"] for x in evals2] == [0, 2, 3]
        for a, b in zip(steps1, steps2):
            assert a["tokens"] == b["tokens"]  # the global count, summed over both ranks
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert [e["alpha"] for e in evals2] == [e["alpha"] for e in evals1]
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3"]
        w2 = load_file(str(out / "checkpoints" / "step-3" / "student.safetensors"))
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], rtol=1e-3, atol=1e-5)
        assert (out / "best" / "config.json").is_file() and (out / "summary.json").is_file()
    shards = sorted(p.name for p in next((tmp_path / "two-cache-cache").iterdir()).glob("shard-*"))
    assert len(shards) == 7  # 13 rows, 2 per shard, built by both ranks


if __name__ == "__main__":
    main(sys.argv[1])
