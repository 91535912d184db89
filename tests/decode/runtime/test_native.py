"""`decode.runtime.native`: draftsmith's own few-row kernels (int8 rows with per-row scales, float32) against float64
brute force, the int8 draft's route onto them, and the fall-back when they cannot be built."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from draftsmith.decode.runtime import native, settings
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.settings import RuntimeSettings
from draftsmith.decode.runtime.kernels import linear, native_kernels
from draftsmith.decode.runtime.quant import quantize_int8, quantize_linears_int8
from draftsmith.decode.runtime.runner import make_runner
from tests import helpers

KERNELS = native.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=f"no native kernels here: {native.why_not()}")


def int8_layer(seed: int, n: int, k: int, bias: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return quantize_linears_int8(nn.Sequential(nn.Linear(k, n, bias=bias)))[0]


def exact(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The int8 Linear in float64: x @ (scale * int8 rows)^T + bias, no activation quantisation."""
    w = layer.weight()
    rows = w.int_repr().double() * w.q_per_channel_scales().double()[:, None]
    out = x.double() @ rows.t()
    return out if layer.bias() is None else out + layer.bias().double()


@needs_kernels
@pytest.mark.parametrize("n,k,bias", [(8, 64, True), (37, 128, False), (1000, 896, True), (3, 32, True)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 12, 13, 30])
def test_kernels_match_brute_force(n: int, k: int, bias: bool, rows: int) -> None:
    """Both kernels against float64 brute force, over row counts with a tail past the last block of 8 and past one
    pass of 12 rows (a prefill); the int8 one within float32 rounding where fbgemm (which quantises the activations
    too) is not."""
    layer = int8_layer(n + k, n, k, bias)
    x = torch.randn(rows, k)
    want = exact(layer, x)
    with native_kernels():
        got = linear(x, layer).double()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-5 * scale * k**0.5
    assert (layer(x).double() - want).abs().max().item() > 1e-3 * scale  # fbgemm's answer: not what ran above
    w, b = torch.randn(n, k), torch.randn(n) if bias else None
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert (KERNELS.linear(x, w, None, b).double() - want).abs().max().item() < 1e-5 * want.abs().max().item() * k**0.5


@needs_kernels
@pytest.mark.parametrize("rows", [*range(2, native.MAX_ROWS + 1), 13, 25, 40])
def test_rows_of_a_call_are_the_bits_of_single_rows(rows: int) -> None:
    """A T-row call computes each row as a 1-row call does (the same order of sums, whatever block of output rows
    T's kernel takes, and past 12 rows whichever 12 it falls among), and a row's output does not depend on where it
    falls in a block: stacking layers' rows (`fuse_projections`) keeps its bits."""
    layer = int8_layer(rows, 45, 64)
    x = torch.randn(rows, 64)
    w = torch.randn(45, 64)
    with native_kernels():
        many, wide = linear(x, layer), KERNELS.linear(x, w)
        for t in range(rows):
            assert torch.equal(many[t], linear(x[t:t + 1], layer)[0])
            assert torch.equal(wide[t], KERNELS.linear(x[t:t + 1], w)[0])
    assert torch.equal(KERNELS.linear(x[:1], w)[0, 5:], KERNELS.linear(x[:1], w[5:].contiguous())[0])


@needs_kernels
def test_outside_the_switch_runs_fbgemm_and_a_new_weight_is_read_again() -> None:
    layer = int8_layer(2, 24, 64)
    x = torch.randn(native.MAX_ROWS + 1, 64)
    assert torch.equal(linear(x[:1], layer), layer(x[:1]))  # outside native_kernels(): fbgemm's kernel
    assert torch.equal(linear(x, layer), layer(x))
    with native_kernels():
        many = linear(x, layer)  # MAX_ROWS + 1 rows: the native kernel too, not fbgemm's
        assert not torch.equal(many, layer(x)) and (many.double() - exact(layer, x)).abs().max() < 1e-4
        before = linear(x[:1], layer)
        w = layer.weight()
        layer.set_weight_bias(torch._make_per_channel_quantized_tensor(
            -w.int_repr(), w.q_per_channel_scales(), w.q_per_channel_zero_points(), 0), layer.bias())
        after = linear(x[:1], layer)
    assert (after.double() - exact(layer, x[:1])).abs().max() < 1e-4 and not torch.allclose(after, before)


@needs_kernels
def test_int8_draft_runner_steps_on_the_native_kernel() -> None:
    """A one-row step of an int8 lean runner over a row count in its `native_rows` gives the logits of the same
    step on fbgemm to within int8 activation rounding, not bit for bit: the native path ran."""
    model = helpers.tiny_llama(3, 300, layers=2, hidden=64, heads=4, kv_heads=2, arch="qwen2")
    runner = quantize_int8(make_runner(model, 64))
    ids = torch.arange(12) * 7 % 300
    runner.forward(ids[:10], 0)
    off = runner.forward(ids[10:11], 10)  # a small model gets no plan: fbgemm
    runner.native_rows = frozenset({1, 2})  # what the plan gives where the kernel is faster
    on = runner.forward(ids[10:11], 10)
    assert not torch.equal(on, off) and (on - off).abs().max() < 0.1 * off.abs().max()
    with pytest.raises(AssertionError):  # negative control: the kernel is what changed the bits
        runner.native_rows = frozenset()
        assert not torch.equal(runner.forward(ids[10:11], 10), off)


@needs_kernels
def test_int8_draft_prefills_on_the_native_kernel() -> None:
    """An int8 lean runner's forward over more than 12 rows (a prompt's prefill) runs the native kernel
    (`native_many`: no activation quantisation, each row as a one-row call would), not fbgemm's, whose one scale
    for the whole prompt's inputs cost the Qwen 0.5B drafts agreement with their target; off, fbgemm's again."""
    model = helpers.tiny_llama(3, 300, layers=2, hidden=64, heads=4, kv_heads=2, arch="qwen2")
    runner = quantize_int8(make_runner(model, 64))
    assert runner.native_many
    ids = torch.arange(20) * 7 % 300
    on = runner.forward(ids, 0)
    runner.native_rows = frozenset(range(1, native.MAX_ROWS + 1))
    steps = torch.cat([runner.forward(ids[:12], 0), runner.forward(ids[12:], 12)])  # 12 and 8 rows, native
    near = (on - steps).abs().max()  # the same Linears' bits; attention over 20 rows or 12 + 8 rounds apart
    assert near < 1e-4 * on.abs().max()
    runner.native_many = False
    off = runner.forward(ids, 0)
    assert 10 * near < (on - off).abs().max() < 0.1 * off.abs().max()  # fbgemm's inputs on one scale: further


@pytest.mark.parametrize("env,why", [({"native": False}, "DRAFTSMITH_NATIVE=off"),
                                     ({"compiler": "/nonexistent/g++"}, "no compiler: CXX=/nonexistent/g++ is not found")])
def test_no_kernels_means_the_library_ones(monkeypatch, tmp_path, env: dict, why: str) -> None:
    """Kernels turned off, or a compiler that is not there: `kernels()` is None with the reason, and an int8 Linear
    runs fbgemm's kernel on one row (the other faults: test_native_fallback.py)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    monkeypatch.setattr(settings, "_CURRENT", [RuntimeSettings(**env)])  # as the CLI maps DRAFTSMITH_NATIVE / CXX
    native.kernels.cache_clear()
    try:
        assert native.kernels() is None and native.why_not() == why
        layer = int8_layer(4, 16, 64)
        x = torch.randn(1, 64)
        with native_kernels():
            assert torch.equal(linear(x, layer), layer(x))
    finally:
        monkeypatch.undo()
        native.kernels.cache_clear()
    assert (native.kernels() is None) == (KERNELS is None)


@needs_kernels
def test_bad_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="float32 rows"):
        KERNELS.linear(torch.randn(0, 64), torch.randn(8, 64))
    with pytest.raises(ValueError, match="float32 rows"):
        KERNELS.linear(torch.randn(3, 64, dtype=torch.float64), torch.randn(8, 64))
    with pytest.raises(ValueError, match="K %"):
        KERNELS.linear(torch.randn(1, 60), torch.randn(8, 60))
    with pytest.raises(ValueError, match="scale must be"):
        KERNELS.linear(torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(7))


@pytest.mark.skipif(KERNELS is None or not KERNELS.q4_chunk, reason="no int4 kernel here")
def test_the_int4_prefetch_distance_is_timed_once_saved_and_never_changes_a_bit(monkeypatch, tmp_path) -> None:
    """`tune_q4_ahead`: a choice among `Q4_AHEAD_CHOICES` saved beside the library and read back (a damaged file is
    timed again), the settings' q4_ahead fixes it (a bad value is refused); the kernel's output is the same bits at
    every distance (prefetching moves no result)."""
    from draftsmith.decode.runtime.quant import pack_int4

    k, before = KERNELS, KERNELS.q4_ahead()
    try:
        assert k.q4_ahead(2048) == 2048 and k.q4_ahead() == 2048 and k.q4_ahead(1 << 21) == 2048  # out of range: kept
        torch.manual_seed(0)
        packed, sm = pack_int4(torch.randn(200, 256))
        x = torch.randn(3, 256)
        outs = []
        for b in (0, 64, 1024, 8192):
            k.q4_ahead(b)
            outs.append(k.q4_linear(x, packed, sm, n=200))
        assert all(torch.equal(outs[0], o) for o in outs[1:])

        monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
        monkeypatch.setattr(settings, "_CURRENT", [RuntimeSettings()])
        tune = native.tune_q4_ahead.__wrapped__
        chosen = tune()
        [saved] = (tmp_path / "native").glob("q4-ahead-*.json")
        record = json.loads(saved.read_text())
        assert chosen == record["ahead"] == k.q4_ahead() and chosen in native.Q4_AHEAD_CHOICES
        assert set(record["median_seconds"]) == {str(b) for b in native.Q4_AHEAD_CHOICES}
        saved.write_text(json.dumps({**record, "ahead": 4096}))
        assert tune() == 4096 == k.q4_ahead()  # read back, not timed again
        saved.write_text("{")
        assert tune() in native.Q4_AHEAD_CHOICES and json.loads(saved.read_text())["ahead"] in native.Q4_AHEAD_CHOICES
        monkeypatch.setattr(settings, "_CURRENT", [RuntimeSettings(q4_ahead=512)])  # DRAFTSMITH_Q4_AHEAD=512
        assert tune() == 512 == k.q4_ahead()
        with pytest.raises(DraftsmithError, match="q4_ahead must be a byte count"):
            RuntimeSettings(q4_ahead=1 << 21)
    finally:
        k.q4_ahead(before)
