"""The Linear kernels the runners call at inference, and the timing that picks between them.

`linear(x, layer)` runs an nn.Linear on oneDNN's kernel over a prepacked copy of its weight where that applies
(`dnn_usable`: the CPU, float32 or bfloat16, outside autograd and torch.compile), else in the faster of two BLAS
layouts on this machine, timed once per (weight shape, rows). `dense(x, weight)` is the same kernel for a bare
weight (a head's training labels). `RuntimeSettings.linear` (auto|xw|wx|dnn) fixes a layout. Inside `native_kernels()` a
float32 or int8 Linear over 1-12 rows runs draftsmith's own kernel (`decode.runtime.native`). Inside `blas()` the plain
BLAS layout (x @ W^T) runs instead of oneDNN: a runner's forward over a row count its plan gives to BLAS
(`decode.runtime.plan.plan_rows`; on the Intel Xeon of docs/results/floor.md the Qwen2.5-Coder-1.5B one-row step ran
240.0 ms against oneDNN's 267.9).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref

import torch
import torch.ao.nn.quantized.dynamic
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.decode.runtime import native
from draftsmith.decode.runtime.settings import current

_CHOICE: dict[tuple, bool] = {}  # (dtype, weight shape, rows, no bias) -> compute as W @ x^T (CPU only)
_PACKED: dict[int, tuple[weakref.ref, int, Tensor]] = {}  # id(weight) -> (the weight, its version, packed copy)
DYNAMIC_INT8 = torch.ao.nn.quantized.dynamic.Linear
_BLAS = [False]  # inside `blas()`: Linears take the plain BLAS layout, not oneDNN
_NATIVE = [False]  # inside `native_kernels()`: float32 / int8 Linears over 1-12 rows take `decode.runtime.native`'s kernel


@contextlib.contextmanager
def blas():
    """Within: every `linear` / `dense` runs in the plain BLAS layout (F.linear) instead of oneDNN's kernel."""
    before, _BLAS[0] = _BLAS[0], True
    try:
        yield
    finally:
        _BLAS[0] = before


@contextlib.contextmanager
def native_kernels():
    """Within: every float32 `linear` over 1-12 rows outside autograd, and every int8 draft Linear (torch's dynamic
    quantised one) over any rows, runs `decode.runtime.native`'s kernel where it is built (it reads a weight at close to the
    machine's bandwidth, where oneDNN's, MKL's and fbgemm's one-row kernels do not): a runner's forward over a row
    count its plan gives to it (`decode.runtime.plan.plan_rows`), and an int8 draft's prefill (`LeanLM.native_many`)."""
    before, _NATIVE[0] = _NATIVE[0], True
    try:
        yield
    finally:
        _NATIVE[0] = before


def _layout_setting() -> str:
    return current().linear


def best_time(fn, reps: int = 5) -> float:
    """The best of `reps` wall-clock timings of fn(), after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def dnn_usable(weight: Tensor) -> bool:
    """Whether a Linear with this weight runs on oneDNN's prepacked kernel (`linear`): on the CPU, in float32 or
    bfloat16, outside autograd and torch.compile, where the build has oneDNN, unless `RuntimeSettings.linear`
    names another layout."""
    return (dnn_layout(weight) and not _BLAS[0] and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def dnn_layout(weight: Tensor) -> bool:
    """`dnn_usable` without the autograd and torch.compile conditions: whether this weight's layout is oneDNN's
    (bfloat16 only where this CPU has oneDNN's bfloat16 path: AVX-512 BF16 / AVX-NE-CONVERT; a CPU with AVX2
    alone runs bfloat16 Linears in BLAS)."""
    return (_layout_setting() in ("auto", "dnn") and weight.device.type == "cpu"
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_fast()))
            and torch.backends.mkldnn.is_available())


@functools.cache
def bf16_fast() -> bool:
    """Whether oneDNN runs bfloat16 Linears on this CPU (AVX-512 BF16, AMX, AVX-NE-CONVERT), which is also whether
    bfloat16 matmuls are worth asking for: with AVX2 alone oneDNN refuses them and BLAS runs them several times
    slower than float32."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.lru_cache(maxsize=None)
def bf16_speedup(rows: int, in_features: int, out_features: int) -> float:
    """How many times faster `F.linear` of (rows, in_features) by (out_features, in_features) runs in bfloat16
    than in float32 on this CPU, timed (`best_time` of each; once per shape a process), 0.0 where oneDNN has no
    bfloat16 path (`bf16_fast`). A fast path is not a faster one: with AMX bfloat16 runs about 2x float32, with
    AVX-512 BF16 alone it ran 0.25-0.98x of it at a SmolLM2's shapes (Intel Xeon)."""
    if not bf16_fast():
        return 0.0
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    xb, wb = x.bfloat16(), w.bfloat16()
    with torch.inference_mode():
        return best_time(lambda: F.linear(x, w)) / max(best_time(lambda: F.linear(xb, wb)), 1e-9)


def _packed(weight: Tensor) -> Tensor:
    """oneDNN's own blocked copy of a weight, made once and made again if the weight changes in place (an
    optimizer step bumps its version): a snapshot that never goes stale."""
    key, version = id(weight), weight._version
    hit = _PACKED.get(key)
    new = hit is None or hit[0]() is not weight
    if new:  # forget its copy when the weight goes
        weakref.finalize(weight, _PACKED.pop, key, None)
    if new or hit[1] != version:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        hit = _PACKED[key] = (weakref.ref(weight), version, packed)
    return hit[2]


def _weight_first(x: Tensor, layer: nn.Linear) -> bool:
    """Whether a Linear on these few rows runs faster as (W @ x^T)^T than as x @ W^T on this CPU: decided once
    per (weight shape, rows) by timing both (the best of 5). BLAS libraries differ: on some CPUs (MKL on the
    AVX-512 EPYCs measured here) W @ x^T streams the weight once for a few rows, where x @ W^T costs ~T times one
    row; on others (this project's Intel Xeon runners) it is the other way round, 2x slower at 2 rows."""
    setting = _layout_setting()
    # small weights (test models) are not timed: microsecond timings are noise, and a choice that differed from
    # process to process would change rounding between a run and its resumption
    if setting not in ("auto", "dnn") or x.device.type != "cpu" or x.shape[0] > 16 or layer.weight.numel() < 1 << 16:
        return setting == "wx"
    key = (x.dtype, tuple(layer.weight.shape), x.shape[0], layer.bias is None)
    if key not in _CHOICE:
        probe = torch.randn_like(x)
        w, b = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
        wx = best_time(lambda: torch.mm(w, probe.t()))
        xw = best_time(lambda: F.linear(probe, w, b))
        _CHOICE[key] = wx < 0.9 * xw  # the plain layout unless the other is clearly faster
    return _CHOICE[key]


def _dnn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (..., d) as rows: batched decoding (BatchLM) too
    y = torch.ops.mkldnn._linear_pointwise(rows, _packed(weight), bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def dense(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T outside autograd (the labels a head trains on): oneDNN's kernel where `dnn_usable`, 2.2x
    MKL's float32 sgemm on the AMD EPYC here at (1632, 576) x (576, 8192); F.linear otherwise."""
    if dnn_usable(weight) and x.dtype == weight.dtype:
        return _dnn_linear(x, weight)
    return F.linear(x, weight)


def linear(x: Tensor, layer: nn.Module) -> Tensor:
    """A Linear layer at inference. On the CPU in float32 or bfloat16 (`dnn_usable`): oneDNN's kernel over a
    prepacked copy of the weight, whose cost hardly grows from 1 to 8 rows (MKL's sgemm on few rows is 1.3-2x one
    row) and which streams the weight faster even for one row. Otherwise the faster of two BLAS layouts on this machine
    (`_weight_first`); `RuntimeSettings.linear` = xw|wx|dnn fixes one. Inside `native_kernels()`, 1-12 rows of a float32
    Linear or of the int8 draft's quantised one run on draftsmith's own kernel where it is built
    (`decode.runtime.native`). Other layer types (the int8 Linear elsewhere: fbgemm) run as they are."""
    if type(layer) is not nn.Linear:
        if _NATIVE[0] and type(layer) is DYNAMIC_INT8 and x.dim() == 2:  # any rows: a draft's prefill too
            return _native_int8(x, layer)
        return layer(x)
    if _NATIVE[0] and x.dim() == 2 and x.shape[0] <= native.MAX_ROWS and not torch.is_grad_enabled():
        kernels = native.kernels()
        y = None if kernels is None else kernels.try_linear(x, layer.weight, None, layer.bias)
        if y is not None:
            return y
    if dnn_usable(layer.weight) and x.dtype == layer.weight.dtype:
        return _dnn_linear(x, layer.weight, layer.bias)
    if x.dim() != 2 or _BLAS[0] or not _weight_first(x, layer):  # batched rows (training), `blas()`: the plain one
        return F.linear(x, layer.weight, layer.bias)
    if layer.bias is None:
        return torch.mm(layer.weight, x.t()).t()
    return torch.addmm(layer.bias[:, None], layer.weight, x.t()).t()


def int8_rows(layer: nn.Module) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """A dynamic int8 Linear's weight as (int8 rows (N, K), a float32 scale per row (N,), bias): per-channel
    scales, or the one per-tensor scale for every row; None unless it is signed int8 with zero points 0
    (symmetric), whose rows times their scales are the weight."""
    w = layer.weight()
    if w.dtype != torch.qint8:
        return None
    if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        if bool((w.q_per_channel_zero_points() != 0).any()):
            return None
        scales = w.q_per_channel_scales().float().contiguous()
    else:
        if w.q_zero_point() != 0:
            return None
        scales = torch.full((w.shape[0],), float(w.q_scale()))
    bias = layer.bias()
    return w.int_repr().contiguous(), scales, None if bias is None else bias.detach().float().contiguous()


def _native_int8(x: Tensor, layer: nn.Module) -> Tensor:
    """The int8 Linear on the native kernel, its rows (`int8_rows`) read once and kept on the layer beside fbgemm's
    packed copy (which serves the forwards outside `native_kernels()`) until its weight is set again; fbgemm where
    that cannot run."""
    kernels = native.kernels()
    if kernels is None:
        return layer(x)
    packed = layer._packed_params._packed_params
    hit = getattr(layer, "_native_parts", None)
    if hit is None or hit[0] is not packed:
        hit = layer._native_parts = (packed, int8_rows(layer))
    y = None if hit[1] is None else kernels.try_linear(x, *hit[1])
    return layer(x) if y is None else y
