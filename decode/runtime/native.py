"""draftsmith's own few-row CPU kernels (decode/runtime/csrc/dsk.c): a Linear over 1..12 rows (more: a draft's prefill, a
block of output rows at a time over every 12 of them, its weights read once) whose weight is int8 with a
float scale per output row (the int8 draft's), int4 in groups of 32 with a float16 scale and minimum each (the int4
draft's, `q4_linear`: its inputs quantised to int8 a row for integer dot products), or float32, streamed once at
close to the machine's read bandwidth (each weight vector loaded once for all the rows; a row's output has the same
bits whatever rows are beside it).

fbgemm's dynamic int8 Linear and oneDNN's float32 one read a weight at roughly 22-28 GB/s on one row on the 2-core
CPUs here, where a streaming read reaches 32-36 GB/s (docs/results/floor.md); these kernels convert int8 to float32
in registers (no activation quantisation: closer to the float draft than fbgemm's) and prefetch the next rows ahead.

The C file is compiled once per machine on first use (`gcc -O3 -march=native -fopenmp`, an argument list, into
the draftsmith cache, keyed by the source, the compiler and the CPU's flags; written atomically) and loaded with
ctypes; its OpenMP is the runtime torch has already loaded (libgomp), so both share one pool of threads. Where no
compiler is found, the CPU has neither AVX-512 nor AVX2 + FMA, or DRAFTSMITH_NATIVE=off, `kernels()` is None
and every caller keeps the library kernels (`why_not()` says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).parent / "csrc" / "dsk.c"
MAX_ROWS = 12  # rows the kernels take in one pass over a weight (dsk.c MAX_T); more run 12 at a time
GROUP = 32  # int4 weights: one scale and minimum per GROUP weights of a row (dsk.c GROUP)
RB = 16  # int4 weights: output rows interleaved a block, one int32 lane each (dsk.c RB)
_WHY: list[str] = []


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compile(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(part)],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(part, out)  # atomic: another process sees the whole library or none


class Kernels:
    """The compiled library: `linear(x, weight, scale, bias)` -> (T, N) for T >= 1 rows (one pass over the weight
    for T <= MAX_ROWS)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lanes = lib.dsk_lanes()
        if lib.dsk_max_rows() != MAX_ROWS:
            raise OSError(f"{SOURCE.name} takes {lib.dsk_max_rows()} rows, native.py expects {MAX_ROWS}")
        self._f32, self._q8, self._q4 = lib.dsk_f32_linear, lib.dsk_q8_linear, lib.dsk_q4_linear
        self.q4_chunk = lib.dsk_q4_chunk()  # an int4 row's length must be a multiple of this (0: no int4 kernel)
        self._q4_ahead = lib.dsk_q4_ahead
        self._q4_ahead.restype, self._q4_ahead.argtypes = ctypes.c_int, [ctypes.c_int]
        for fn in (self._f32, self._q8, self._q4):
            fn.restype = ctypes.c_int if fn is self._q4 else None
            fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3

    def fits(self, x: Tensor, weight: Tensor) -> bool:
        """Whether these kernels take this call: contiguous float32 rows on the CPU, a contiguous int8 or
        float32 weight whose row length is a multiple of the vector width."""
        return (x.dim() == 2 and 0 < x.shape[0] and x.dtype == torch.float32 and x.device.type == "cpu"
                and weight.dtype in (torch.int8, torch.float32) and weight.is_contiguous()
                and weight.shape[1] == x.shape[1] and x.shape[1] % self.lanes == 0)

    def linear(self, x: Tensor, weight: Tensor, scale: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
        """x (T, K) float32 @ (scale[:, None] * weight (N, K))^T + bias (`fits`)."""
        y = self.try_linear(x, weight, scale, bias)
        if y is None:
            raise ValueError(f"native linear takes float32 rows of a contiguous int8/float32 weight "
                             f"with K % {self.lanes} == 0; got x {tuple(x.shape)} {x.dtype}, weight "
                             f"{tuple(weight.shape)} {weight.dtype}")
        return y

    def try_linear(self, x: Tensor, weight: Tensor, scale: Tensor | None = None,
                   bias: Tensor | None = None) -> Tensor | None:
        """`linear`, or None where the call does not `fit` (the caller runs another kernel): one check on the path
        of every draft step."""
        if not self.fits(x, weight):
            return None
        for name, t in (("scale", scale), ("bias", bias)):
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.shape != (weight.shape[0],)):
                raise ValueError(f"native linear: {name} must be contiguous float32 of shape ({weight.shape[0]},)")
        x = x.contiguous()
        T, K = x.shape
        N = weight.shape[0]
        y = torch.empty(T, N, dtype=torch.float32)
        fn = self._q8 if weight.dtype == torch.int8 else self._f32
        fn(x.data_ptr(), weight.data_ptr(), 0 if scale is None else scale.data_ptr(),
           0 if bias is None else bias.data_ptr(), y.data_ptr(), T, N, K)
        return y


    def q4_ahead(self, nbytes: int = -1) -> int:
        """The int4 kernel's prefetch distance (bytes ahead of a block's weight stream): sets it to `nbytes` where
        given (0..1 MiB), returns the one in force. `tune_q4_ahead` chooses it per machine."""
        return self._q4_ahead(int(nbytes))

    def q4_linear(self, x: Tensor, packed: Tensor, sm: Tensor, bias: Tensor | None = None, *,
                  n: int | None = None) -> Tensor:
        """x (T, K) float32 @ W^T + bias for T >= 1 rows, W (n, K) int4 in groups of GROUP along K, as
        `decode.runtime.quant.pack_int4` lays it out: `packed` (Np, K / 2) uint8 and `sm` (Np, K / GROUP, 2) float16 (each
        group's scale and minimum, w = q * scale + min), its rows RB at a time (Np: n rounded up to RB; `n`
        defaults to Np). Each row of x is quantised to int8 (one scale: max |x| / 127) for integer dot products."""
        T, K = x.shape
        Np = packed.shape[0]
        n = Np if n is None else n
        if not (0 < T and x.dtype == torch.float32 and self.q4_chunk and K % self.q4_chunk == 0
                and Np % RB == 0 and Np - RB < n <= Np
                and packed.dtype == torch.uint8 and packed.shape == (Np, K // 2) and packed.is_contiguous()
                and sm.dtype == torch.float16 and sm.shape == (Np, K // GROUP, 2) and sm.is_contiguous()
                and (bias is None or (bias.dtype == torch.float32 and bias.shape == (n,) and bias.is_contiguous()))):
            raise ValueError(f"native int4 linear: x {tuple(x.shape)} {x.dtype}, packed {tuple(packed.shape)} "
                             f"{packed.dtype}, sm {tuple(sm.shape)}, {n} rows do not fit (float32 "
                             f"rows, K % {self.q4_chunk} == 0, rows padded to a multiple of {RB})")
        x = x.contiguous()
        y = torch.empty(T, n, dtype=torch.float32)
        if self._q4(x.data_ptr(), packed.data_ptr(), sm.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    y.data_ptr(), T, n, K):
            raise MemoryError("native int4 linear: no memory for the int8 inputs")
        return y


@functools.cache
def kernels() -> Kernels | None:
    """The compiled kernels on this machine, or None (`why_not()`)."""
    if os.environ.get("DRAFTSMITH_NATIVE", "auto") == "off":
        _WHY.append("DRAFTSMITH_NATIVE=off")
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        _WHY.append(f"no kernels for {platform.machine()}")
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        _WHY.append("no C compiler (gcc) found")
        return None
    from draftsmith.decode.runtime.zoo import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + cc.encode() + _cpu_flags().encode()).hexdigest()[:16]
    lib_path = cache_dir() / "native" / f"dsk-{key}.so"
    try:
        if not lib_path.is_file():
            _compile(cc, lib_path)
        found = Kernels(ctypes.CDLL(str(lib_path)))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        _WHY.append(f"compiling {SOURCE.name} failed: {detail.strip().splitlines()[0] if detail.strip() else e}")
        return None
    if found.lanes == 0:
        _WHY.append("this CPU has neither AVX-512 nor AVX2 + FMA")
        return None
    return found


Q4_AHEAD_CHOICES = (1024, 2048, 4096, 8192)  # prefetch distances `tune_q4_ahead` times (1024: the built-in one)
Q4_AHEAD_MARGIN = 0.03  # another distance replaces the built-in one only where its median pass is this much faster
# the timed passes: one row through int4 weights shaped like a Qwen 0.5B draft's (8 layers of fused q/k/v, o,
# fused gate/up, down, then a 32,768-row head), about 62 MB: out of the L2 caches, as a draft step's 0.3 GB is
_Q4_TUNE_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)] * 8 + [(32768, 896)]


@functools.cache
def tune_q4_ahead() -> int:
    """The int4 kernel's prefetch distance for this machine, set on `kernels()` and returned: DRAFTSMITH_Q4_AHEAD
    where given, else the choice saved beside the library, else timed once (`Q4_AHEAD_CHOICES`, 7 interleaved
    passes each over `_Q4_TUNE_SHAPES`, the median pass; the built-in 1024 kept unless another is
    `Q4_AHEAD_MARGIN` faster) and saved (`<cache>/native/q4-ahead-KEY.json`). 0 where there is no int4 kernel."""
    import json
    import time

    from draftsmith.decode.runtime.errors import DraftsmithError
    from draftsmith.decode.runtime.io import atomic_write_json, read_json
    from draftsmith.decode.runtime.zoo import cache_dir

    k = kernels()
    if k is None or not k.q4_chunk:
        return 0
    fixed = os.environ.get("DRAFTSMITH_Q4_AHEAD")
    if fixed:
        if not fixed.isdigit() or k.q4_ahead(int(fixed)) != int(fixed):
            raise ValueError(f"DRAFTSMITH_Q4_AHEAD must be a byte count 0..{1 << 20}, got {fixed!r}")
        return int(fixed)
    key = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode() + json.dumps(_Q4_TUNE_SHAPES).encode()
                         + json.dumps(Q4_AHEAD_CHOICES).encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"q4-ahead-{key}.json"
    try:
        saved = read_json(path, missing_ok=True, what="int4 prefetch choice")
    except DraftsmithError:  # a damaged file: timed again and replaced
        saved = None
    if isinstance(saved, dict) and saved.get("ahead") in Q4_AHEAD_CHOICES:
        return k.q4_ahead(saved["ahead"])
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randint(0, 256, (n, kk // 2), dtype=torch.uint8, generator=g),
                torch.full((n, kk // GROUP, 2), 0.01, dtype=torch.float16), torch.randn(1, kk, generator=g))
               for n, kk in _Q4_TUNE_SHAPES]
    times: dict[int, list[float]] = {b: [] for b in Q4_AHEAD_CHOICES}
    for rep in range(8):  # the first pass warms up and is dropped
        order = Q4_AHEAD_CHOICES[rep % len(Q4_AHEAD_CHOICES):] + Q4_AHEAD_CHOICES[:rep % len(Q4_AHEAD_CHOICES)]
        for b in order:
            k.q4_ahead(b)
            start = time.perf_counter()
            for packed, sm, x in weights:
                k.q4_linear(x, packed, sm)
            if rep:
                times[b].append(time.perf_counter() - start)
    median = {b: sorted(t)[len(t) // 2] for b, t in times.items()}
    best = min(median, key=median.get)
    ahead = best if median[best] < (1 - Q4_AHEAD_MARGIN) * median[Q4_AHEAD_CHOICES[0]] else Q4_AHEAD_CHOICES[0]
    try:
        atomic_write_json(path, {"ahead": ahead, "median_seconds": {str(b): m for b, m in median.items()},
                                 "cpu_flags_key": key})
    except OSError:  # a read-only cache: the choice holds for this process
        pass
    return k.q4_ahead(ahead)


def why_not() -> str:
    """Why `kernels()` is None ("" when it is not)."""
    kernels()
    return _WHY[-1] if _WHY else ""
