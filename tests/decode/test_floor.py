"""The memory-floor benchmark and the row plan: floor/roof arithmetic and the padding choice against brute force;
a padded forward gives the unpadded logits (and leaves a cache the next forward continues exactly), speculative
decoding through padded runners stays greedy-equal; small models are never timed."""

from __future__ import annotations

import json
import random

import pytest
import torch

import draftsmith.decode.floor as fl
import draftsmith.decode.runtime.plan as pl
from draftsmith.decode.runtime.lean import LeanLM
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.runtime.settings import RuntimeSettings, using
from draftsmith.decode.speculative import KPolicy, generate
from tests import helpers


def tiny(seed: int, *, layers: int = 2, dtype=torch.float64):
    return helpers.tiny_llama(seed, 61, layers=layers, max_positions=512, dtype=dtype)


def test_floor_table_is_bytes_over_bandwidth_and_flops_over_peak() -> None:
    times = {1: 0.30, 2: 0.27, 9: 0.40}
    table = fl.floor_table(times, nbytes=6 * 10**9, params=1_500_000_000, bandwidth_gbs=40.0, peak_gflops=150.0)
    for T, row in table.items():
        floor, roof = 6e9 / 40e9, 2 * T * 1.5e9 / 150e9
        assert row["floor_s"] == pytest.approx(floor) and row["roof_s"] == pytest.approx(roof)
        assert row["bound_s"] == pytest.approx(max(floor, roof))
        assert row["over_bound"] == pytest.approx(times[T] / max(floor, roof))
        assert row["v"] == (None if T == 1 else pytest.approx(times[T] / times[1]))


def test_choose_rows_pads_to_the_fastest_count_at_or_above_and_ignores_noise() -> None:
    rng = random.Random(0)
    for _ in range(200):
        times = {T: rng.uniform(0.5, 1.5) for T in range(1, rng.randint(2, 12))}
        plan = pl.choose_rows(times, gain=0.9)
        for T, t in times.items():  # brute force: every candidate row count at or above T
            cands = [(times[r], r) for r in times if r >= T]
            best_t, best_r = min(cands)
            if best_r > T and best_t < 0.9 * t:
                assert plan[T] == best_r
            else:
                assert T not in plan
    assert pl.choose_rows({1: 1.0, 2: 0.97}) == {}  # 3% is noise, not a reason to pad
    assert pl.choose_rows({1: 1.0, 2: 1.2, 3: 0.8}) == {1: 3, 2: 3}


def test_choose_kernels_takes_blas_only_where_clearly_faster() -> None:
    rng = random.Random(1)
    for _ in range(200):
        dnn = {T: rng.uniform(0.5, 1.5) for T in range(1, 9)}
        blas = {T: rng.uniform(0.5, 1.5) for T in range(1, rng.randint(2, 9))}  # BLAS timed on some counts
        best, on_blas = pl.choose_kernels(dnn, blas, gain=0.9)
        for T, t in dnn.items():  # brute force
            faster = T in blas and blas[T] < 0.9 * t
            assert (T in on_blas) == faster and best[T] == (blas[T] if faster else t)
    assert pl.choose_kernels({1: 1.0}, {1: 0.97}) == ({1: 1.0}, frozenset())  # 3% is noise
    assert pl.choose_kernels({1: 1.0, 2: 1.0}, {}) == ({1: 1.0, 2: 1.0}, frozenset())  # no BLAS timing


def test_blas_rows_route_a_forward_through_blas_with_the_same_logits(monkeypatch) -> None:
    """A forward over a row count in `blas_rows` runs its Linears in BLAS (counted), not oneDNN, and gives the
    oneDNN forward's logits to float32 rounding; other row counts stay on oneDNN."""
    import draftsmith.decode.runtime.kernels as kn

    hf = tiny(6, dtype=torch.float32)
    if not kn.dnn_layout(hf.model.layers[0].mlp.up_proj.weight):
        pytest.skip("this torch build has no oneDNN")
    plain, routed = LeanLM(hf, 64), LeanLM(hf, 64)
    routed.blas_rows = frozenset({1, 3})
    calls = {"dnn": 0}
    real = kn._dnn_linear
    monkeypatch.setattr(kn, "_dnn_linear", lambda *a, **k: calls.__setitem__("dnn", calls["dnn"] + 1) or real(*a, **k))
    seq = torch.tensor([3, 9, 1, 4, 4, 7, 2, 8, 5, 6])
    for runner in (plain, routed):
        runner.forward(seq[:4], 0)  # 4 rows: oneDNN in both
    pos = 4
    for T in (1, 2, 3):
        before = calls["dnn"]
        want = plain.forward(seq[pos : pos + T], pos)
        on_plain = calls["dnn"] - before
        got = routed.forward(seq[pos : pos + T], pos)
        assert on_plain > 0 and (calls["dnn"] - before - on_plain == 0) == (T in routed.blas_rows)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        pos += T
    assert kn._BLAS == [False]  # the switch is back off after each forward


def test_native_rows_route_a_forward_through_the_native_kernel_with_close_logits(monkeypatch) -> None:
    """A forward over a row count in `native_rows` runs its float32 Linears (and the LM head) on `decode.runtime.native`'s
    kernel (counted), giving oneDNN's logits to float32 rounding; other row counts do not touch it; the plan also
    times it and lists the rows it wins in `native_rows` only (never in `blas_rows` too)."""
    from draftsmith.decode.runtime import native

    kernels = native.kernels()
    if kernels is None:
        pytest.skip(f"no native kernels here: {native.why_not()}")
    hf = tiny(6, dtype=torch.float32)
    plain, routed = LeanLM(hf, 64), LeanLM(hf, 64)
    routed.native_rows = frozenset({1, 2, 4})
    calls = [0]
    real = kernels.try_linear
    monkeypatch.setattr(kernels, "try_linear", lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or real(*a, **k))
    seq = torch.tensor([3, 9, 1, 4, 4, 7, 2, 8, 5, 6, 11, 12, 13, 14])
    for runner in (plain, routed):
        runner.forward(seq[:4], 0)
    pos = 4
    for T in (1, 2, 3, 4):
        want = plain.forward(seq[pos : pos + T], pos)
        before = calls[0]
        got = routed.forward(seq[pos : pos + T], pos)
        assert (calls[0] - before == 2 * 7 + 1) == (T in routed.native_rows)  # 7 Linears a layer, 2 layers, head
        assert (calls[0] == before) == (T not in routed.native_rows)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        pos += T
    runner = make_runner(tiny(7, dtype=torch.float32), 128)  # (not planned: a small model)
    monkeypatch.setattr(pl, "PLAN_MIN_BYTES", 0)
    monkeypatch.setattr(pl, "PLAN_ROWS", 3)
    real_times = pl.forward_times

    def native_wins(*a, **k):  # the native plan timed at a hundredth of what it took: it wins
        times = real_times(*a, **k)
        return {**times, "native": {T: t / 100 for T, t in times["native"].items()}}

    monkeypatch.setattr(pl, "forward_times", native_wins)
    pl.plan_rows(runner, ("native-test", 7), 1, repeats=1)
    assert runner.native_rows == frozenset({1, 2, 3}) and not runner.blas_rows & runner.native_rows


def test_a_padded_forward_gives_the_unpadded_logits_and_the_next_forward_continues_exactly() -> None:
    hf = tiny(0)
    plain, padded = LeanLM(hf, 64), LeanLM(hf, 64)
    padded.row_plan = {1: 4, 2: 5, 3: 4}
    padded.capture_layers = plain.capture_layers = (0, 1)
    seq = torch.tensor([3, 9, 1, 4, 4, 7, 2, 8, 5, 6, 11, 12, 13, 14])
    for runner in (plain, padded):
        runner.forward(seq[:4], 0)
    pos = 4
    for T in (1, 2, 3, 1):  # each forward continues after the previous one: the padded slots were overwritten
        a, b = plain.forward(seq[pos:pos + T], pos), padded.forward(seq[pos:pos + T], pos)
        assert b.shape == a.shape == (T, 61)
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
        assert padded.last_hidden.shape == plain.last_hidden.shape
        pos += T
    # negative control: the same comparison sees a forward that reads a slot a padded row wrote
    stale = LeanLM(hf, 64)
    stale.row_plan = {1: 4}
    stale.forward(seq[:4], 0)
    stale.forward(seq[4:5], 4)  # wrote slots 4..7; slot 5 holds a copy of token 4's row, not token 5's
    wrong = stale._forward(seq[6:7], 6, 0)  # position 6 attends to slot 5: stale
    right = plain.forward(seq[6:7], 6)
    assert not torch.allclose(wrong, right, rtol=1e-6, atol=1e-6)


def test_speculative_decoding_through_padded_runners_stays_greedy_equal() -> None:
    t_hf, d_hf = tiny(1, dtype=torch.float32), tiny(2, layers=1, dtype=torch.float32)
    ref = generate(make_runner(t_hf, 128), [1, 5, 7], max_new_tokens=30).tokens
    target, draft = make_runner(t_hf, 128), make_runner(d_hf, 128)
    target.row_plan = {T: 9 for T in range(1, 9)}
    draft.row_plan = {1: 3, 2: 3}
    assert generate(target, [1, 5, 7], max_new_tokens=30).tokens == ref
    for k in (1, 3, 6):
        assert generate(target, [1, 5, 7], draft=draft, max_new_tokens=30, policy=KPolicy(k=k)).tokens == ref
    target.row_plan, target.blas_rows = {}, frozenset({1, 2, 3})  # few-row forwards on BLAS, the rest on oneDNN
    draft.blas_rows = frozenset({1})
    for k in (1, 3, 6):
        assert generate(target, [1, 5, 7], draft=draft, max_new_tokens=30, policy=KPolicy(k=k)).tokens == ref
    target.blas_rows, target.native_rows = frozenset({3}), frozenset({1, 2, 4, 5, 6, 7})
    draft.native_rows = frozenset({1, 2})
    for k in (1, 3, 6):  # few-row forwards on the native kernel (where built), exact all the same
        assert generate(target, [1, 5, 7], draft=draft, max_new_tokens=30, policy=KPolicy(k=k)).tokens == ref


def test_small_models_are_never_timed_and_a_plan_is_timed_once_per_model(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))  # make_runner saves its plans in the cache
    monkeypatch.setattr(pl, "_PLANS", {})
    calls = []
    real = pl.forward_times
    monkeypatch.setattr(pl, "forward_times", lambda *a, **k: calls.append(1) or real(*a, **k))
    runner = make_runner(tiny(3, dtype=torch.float32), 128)
    assert runner.row_plan == {} and calls == []  # under PLAN_MIN_BYTES: nothing timed
    monkeypatch.setattr(pl, "PLAN_MIN_BYTES", 0)
    monkeypatch.setattr(pl, "PLAN_ROWS", 3)
    plan = pl.plan_rows(runner, ("test-model", 3), 1, repeats=1)
    assert calls == [1, 1] and all(plan[T] > T for T in plan) and runner.row_plan == plan  # one plan, two rounds
    assert runner.blas_rows <= {1, 2, 3}
    other = make_runner(tiny(3, dtype=torch.float32), 128)  # make_runner's own key: timed once more
    assert len(calls) == 4
    pl.plan_rows(other, ("test-model", 3), 1)  # the same key as before: no timing
    assert len(calls) == 4 and other.row_plan == plan and other.blas_rows == runner.blas_rows
    with using(RuntimeSettings(rows=False)):
        assert pl.plan_rows(make_runner(tiny(4, dtype=torch.float32), 128), ("x",), 1) == {}


def test_a_saved_plan_is_read_back_by_a_later_process_and_nothing_is_timed(monkeypatch, tmp_path) -> None:
    """The plan goes to a JSON file a person can read; a later process (here: the in-process plans forgotten)
    on the same machine and settings reads it and times nothing; other settings are another file; a damaged file
    is timed again and replaced."""
    monkeypatch.setattr(pl, "PLAN_MIN_BYTES", 0)
    monkeypatch.setattr(pl, "PLAN_ROWS", 3)
    monkeypatch.setattr(pl, "_PLANS", {})
    calls = []
    monkeypatch.setattr(pl, "forward_times", lambda runner, rows, **k: calls.append(1) or {
        name: {T: (0.5 if T == 3 else 1.0) for T in rows} for name in k["plans"]})
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))  # make_runner's own plan goes there
    runner = make_runner(tiny(3, dtype=torch.float32), 128)
    assert len(list((tmp_path / "cache" / "plans").glob("*.json"))) == 1
    calls.clear()
    key, tmp_path = ("saved-test", 3), tmp_path / "plans"
    assert pl.plan_rows(runner, key, 1, repeats=1, store=tmp_path) == {1: 3, 2: 3} and len(calls) == 2
    (saved,) = tmp_path.glob("*.json")
    record = json.loads(saved.read_text())
    assert record["row_plan"] == {"1": 3, "2": 3} and record["settings"]["rows"] is True
    monkeypatch.setattr(pl, "_PLANS", {})  # a new process
    assert pl.plan_rows(runner, key, 1, repeats=1, store=tmp_path) == {1: 3, 2: 3} and len(calls) == 2
    monkeypatch.setattr(pl, "_PLANS", {})
    with using(RuntimeSettings(linear="xw")):  # other settings: not that plan
        pl.plan_rows(runner, key, 1, repeats=1, store=tmp_path)
    assert len(calls) == 4 and len(list(tmp_path.glob("*.json"))) == 2
    monkeypatch.setattr(pl, "_PLANS", {})
    saved.write_text("{not json")
    assert pl.plan_rows(runner, key, 1, repeats=1, store=tmp_path) == {1: 3, 2: 3} and len(calls) == 6
    assert json.loads(saved.read_text())["row_plan"] == {"1": 3, "2": 3}


def test_the_plan_keeps_the_faster_of_two_rounds(monkeypatch) -> None:
    """A first round in which one row count runs slow (a process's first forwards can) does not decide the plan:
    each (plan, rows) keeps the faster of two rounds; the slow round alone would have padded 1 row to 3."""
    runner = make_runner(tiny(8, dtype=torch.float32), 128)  # a small model: not planned here
    rounds = [{"dnn": {1: 0.30, 2: 0.31, 3: 0.20}}, {"dnn": {1: 0.10, 2: 0.31, 3: 0.20}}]
    monkeypatch.setattr(pl, "forward_times", lambda *a, **k: rounds.pop(0))
    monkeypatch.setattr(pl, "PLAN_MIN_BYTES", 0)
    monkeypatch.setattr(pl, "PLAN_ROWS", 3)
    monkeypatch.setattr(pl.native, "kernels", lambda: None)
    assert pl.plan_rows(runner, ("two-rounds", 8), 1, repeats=1) == {2: 3}  # 1 row stays: 0.10 s, not 0.30
    assert rounds == []  # both rounds timed
    assert pl.choose_rows({1: 0.30, 2: 0.31, 3: 0.20}) == {1: 3, 2: 3}  # negative control: the first round alone


def test_forward_times_interleaves_plans_and_keeps_the_runners_own() -> None:
    runner = LeanLM(tiny(5), 128)
    runner.row_plan = {1: 2}
    times = pl.forward_times(runner, [1, 2, 3], repeats=2, warmup=0, plans={"a": {}, "b": {1: 3}})
    assert set(times) == {"a", "b"} and all(set(t) == {1, 2, 3} and min(t.values()) > 0 for t in times.values())
    assert runner.row_plan == {1: 2}


def test_floor_verb_prints_the_table_and_writes_the_record(tmp_path, capsys) -> None:
    from draftsmith.recipes.cli import main

    tok = helpers.word_tokenizer([f"w{i}" for i in range(40)], eos="</s>")
    folder = helpers.save_tiny(tmp_path / "m", tok, 0)
    assert main(["floor", "--target", str(folder), "--rows", "3", "--repeats", "1", "--out", str(tmp_path / "f.json")]) == 0
    out = capsys.readouterr().out
    assert "floor ms" in out and "one_row_over_floor" in out
    rec = json.loads((tmp_path / "f.json").read_text())
    assert set(rec["rows"]) == {"1", "2", "3"} and rec["bandwidth_gbs"]["best"] > 0 and rec["peak_gflops"] > 0
    assert rec["machine"]["cpu_count"] and rec["versions"]["torch"]
    assert set(rec["compare"]) == {"unpadded"}
    assert (tmp_path / "f.png").read_bytes().startswith(b"\x89PNG")


def test_floor_from_a_record_prints_its_table_and_draws_it_again_timing_nothing(tmp_path, capsys, monkeypatch) -> None:
    import draftsmith.decode.floor
    from draftsmith.recipes.cli import main

    tok = helpers.word_tokenizer([f"w{i}" for i in range(40)], eos="</s>")
    folder = helpers.save_tiny(tmp_path / "m", tok, 0)
    assert main(["floor", "--target", str(folder), "--rows", "3", "--repeats", "1", "--out", str(tmp_path / "f.json")]) == 0
    first = capsys.readouterr().out.splitlines()
    (tmp_path / "f.png").unlink()

    def no_timing(*a, **k):
        raise AssertionError("--from times nothing")

    monkeypatch.setattr(draftsmith.decode.floor, "floor_report", no_timing)
    assert main(["floor", "--from", str(tmp_path / "f.json")]) == 0
    again = capsys.readouterr().out.splitlines()
    assert again[:-1] == first[:-2]  # the same table and goals; then only the plot is written
    assert again[-1] == f"wrote {tmp_path / 'f.png'}" and (tmp_path / "f.png").read_bytes().startswith(b"\x89PNG")

    (tmp_path / "other.json").write_text(json.dumps({"rows": {}}))
    assert main(["floor", "--from", str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err
    assert "not a floor record" in err and len(err.strip().splitlines()) == 1


def test_our_kernel_runs_a_row_count_only_where_it_beats_the_library_by_over_10_percent() -> None:
    """docs/results/kernels.md's rule, applied per machine by the row plan: a library op within 10% of ours runs."""
    assert pl.NATIVE_GAIN == 0.90
    library = {1: 1.00, 2: 1.00, 3: 1.00}
    ours = {1: 0.92, 2: 0.88, 3: 1.05}  # 8% faster: the library's; 12% faster: ours; slower: the library's
    assert pl.choose_kernels(library, ours, gain=pl.NATIVE_GAIN) == ({1: 1.00, 2: 0.88, 3: 1.00}, frozenset({2}))
