"""draftsmith's own few-row CPU kernels (decode/runtime/csrc/dsk.c): a Linear over 1..12 rows (more: a draft's
prefill, a block of output rows at a time over every 12 of them, its weights read once) whose weight is int8 with a
float scale per output row (the int8 draft's), int4 in groups of 32 with a float16 scale and minimum each (the int4
draft's, `q4_linear`: its inputs quantised to int8 a row for integer dot products), or float32, streamed once at
close to the machine's read bandwidth (each weight vector loaded once for all the rows; a row's output has the same
bits whatever rows are beside it).

fbgemm's dynamic int8 Linear and oneDNN's float32 one read a weight at roughly 22-28 GB/s on one row on the 2-core
CPUs here, where a streaming read reaches 32-36 GB/s (docs/results/floor.md); these kernels convert int8 to float32
in registers (no activation quantisation: closer to the float draft than fbgemm's) and prefetch the next rows ahead.

The C file (csrc/dsk.c, in the package) is built once per machine on first use through `torch.utils.cpp_extension.load`
(ninja and the C++ compiler: $CXX, else the first of c++, g++, gcc, cc on PATH; -O3 -march=native -fopenmp; no torch
header, so a few seconds; `is_python_module=False`: a plain C ABI, `extern "C"`) into the draftsmith cache,
`native/KEY/dsk.so`, KEY from the source, the compiler, the flags and the CPU's flags: built in a folder of its own
there, then moved into place (another process sees the whole library or none), and loaded with ctypes; its OpenMP is
the runtime torch has already loaded (libgomp), so both share one pool of threads. The CPU's flags are read first
(/proc/cpuinfo: avx512f, or avx2 and fma); a cached library that does not load or lacks the entry points is deleted
and built again once. Wherever the kernels cannot be had (DRAFTSMITH_NATIVE=off; not x86-64; a CPU without AVX-512
or AVX2 + FMA; no compiler or no ninja; dsk.c missing from the install; a failed compile; a cache folder that cannot
be written; a cached library that is corrupt and cannot be rebuilt) `kernels()` is None, every caller keeps torch's
kernels, `why_not()` gives the reason in one line, and that line is printed to stderr once (`draftsmith: native
kernels off: REASON; using torch's kernels`; not for DRAFTSMITH_NATIVE=off, which the user asked for).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.decode.runtime.settings import current

SOURCE = Path(__file__).parent / "csrc" / "dsk.c"
FLAGS = ("-O3", "-march=native", "-fopenmp")  # the compiler's flags (linked with -fopenmp too)
COMPILERS = ("c++", "g++", "gcc", "cc")  # looked for on PATH in this order where $CXX is not set
MAX_ROWS = 12  # rows the kernels take in one pass over a weight (dsk.c MAX_T); more run 12 at a time
GROUP = 32  # int4 weights: one scale and minimum per GROUP weights of a row (dsk.c GROUP)
RB = 16  # int4 weights: output rows interleaved a block, one int32 lane each (dsk.c RB)
_WHY: list[str] = []  # the last `kernels()`'s reason ("" where it found them)
OFF = "DRAFTSMITH_NATIVE=off"  # the reason where the settings turn the kernels off (RuntimeSettings(native=False))


class NoKernels(Exception):
    """Why the kernels cannot be had here: one true line (`why_not()`)."""


def _cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ("" where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _check_cpu() -> str:
    """The CPU's flags, checked before compiling: AVX-512F, or AVX2 and FMA (what dsk.c is written for)."""
    flags = _cpu_flags()
    if not flags:
        raise NoKernels("cannot read the CPU's features (no flags in /proc/cpuinfo)")
    have = set(flags.split())
    if "avx512f" not in have and not {"avx2", "fma"} <= have:
        raise NoKernels("this CPU has neither AVX-512 nor AVX2 + FMA")
    return flags


def _compiler() -> str:
    """The C++ compiler cpp_extension is to run: the settings' `compiler` (the CLI: $CXX), else the first of
    COMPILERS on PATH (its full path)."""
    named = current().compiler
    if named:
        found = shutil.which(named)
        if found is None:
            raise NoKernels(f"no compiler: CXX={named} is not found")
        return found
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    raise NoKernels(f"no C/C++ compiler found ($CXX unset; none of {', '.join(COMPILERS)} on PATH)")


def _ninja_dir() -> str:
    """The folder holding ninja, which cpp_extension builds with: the `ninja` package's, else PATH's."""
    try:
        import ninja

        if ninja.BIN_DIR and shutil.which("ninja", path=ninja.BIN_DIR):
            return ninja.BIN_DIR
    except ImportError:
        pass
    found = shutil.which("ninja")
    if found is None:
        raise NoKernels("ninja is not installed (torch.utils.cpp_extension builds with it: pip install ninja)")
    return str(Path(found).parent)


def _library(compiler: str, flags: str) -> Path:
    """Where the library built from SOURCE by `compiler` for a CPU with `flags` lives in the cache."""
    from draftsmith.decode.runtime.zoo import cache_dir

    try:
        source = SOURCE.read_bytes()
    except OSError as e:
        raise NoKernels(f"{SOURCE.name} is missing from the install ({SOURCE}: {e.strerror})") from None
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), flags.encode()]))
    return cache_dir() / "native" / key.hexdigest()[:16] / "dsk.so"


def _unwritable(e: OSError) -> NoKernels:
    from draftsmith.decode.runtime.zoo import cache_dir

    return NoKernels(f"the cache folder {cache_dir()} is not writable ({e.strerror or e})")


def _first_error(log: str) -> str:
    """The line that says why a cpp_extension build failed, from ninja's log: the first error line of what the
    failed command (compiler or linker) wrote, else its first line that is not a context line ("In function ...:"),
    else that it wrote nothing."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    failed = next((i for i, line in enumerate(lines) if line.startswith("FAILED:")), None)
    said = lines if failed is None else lines[failed + 2:]  # after FAILED: the command, then what it wrote
    said = [line for line in said if not line.startswith(("ninja: ", "["))]  # ninja's own lines
    errors = [line for line in said if "error" in line.lower() and not line.startswith("collect2:")]
    plain = [line for line in said if not line.endswith((":", ","))]
    if errors or plain or said:
        return (errors or plain or said)[0]
    step = lines[failed].removeprefix("FAILED:").strip() if failed is not None else "the library"
    return f"making {step} stopped without a message"


@contextlib.contextmanager
def _environ(**values: str):
    """os.environ with `values` set, as it was after (cpp_extension reads CXX and PATH from it)."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _build(compiler: str, lib: Path) -> None:
    """SOURCE compiled by `compiler` through cpp_extension in a folder of its own beside `lib`, then moved onto
    `lib` in one step (another process sees the whole library or none)."""
    from torch.utils import cpp_extension

    ninja_dir = _ninja_dir()
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        folder = tempfile.mkdtemp(prefix="build-", dir=lib.parent)
    except OSError as e:
        raise _unwritable(e) from None
    try:
        path = os.pathsep.join([ninja_dir, os.environ.get("PATH", "")])
        with _environ(CXX=compiler, PATH=path, TORCH_DONT_CHECK_COMPILER_ABI="1"):  # a C ABI: no C++ ABI to match
            try:
                built = cpp_extension.load("dsk", [str(SOURCE)], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                                           build_directory=folder, is_python_module=False, verbose=False)
            except RuntimeError as e:  # "Error building extension 'dsk': <ninja's log>"
                raise NoKernels(f"compiling {SOURCE.name} failed: {_first_error(str(e).partition(': ')[2])}") from None
            except OSError as e:  # built, then loaded by cpp_extension: it does not load
                raise NoKernels(f"the library built from {SOURCE.name} does not load: {e.__cause__ or e}") from None
        try:
            os.replace(built, lib)
        except OSError as e:
            raise _unwritable(e) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            lib.parent.rmdir()  # where nothing was built: no empty folder left (not empty: left as it is)


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
        `decode.runtime.quant.pack_int4` lays it out: `packed` (Np, K / 2) uint8 and `sm` (Np, K / GROUP, 2)
        float16 (each group's scale and minimum, w = q * scale + min), its rows RB at a time (Np: n rounded up to
        RB; `n` defaults to Np). Each row of x is quantised to int8 (one scale: max |x| / 127) for integer dot
        products."""
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


def _load(lib: Path) -> Kernels:
    """The library at `lib` (OSError where it does not load, AttributeError where it lacks an entry point)."""
    dll = ctypes.CDLL(str(lib))
    if dll.dsk_lanes() == 0:  # built, but -march=native gave it no vector code: no kernels in it
        raise NoKernels(f"{SOURCE.name} was compiled without AVX-512 or AVX2 + FMA (-march=native)")
    return Kernels(dll)


def _cached_or_built(compiler: str, lib: Path) -> Kernels:
    """The library at `lib`, built first where it is not there; a cached one that does not load or lacks entry
    points (corrupt) is deleted and built once more."""
    if not lib.is_file():
        _build(compiler, lib)
        try:
            return _load(lib)
        except (OSError, AttributeError) as e:
            raise NoKernels(f"the library built from {SOURCE.name} does not load: {_said(e, lib)}") from None
    try:
        return _load(lib)
    except (OSError, AttributeError) as e:
        corrupt = f"the cached library {lib} is corrupt ({_said(e, lib)})"
    try:
        lib.unlink()
    except FileNotFoundError:  # another process got there first
        pass
    except OSError as e:
        raise NoKernels(f"{corrupt} and {_unwritable(e)}") from None
    try:
        _build(compiler, lib)
        return _load(lib)
    except (NoKernels, OSError, AttributeError) as e:
        raise NoKernels(f"{corrupt} and rebuilding it failed: {_said(e, lib)}") from None


def _said(e: BaseException, lib: Path) -> str:
    """An error's message in one line, without the library's path in front (the dynamic loader's prefix)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.removeprefix(f"{lib}: ")


def _find() -> Kernels:
    """The kernels, built where needed (`NoKernels` says why not)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NoKernels(f"no kernels for {platform.machine()} (dsk.c is x86-64 vector code)")
    flags = _check_cpu()
    if not SOURCE.is_file():
        raise NoKernels(f"{SOURCE.name} is missing from the install ({SOURCE})")
    compiler = _compiler()
    return _cached_or_built(compiler, _library(compiler, flags))


def kernels() -> Kernels | None:
    """The compiled kernels on this machine, or None (`why_not()`; said once on stderr unless turned off by the
    settings: `RuntimeSettings.native`, the CLI's DRAFTSMITH_NATIVE=off)."""
    settings = current()
    if not settings.native:
        _WHY[:] = [OFF]
        return None
    return _built(settings.compiler)


@functools.cache
def _built(compiler: str | None) -> Kernels | None:
    """`kernels()` for one compiler setting, found (or built) once per process."""
    try:
        found = _find()
    except NoKernels as e:
        why = str(e)
    except Exception as e:  # anything else a build throws: still a fall-back, never a crash
        why = f"building the kernels failed: {type(e).__name__}: {_said(e, SOURCE)}"
    else:
        _WHY[:] = [""]
        return found
    _WHY[:] = [why]
    print(f"draftsmith: native kernels off: {why}; using torch's kernels", file=sys.stderr, flush=True)
    return None


Q4_AHEAD_CHOICES = (1024, 2048, 4096, 8192)  # prefetch distances `tune_q4_ahead` times (1024: the built-in one)
Q4_AHEAD_MARGIN = 0.03  # another distance replaces the built-in one only where its median pass is this much faster
# the timed passes: one row through int4 weights shaped like a Qwen 0.5B draft's (8 layers of fused q/k/v, o,
# fused gate/up, down, then a 32,768-row head), about 62 MB: out of the L2 caches, as a draft step's 0.3 GB is
_Q4_TUNE_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)] * 8 + [(32768, 896)]


@functools.cache
def tune_q4_ahead() -> int:
    """The int4 kernel's prefetch distance for this machine, set on `kernels()` and returned: the settings'
    `q4_ahead` (the CLI: DRAFTSMITH_Q4_AHEAD) where given, else the choice saved beside the library, else timed once (`Q4_AHEAD_CHOICES`, 7 interleaved
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
    fixed = current().q4_ahead  # checked by RuntimeSettings (0..1 MiB)
    if fixed is not None:
        return k.q4_ahead(fixed)
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


kernels.cache_clear = _built.cache_clear  # found afresh on the next call (tests)


def why_not() -> str:
    """Why `kernels()` is None, in one line ("" when it is not)."""
    kernels()
    return _WHY[0] if _WHY else ""
