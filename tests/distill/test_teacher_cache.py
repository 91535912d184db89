"""The teacher's top-k cache: at k = V training on it gives the online loss for every divergence, a small k
still trains, the cached numbers are the target's, and a cache for other data, another k or another target
is rebuilt (an interrupted build resumes), never reused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

import draftsmith.distill.teacher_cache as tc
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.distill.teacher_cache import build_teacher_cache
from draftsmith.distill.train import TrainConfig, train
from tests.distill.test_data import EOS, tiny_loaded

V = EOS + 1


def _rows(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 9, (n, 2), generator=g).tolist()
    return [(torch.randint(0, EOS, (p,), generator=g).tolist(), torch.randint(0, V, (c,), generator=g).tolist())
            for p, c in sizes]


def _data(rows) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt_ids": [p for p, _ in rows], "continuation_ids": [c for _, c in rows]})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return tiny_loaded(0, root / "target", layers=2), tiny_loaded(1, root / "draft", layers=1)


class Shards:
    """Counts the shards computed; raises once `fail_after` have been."""

    def __init__(self) -> None:
        self.n, self.fail_after = 0, None

    def __call__(self, *args, **kwargs):
        if self.fail_after is not None and self.n >= self.fail_after:
            raise KeyboardInterrupt
        self.n += 1
        return real_shard(*args, **kwargs)


real_shard = tc._shard


@pytest.fixture
def shards(monkeypatch) -> Shards:
    counter = Shards()
    monkeypatch.setattr(tc, "_shard", counter)
    return counter


def _log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


FAST = dict(warmup_steps=0, batch_size=3, grad_accum=2, steps=2, lr=1e-2, temperature=1.5, save_every=100,
            eval_every=100, seed=0)


@pytest.mark.parametrize("loss", ["fkl", "rkl", "jsd", "tvd"])
def test_cache_at_full_vocab_gives_the_online_loss(pair, tmp_path, loss) -> None:
    target, draft = pair
    data = _data(_rows(10))
    runs = {}
    for teacher in ("online", "cache"):
        cfg = TrainConfig(**FAST, loss=loss, teacher=teacher, teacher_topk=V)
        summary = train(target, draft, data, None, tmp_path / teacher, cfg, progress=False)
        weights = load_file(str(tmp_path / teacher / "checkpoints" / "step-2" / "student.safetensors"))
        runs[teacher] = (_log(tmp_path / teacher), weights, summary)
    (online, w_on, _), (cached, w_ca, summary) = runs["online"], runs["cache"]
    assert Path(summary["paths"]["teacher_cache"]).parent == tmp_path / "cache" / "teacher-topk"
    for a, b in zip(online, cached):
        assert a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-7)
    for k in w_on:  # two steps later the students agree (to 1e-3 of a step: Adam's g / sqrt(v) magnifies rounding)
        torch.testing.assert_close(w_ca[k], w_on[k], rtol=1e-3, atol=1e-5)


def test_small_k_trains_with_a_finite_loss(pair, tmp_path) -> None:
    target, draft = pair
    data = _data(_rows(10))
    root = tmp_path / "cache"
    for loss in ("fkl", "rkl", "jsd", "tvd"):
        cfg = TrainConfig(**FAST, loss=loss, teacher="cache", teacher_topk=4, teacher_cache_dtype="float16")
        summary = train(target, draft, data, None, tmp_path / loss, cfg, progress=False, teacher_cache_dir=root)
        assert summary["skipped_steps"] == 0
        assert all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in _log(tmp_path / loss))
    assert len(list(root.iterdir())) == 1  # one cache served all four losses


def assert_each_row_alone(cache, target, rows, k: int) -> None:
    """Every row's cached top-k is the target's on that row alone, unpadded: the positions predicting its
    continuation (values to float tolerance, ids exactly)."""
    for i, (p, c) in enumerate(rows):
        with torch.no_grad():
            logits = target.model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) + len(c) - 1]
        want = torch.topk(torch.log_softmax(logits, -1), k, dim=-1)
        values, indices = cache.row(i)
        torch.testing.assert_close(values, want.values, rtol=0, atol=1e-5)
        assert torch.equal(indices.long(), want.indices)


def test_cached_values_are_the_targets_top_k(pair, tmp_path) -> None:
    target, _ = pair
    rows = _rows(7)
    cache = build_teacher_cache(target, rows, tmp_path, k=5, batch_size=3, progress=False)
    assert len(cache) == 7 and cache.k == 5
    assert_each_row_alone(cache, target, rows, 5)
    mask = torch.tensor([[False, True, True, False], [True, False, False, False]])
    rows2 = [([1], [2, 3]), ([4], [5])]
    small = build_teacher_cache(target, rows2, tmp_path / "b", k=V + 10, progress=False)  # k capped at V
    logits = small.logits([0, 1], mask)
    assert small.k == V and logits.shape == (2, 4, V) and torch.isfinite(logits[mask]).all()
    with pytest.raises(DraftsmithError, match="does not match"):
        small.logits([0, 0], mask)


def test_answers_to_one_prompt_are_scored_over_one_shared_prefill(pair, tmp_path, monkeypatch) -> None:
    """Rows answering the same prompt (samples_per_prompt) are scored over one prefill of it, its KV cache
    repeated: the cache equals each row scored alone (values to float tolerance, ids exactly), continuations of
    different lengths, one of length 1, beside rows with prompts of their own. The control: the shared path ran
    (one prompt prefill for the group of 4, chunked by batch_size 3 into 3 + 1)."""
    target, _ = pair
    a, b = [3, 9, 4, 7, 2], [5, 6]
    rows = [(a, [8, 1, 4, 4]), (b, [2, 3, 9]), (a, [8]), (a, [6, 5, 7, 1, 2, 3]), (b, [7, 7]), ([1, 2, 3], [4, 5]),
            (a, [2, 2])]
    calls = []
    real = tc._shared_prompt_logits
    monkeypatch.setattr(tc, "_shared_prompt_logits", lambda m, r, idx, d: calls.append(list(idx)) or real(m, r, idx, d))
    cache = build_teacher_cache(target, rows, tmp_path, k=6, batch_size=3, progress=False)
    assert sorted(map(sorted, calls)) == [[0, 2, 3], [1, 4], [6]]
    assert_each_row_alone(cache, target, rows, 6)


def test_stale_cache_is_rebuilt_and_an_interrupted_build_resumes(pair, tmp_path, shards, monkeypatch) -> None:
    target, draft = pair
    monkeypatch.setattr(tc, "ROWS_PER_SHARD", 3)
    rows = _rows(8)  # 3 shards
    first = build_teacher_cache(target, rows, tmp_path, k=4, progress=False)
    assert shards.n == 3 and (first.folder / tc.DONE).is_file()
    shards.n = 0
    again = build_teacher_cache(target, rows, tmp_path, k=4, progress=False)
    assert shards.n == 0 and again.folder == first.folder  # complete: loaded, not recomputed

    changed = {
        "k": (target, rows, 6),
        "data": (target, rows[:-1] + [(rows[-1][0], rows[-1][1] + [1])], 4),
        "target": (draft, rows, 4),
    }
    folders = {first.folder}
    for why, (model, r, k) in changed.items():
        shards.n = 0
        cache = build_teacher_cache(model, r, tmp_path, k=k, progress=False)
        assert shards.n == 3, why  # rebuilt
        assert cache.folder not in folders and [p for p in tmp_path.iterdir()] == [cache.folder]  # stale removed
        folders.add(cache.folder)

    # same folder identity (path, config) but other weights: still another key
    other = tiny_loaded(5, target.path, layers=2)
    assert tc.cache_key(tc.cache_settings(other, rows, 4, "float32")) != \
        tc.cache_key(tc.cache_settings(target, rows, 4, "float32"))

    shards.n, shards.fail_after = 0, 2
    with pytest.raises(KeyboardInterrupt):
        build_teacher_cache(target, rows, tmp_path / "r", k=4, progress=False)
    shards.n, shards.fail_after = 0, None
    resumed = build_teacher_cache(target, rows, tmp_path / "r", k=4, progress=False)
    assert shards.n == 1  # only the missing shard
    whole = build_teacher_cache(target, rows, tmp_path / "w", k=4, progress=False)
    assert torch.equal(resumed.values, whole.values) and torch.equal(resumed.indices, whole.indices)


def test_default_place_is_next_to_the_data(pair, tmp_path) -> None:
    import draftsmith.distill.train as train_mod

    rows = _rows(3)
    folder = tmp_path / "data"
    _data(rows).save_to_disk(str(folder / "dataset"))
    on_disk = datasets.load_from_disk(str(folder / "dataset"))
    assert train_mod._teacher_cache_root(on_disk, tmp_path / "run") == tmp_path / "run" / "teacher-topk"
    (folder / "settings.json").write_text("{}")  # a distill.data folder
    assert train_mod._teacher_cache_root(on_disk, tmp_path / "run") == folder / "teacher-topk"
    assert train_mod._teacher_cache_root(_data(rows), tmp_path / "run") == tmp_path / "run" / "teacher-topk"
    for bad, field in (({"teacher": "offline"}, "teacher"), ({"teacher_topk": 0}, "teacher_topk"),
                       ({"teacher_cache_dtype": "int8"}, "teacher_cache_dtype")):
        with pytest.raises(DraftsmithError, match=rf"TrainConfig\.{field}\b"):
            TrainConfig(**bad)


def test_top_k_kept_while_generating_is_the_cache_training_finds(pair, tmp_path, shards) -> None:
    """gen-data with topk: the target's top-k of every row it decodes in a batch is kept as it decodes; written as
    the cache, it sits where build_teacher_cache looks (nothing left to compute) and equals the teacher-forced one."""
    from draftsmith.distill.data import captured_topk, generate_data, training_rows
    from draftsmith.distill.teacher_cache import write_teacher_cache
    from tests.distill.test_data import make_prompts

    target, draft = pair
    prompts = make_prompts(7)
    ds = generate_data(target, draft, prompts, tmp_path / "data", max_new_tokens=6, temperature=1.0, batch_size=3,
                       topk=5, progress=False)
    rows = training_rows(ds)
    values, indices = captured_topk(tmp_path / "data", len(ds))
    assert [len(v) for v in values] == [len(c) for _, c in rows] and values[0].shape[-1] == 5
    kept = write_teacher_cache(target, rows, tmp_path / "kept", values, indices)
    found = build_teacher_cache(target, rows, tmp_path / "kept", k=5, progress=False)
    assert shards.n == 0 and found.folder == kept.folder  # complete: nothing computed
    forced = build_teacher_cache(target, rows, tmp_path / "forced", k=5, progress=False)
    assert shards.n >= 1 and forced.folder.name == kept.folder.name  # the same key
    assert torch.equal(found.indices, forced.indices)
    torch.testing.assert_close(found.values, forced.values, rtol=1e-5, atol=1e-5)
    # rows some other model decoded (on-policy draft rows) have no top-k: then none is returned
    ds2 = generate_data(target, draft, prompts, tmp_path / "mixed", source="mixed", mix=0.5, max_new_tokens=6,
                        temperature=1.0, batch_size=3, topk=5, progress=False)
    assert captured_topk(tmp_path / "mixed", len(ds2)) is None


def test_on_policy_rows_top_k_is_the_targets_own(pair, tmp_path, capsys) -> None:
    """The on-policy path: the draft's int4 copy writes the rows (where draftsmith's int4 kernel runs; the draft as
    loaded elsewhere), the target scores them by a batched prefill into the compact cache (float16 values, int32
    ids). Each row's top-k is the target's own, computed for that row alone in float64: values to float16's
    rounding, ids exactly wherever the log-probs around them are not tied. The bar shows tokens/s."""
    import copy

    from draftsmith.decode.runtime.quant import int4_ok
    from draftsmith.distill.data import generate_data, training_rows
    from tests.distill.test_data import make_prompts

    target, draft = pair
    ds = generate_data(target, draft, make_prompts(9), tmp_path / "data", source="draft", max_new_tokens=10,
                       temperature=1.0, seed=1, batch_size=4, draft_quant="int4" if int4_ok() else None,
                       progress=False)
    rows = training_rows(ds)
    assert len({len(p) + len(c) for p, c in rows}) > 2  # rows of several lengths: batches padded and reordered
    k = 6
    cache = build_teacher_cache(target, rows, tmp_path / "cache", k=k, dtype="float16", batch_size=4)
    assert "tokens/s" in capsys.readouterr().err
    assert cache.values.dtype == torch.float16 and cache.indices.dtype == torch.int32
    exact = copy.deepcopy(target.model).double()
    clear = 0
    for i, (p, c) in enumerate(rows):
        with torch.no_grad():
            logits = exact(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) + len(c) - 1]
        want = torch.topk(torch.log_softmax(logits, -1), k + 1, dim=-1)  # one more: a tie at the k-th place
        values, indices = cache.row(i)
        torch.testing.assert_close(values.double(), want.values[:, :k], rtol=1e-3, atol=2e-3)
        untied = (want.values[:, :-1] - want.values[:, 1:]).min(-1).values > 1e-4  # (C,) positions with no near-tie
        assert torch.equal(indices[untied].long(), want.indices[untied, :k])
        clear += int(untied.sum())
    assert clear >= 0.9 * sum(len(c) for _, c in rows)
