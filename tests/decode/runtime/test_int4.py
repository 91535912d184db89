"""Int4 drafts (`decode.runtime.quant.pack_int4`, `Int4Linear`, `decode.runtime.native`'s int4 kernel): the packing against float64
brute force, the kernel against a float64 reference of what it computes (int8 inputs, int4 groups), a row's bits
independent of the rows beside it, and the decoder exact with an int4 draft (greedy, pruned or whole)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from draftsmith.decode.pruned import PrunedRunner
from draftsmith.decode.runtime.quant import (GROUP, Int4Linear, deinterleave_int4, draft_quant, int4_chunk, int4_ok, pack_int4,
                          quantize_groups, unpack_int4)
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.spec import DraftSpec
from draftsmith.decode.speculative import KPolicy, generate
from tests import helpers

CHUNK = int4_chunk()
needs_int4 = pytest.mark.skipif(not CHUNK, reason="no int4 kernel on this CPU (AVX-512BW or AVX2)")


def brute(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group of 32 of a row in float64: scale (max - min) / 15 and min, each rounded to float16 as stored;
    q = round((w - min) / scale) in 0..15, back as q * scale + min -> (that weight, where (w - min) / scale is
    within 1e-4 of a rounding tie: float32 may round those the other way)."""
    N, K = weight.shape
    w = weight.double().reshape(N, K // GROUP, GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    s, lo = ((hi - lo) / 15).half().double(), lo.half().double()
    u = (w - lo) / s
    tie = ((u - u.floor() - 0.5).abs() < 1e-4).reshape(N, K)
    return (u.round().clamp(0, 15) * s + lo).reshape(N, K), tie


def reference(x: torch.Tensor, wq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float64: each row of x as int8 (scale max |x| / 127, rounded half to even)
    against the int4 weight as it stands."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(x * (127 / torch.where(amax > 0, amax, torch.ones_like(amax)))).clamp(-127, 127)
    out = (xq @ wq.double().t()) * s
    return out if bias is None else out + bias.double()


@needs_int4
@pytest.mark.parametrize("n,k", [(37, 1 * 128), (300, 896), (9, 4 * 128), (16, 32), (5, 576)])
def test_packing_matches_brute_force(n: int, k: int) -> None:
    torch.manual_seed(n)
    w = torch.randn(n, k) * torch.rand(n, 1)
    packed, sm = pack_int4(w, refine=0)  # each group's pair from its min and max alone
    rows = -(-n // 16) * 16  # padded to the kernel's blocks of 16 rows
    assert packed.shape == (rows, k // 2) and sm.shape == (rows, k // GROUP, 2)
    back = unpack_int4(packed, sm, n).double()
    want, tie = brute(w)
    off = (back - want).abs() > 1e-5
    assert bool((off <= tie).all()) and int(off.sum()) <= 0.001 * off.numel()  # only at rounding ties
    pairs = deinterleave_int4(packed, sm, n)[1]  # (n, K / GROUP, 2): each group's scale and minimum
    step = pairs[..., 0].double().repeat_interleave(GROUP, -1)
    lo_err = (pairs[..., 1].double() - w.double().reshape(n, -1, GROUP).amin(-1)).abs().repeat_interleave(GROUP, -1)
    assert bool(((back - w.double()).abs() <= step / 2 + lo_err + 1e-3 * step).all())  # half a step of its group
    swapped = (packed & 15) << 4 | (packed >> 4)  # negative controls: nibbles swapped is another weight,
    assert not torch.allclose(unpack_int4(swapped, sm, n), back.float(), atol=1e-3)
    assert not torch.allclose(unpack_int4(packed.roll(1, 1), sm, n), back.float(), atol=1e-3)  # as are bytes moved
    q, stored = quantize_groups(w, refine=0)  # the layout is a pure permutation of the quantised nibbles and pairs
    assert torch.equal(deinterleave_int4(packed, sm, n)[0], q) and torch.equal(pairs, stored)


@pytest.mark.parametrize("n,k", [(37, 128), (300, 896), (5, 576)])
def test_refined_pairs_lower_each_groups_error(n: int, k: int) -> None:
    """The least-squares rounds (`quantize_groups(refine=4)`, the default): in float64, every group's squared error
    at most the min/max pair's, lower on the whole by more than 5%; each nibble the nearest (clamped) for the pair
    stored; the pair at least 2^-14 apart per step. Negative control: nibbles of the min/max pair under the refined
    pair are worse."""
    torch.manual_seed(n)
    w = torch.randn(n, k) * torch.rand(n, 1)
    w[0, :GROUP] = 0.25  # a flat group: no variance to fit, kept as it is
    groups = w.double().reshape(n, -1, GROUP)

    def err(q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
        back = q.double().reshape(n, -1, GROUP) * sm[..., :1].double() + sm[..., 1:].double()
        return (back - groups).square().sum(-1)

    plain, fit = quantize_groups(w, refine=0), quantize_groups(w)
    e0, e1 = err(*plain), err(*fit)
    assert bool((e1 <= e0 + 1e-12).all()) and float(e1.sum()) < 0.95 * float(e0.sum())
    assert float(e1[0, 0]) < 1e-12
    s, lo = fit[1][..., 0].double(), fit[1][..., 1].double()
    u = (groups - lo[..., None]) / s[..., None]
    nearest = u.round().clamp(0, 15)
    tie = (u - u.floor() - 0.5).abs() < 1e-4
    off = fit[0].double().reshape(n, -1, GROUP) != nearest
    assert bool((off <= tie).all()) and bool((s >= 2 ** -14).all())
    assert float(err(plain[0], fit[1]).sum()) > float(e1.sum())


@needs_int4
@pytest.mark.parametrize("n,k,bias", [(8, 128, True), (37, 256, False), (1000, 896, True), (16, 32, False),
                                      (21, 576, True)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 12, 13, 30])
def test_kernel_matches_its_float64_reference_and_rows_do_not_mix(n: int, k: int, bias: bool, rows: int) -> None:
    torch.manual_seed(n + rows)
    layer = Int4Linear(nn.Linear(k, n, bias=bias))
    x = torch.randn(rows, k)
    x[0] *= 50  # rows of very different scales: each row has its own
    y = layer(x)
    ref = reference(x, layer.weight_float(), layer.bias)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    single = torch.cat([layer(x[t : t + 1]) for t in range(rows)])
    assert torch.equal(y, single)  # a row's bits do not depend on the rows beside it
    exact_w = x.double() @ layer.weight_float().double().t()  # the int8 inputs cost < 2% here, not more
    exact_w = exact_w if layer.bias is None else exact_w + layer.bias.double()
    assert (y.double() - exact_w).abs().max() <= 0.02 * exact_w.abs().max()


@needs_int4
@pytest.mark.parametrize("int8_copy", [True, False])
def test_many_rows_run_the_kernel(int8_copy: bool) -> None:
    """More than 12 rows (a prefill) run the same kernel, each row's bits as in a call of 4 rows: not fbgemm's int8
    copy (`many`, which quantises all the rows' inputs with one scale), kept or not."""
    torch.manual_seed(0)
    layer = Int4Linear(nn.Linear(256, 40), many=int8_copy)
    x = torch.randn(20, 256)
    assert "many" not in layer.__dict__  # the copy is built when asked for, not at load
    x[3] *= 50  # a row of another scale: fbgemm's one scale for all rows would blur the others
    many = layer(x)
    few = torch.cat([layer(x[i : i + 4]) for i in range(0, 20, 4)])
    assert torch.equal(few, many)
    assert "many" not in layer.__dict__  # running the kernel never asks for it
    assert (many.double() - reference(x, layer.weight_float(), layer.bias)).abs().max() <= 1e-5 * many.abs().max()
    if int8_copy:  # negative control: the copy's answer is another one
        assert not torch.equal(layer.many(x), many)
    cut = Int4Linear.rows_of(layer, torch.tensor([3, 0, 17]))
    assert torch.equal(cut(x[:5]), layer(x[:5])[:, [3, 0, 17]])  # a pruned head: the same rows, the same bits
    assert (cut.many is None) == (not int8_copy)
    if int8_copy:  # once built, the same copy every time, outside the module's state
        assert layer.many is layer.many and not any("many" in k for k in layer.state_dict())


def test_spec_and_fallback() -> None:
    d = DraftSpec.parse("int4:qwen2.5-coder-0.5b-instruct")
    assert (d.weights, d.quant) == ("qwen2.5-coder-0.5b-instruct", "int4")
    assert DraftSpec.parse("qwen2.5-coder-0.5b-instruct").quant is None
    model = helpers.tiny_llama(1, 61, hidden=128)
    assert draft_quant(model, "int4") == ("int4" if CHUNK else "int8")
    assert draft_quant(helpers.tiny_llama(1, 61, hidden=48), "int4") == "int8"  # rows not a multiple of 32
    assert draft_quant(model.double(), "int4") is None  # float64: as loaded
    assert int4_ok() == bool(CHUNK)


@needs_int4
@pytest.mark.parametrize("pruned", [False, True])
def test_int4_draft_stays_exact(pruned: bool) -> None:
    """Greedy output of the target alone, token for token, with an int4 draft of itself (whole, or pruned to 40
    ids with context ids), at several K; the int4 draft is mostly right (it is the target, quantised)."""
    V = 61
    hf = helpers.tiny_llama(9, V, hidden=128, max_positions=512)
    target = make_runner(hf, 128)
    for prompt in ([5, 6], [1, 2, 3, 4, 9]):
        ref = generate(target, prompt, max_new_tokens=40).tokens
        for k in (1, 3, 6):
            draft = make_runner(hf, 128, quantize="int4")
            assert any(isinstance(m, Int4Linear) for m in draft.modules())
            if pruned:
                draft = PrunedRunner(draft, torch.arange(40), context=True)
            out = generate(target, prompt, draft=draft, max_new_tokens=40, policy=KPolicy(k=k))
            assert out.tokens == ref, (prompt, k)
            assert out.stats.accepted > out.stats.drafted / 3
