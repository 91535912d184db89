"""`decode.runtime.native`'s faults and fall-backs: no compiler, no ninja, a CPU without AVX2 (simulated: its flags
replaced), a failed compile, a corrupt cached library (rebuilt; or not rebuildable, or not deletable),
the settings turning them off (DRAFTSMITH_NATIVE=off), a read-only cache (simulated: we run as root, so a cache under a regular file, or every mkdir
in it refused) and dsk.c missing from the install. Each gives `kernels()` None with its true one-line reason,
printed once to stderr (not for DRAFTSMITH_NATIVE=off), and then each runs the decoder's exactness checks on torch's
kernels: greedy output with an int8 and an int4 draft equals the target's own, token for token, and sampled output
follows the target's law (chi-square against exact enumeration)."""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension

from draftsmith.decode.runtime import native, quant, settings
from draftsmith.decode.runtime.settings import RuntimeSettings
from draftsmith.decode.runtime.quant import Int4Linear, draft_quant
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams, to_probs
from draftsmith.decode.speculative import KPolicy, generate
from tests import helpers
from tests.decode.test_speculative import chi2_pvalue

AVX2_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 fma bmi2"  # what the faults past the CPU check see
FAILING_CXX = 'echo "fake-c++: error: simulated failure" >&2; exit 1'
NEVER_RUN = 'echo "this tool must not run" >&2; exit 3'


@pytest.fixture(autouse=True)
def fresh_kernels(monkeypatch, tmp_path):
    """Each test finds its kernels afresh in a cache of its own, and leaves them to be found afresh after."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(settings, "_CURRENT", [RuntimeSettings()])  # the defaults, whatever ran before
    native.kernels.cache_clear()
    native.tune_q4_ahead.cache_clear()
    yield
    native.kernels.cache_clear()
    native.tune_q4_ahead.cache_clear()


def use(monkeypatch, **changes) -> None:
    """Run under the default settings with `changes` (as the CLI maps CXX or DRAFTSMITH_NATIVE=off onto them)."""
    monkeypatch.setattr(settings, "_CURRENT", [RuntimeSettings(**changes)])


def tool(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


def forbid_compiling(monkeypatch) -> None:
    """The fault is to be found before anything is compiled."""
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("compiled despite the fault"))


def refuse_under(monkeypatch, fn: str, folder: Path) -> None:
    """`os.<fn>` refused (EACCES) for every path under `folder`: a read-only cache, as root cannot make one."""
    real = getattr(os, fn)

    def refused(path, *args, **kwargs):
        if str(path).startswith(str(folder)):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, fn, refused)


def garbage_library(monkeypatch, tmp_path) -> tuple[Path, str]:
    """Garbage where the library built by a failing compiler goes: (its path, the loader's complaint)."""
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX2_FLAGS)
    use(monkeypatch, compiler=str(tool(tmp_path / "bin", "c++", FAILING_CXX)))
    lib = native._library(native._compiler(), AVX2_FLAGS)
    lib.parent.mkdir(parents=True)
    lib.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(OSError) as loading:
        ctypes.CDLL(str(lib))
    return lib, str(loading.value).removeprefix(f"{lib}: ")


# each fault: arranges itself and returns the reason `why_not()` must give
def fault_off(monkeypatch, tmp_path) -> str:
    use(monkeypatch, native=False)
    forbid_compiling(monkeypatch)
    return "DRAFTSMITH_NATIVE=off"


def fault_not_x86(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(native, "platform", SimpleNamespace(machine=lambda: "aarch64"))  # native's view only
    forbid_compiling(monkeypatch)
    return "no kernels for aarch64 (dsk.c is x86-64 vector code)"


def fault_no_avx2(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(native, "_cpu_flags", lambda: "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma")
    forbid_compiling(monkeypatch)
    return "this CPU has neither AVX-512 nor AVX2 + FMA"


def fault_no_compiler(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX2_FLAGS)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    forbid_compiling(monkeypatch)
    return "no C/C++ compiler found ($CXX unset; none of c++, g++, gcc, cc on PATH)"


def fault_no_ninja(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX2_FLAGS)
    monkeypatch.setenv("PATH", str(tool(tmp_path / "bin", "c++", NEVER_RUN).parent))  # a compiler, no ninja
    monkeypatch.setitem(sys.modules, "ninja", None)  # nor the ninja package
    forbid_compiling(monkeypatch)
    return "ninja is not installed (torch.utils.cpp_extension builds with it: pip install ninja)"


def fault_compile_fails(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX2_FLAGS)
    use(monkeypatch, compiler=str(tool(tmp_path / "bin", "c++", FAILING_CXX)))
    return "compiling dsk.c failed: fake-c++: error: simulated failure"


def fault_corrupt_not_rebuilt(monkeypatch, tmp_path) -> str:
    lib, complaint = garbage_library(monkeypatch, tmp_path)
    return (f"the cached library {lib} is corrupt ({complaint}) and rebuilding it failed: "
            "compiling dsk.c failed: fake-c++: error: simulated failure")


def fault_corrupt_in_read_only_cache(monkeypatch, tmp_path) -> str:
    lib, complaint = garbage_library(monkeypatch, tmp_path)
    refuse_under(monkeypatch, "unlink", tmp_path / "cache")
    forbid_compiling(monkeypatch)
    return (f"the cached library {lib} is corrupt ({complaint}) and the cache folder {tmp_path / 'cache'} is not "
            "writable (Permission denied)")


def fault_cache_under_a_file(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX2_FLAGS)
    use(monkeypatch, compiler=str(tool(tmp_path / "bin", "c++", NEVER_RUN)))
    (tmp_path / "file").write_text("a file where the cache's parent folder should be")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "file" / "cache"))
    forbid_compiling(monkeypatch)
    return f"the cache folder {tmp_path / 'file' / 'cache'} is not writable (Not a directory)"


def fault_cache_refuses_folders(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX2_FLAGS)
    use(monkeypatch, compiler=str(tool(tmp_path / "bin", "c++", NEVER_RUN)))
    refuse_under(monkeypatch, "mkdir", tmp_path / "cache")
    forbid_compiling(monkeypatch)
    return f"the cache folder {tmp_path / 'cache'} is not writable (Permission denied)"


def fault_source_missing(monkeypatch, tmp_path) -> str:
    monkeypatch.setattr(native, "_cpu_flags", lambda: AVX2_FLAGS)
    monkeypatch.setattr(native, "SOURCE", tmp_path / "csrc" / "dsk.c")
    forbid_compiling(monkeypatch)
    return f"dsk.c is missing from the install ({tmp_path / 'csrc' / 'dsk.c'})"


FAULTS = {f.__name__.removeprefix("fault_"): f for f in (
    fault_off, fault_not_x86, fault_no_avx2, fault_no_compiler, fault_no_ninja, fault_compile_fails,
    fault_corrupt_not_rebuilt, fault_corrupt_in_read_only_cache, fault_cache_under_a_file,
    fault_cache_refuses_folders, fault_source_missing)}


def on_fallback(fault: str, monkeypatch, tmp_path, capsys) -> str:
    """The fault arranged; `kernels()` None (asked twice), `why_not()` its reason, said once on stderr."""
    why = FAULTS[fault](monkeypatch, tmp_path)
    assert native.kernels() is None
    assert native.why_not() == why
    assert native.kernels() is None and native.why_not() == why
    said = capsys.readouterr().err.splitlines()
    assert said == ([] if fault == "off" else [f"draftsmith: native kernels off: {why}; using torch's kernels"])
    return why


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_falls_back_with_its_true_reason_said_once(fault: str, monkeypatch, tmp_path, capsys) -> None:
    why = on_fallback(fault, monkeypatch, tmp_path, capsys)
    assert "\n" not in why
    if fault == "corrupt_not_rebuilt":  # the garbage is gone; nothing was put in its place
        assert not list((tmp_path / "cache" / "native").rglob("dsk.so"))
    if fault in ("compile_fails", "corrupt_not_rebuilt"):  # no build folder left behind
        assert not list((tmp_path / "cache" / "native").rglob("build-*"))


# --- greedy: with an int8 and an int4 draft, the target's own greedy output ----------------------------------------

@functools.cache
def greedy_model():
    return helpers.tiny_llama(9, 61, hidden=32, max_positions=128)


def int4_draft(hf, monkeypatch, seq_len: int):
    """An int4 draft on torch's kernels: `make_runner` refuses one without draftsmith's kernel (asked for int4, a
    draft gets int8), so it is built here as one loaded where the kernel is missing would run: `Int4Linear`s on
    their int8 copies."""
    assert draft_quant(hf, "int4") == "int8"
    with pytest.raises(ValueError, match="int4 drafts need draftsmith's kernel: "):
        make_runner(hf, seq_len, quantize="int4")
    monkeypatch.setattr(quant, "int4_ok", lambda model=None: True)
    draft = make_runner(hf, seq_len, quantize="int4")
    assert any(isinstance(m, Int4Linear) for m in draft.modules())
    return draft


@pytest.mark.parametrize("fault", FAULTS)
def test_greedy_on_the_fallback_is_the_targets_own(fault: str, monkeypatch, tmp_path, capsys) -> None:
    on_fallback(fault, monkeypatch, tmp_path, capsys)
    hf = greedy_model()
    target = make_runner(hf, 64)
    int8 = make_runner(hf, 64, quantize="int8")
    assert not int8.native_many and not int8.native_rows  # fbgemm's kernel, prefills included
    drafts = {"int8": int8, "int4": int4_draft(hf, monkeypatch, 64)}
    for prompt in ([5, 6], [1, 2, 3, 4, 9]):
        ref = generate(target, prompt, max_new_tokens=20).tokens
        for (name, draft), k in itertools.product(drafts.items(), (1, 4)):
            out = generate(target, prompt, draft=draft, max_new_tokens=20, policy=KPolicy(k=k))
            assert out.tokens == ref, (name, k, prompt)
            assert out.stats.accepted > out.stats.drafted / 3  # the target quantised: mostly right
    assert native.kernels() is None


# --- temperature > 0: the output law is the target's ---------------------------------------------------------------
# as tests/decode/test_speculative.py's law test, over 2 tokens (16 continuations of V = 4) for time: with n = 200
# draws the chi-square test at level 1e-3 detects a total-variation error of 0.3 with power > 0.99 (noncentral
# chi-square, df 15, lambda >= n (2 TV)^2 = 72); each draft alone, off by more than 0.3, fails it (the control below)

V, N_NEW, LAW_N, PROMPT = 4, 2, 200, [1, 3]
LAW_CASES = {"int8": (SamplingParams(1.0), 2), "int4": (SamplingParams(0.8, top_k=3), 3)}


@functools.cache
def law_models():
    return helpers.tiny_llama(20, V, layers=1, head_scale=4.0), helpers.tiny_llama(21, V, layers=1, head_scale=4.0)


@functools.cache
def sequence_law(which: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact probability of every N_NEW-token continuation of PROMPT under law_models()[which], by enumeration."""
    hf = law_models()[which]
    law = {}
    for seq in itertools.product(range(V), repeat=N_NEW):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(seq)])).logits[0]
        law[seq] = float(torch.prod(torch.stack([to_probs(logits[len(PROMPT) - 1 + i], params)[tok]
                                                 for i, tok in enumerate(seq)])))
    return law


def sample_counts(target, draft, params: SamplingParams, k: int, n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(n):
        out = generate(target, PROMPT, draft=draft, max_new_tokens=N_NEW, sampling=params, policy=KPolicy(k=k),
                       generator=g)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    return counts


@pytest.mark.parametrize("fault", FAULTS)
def test_sampled_law_on_the_fallback_is_the_targets(fault: str, monkeypatch, tmp_path, capsys) -> None:
    on_fallback(fault, monkeypatch, tmp_path, capsys)
    t_hf, d_hf = law_models()
    target = make_runner(t_hf, 32)
    drafts = {"int8": make_runner(d_hf, 32, quantize="int8"), "int4": int4_draft(d_hf, monkeypatch, 32)}
    for name, draft in drafts.items():
        params, k = LAW_CASES[name]
        p = chi2_pvalue(sample_counts(target, draft, params, k, LAW_N), sequence_law(0, params), LAW_N)
        assert p > 1e-3, (name, p)
    assert native.kernels() is None


def test_the_law_check_can_fail(monkeypatch, tmp_path, capsys) -> None:
    """Negative control: the drafts' own samples (what a decoder that never rejects would emit), at the same n."""
    on_fallback("off", monkeypatch, tmp_path, capsys)
    t_hf, d_hf = law_models()
    drafts = {"int8": make_runner(d_hf, 32, quantize="int8"), "int4": int4_draft(d_hf, monkeypatch, 32)}
    for name, draft in drafts.items():
        params, k = LAW_CASES[name]
        far = sum(abs(sequence_law(0, params)[s] - q) for s, q in sequence_law(1, params).items()) / 2
        assert far > 0.3
        assert chi2_pvalue(sample_counts(draft, None, params, k, LAW_N), sequence_law(0, params), LAW_N) < 1e-6


def test_a_corrupt_cached_library_is_deleted_and_rebuilt(tmp_path, capsys) -> None:
    """Garbage where the library goes: deleted and built again (a real compile), nothing said; the rebuilt kernel
    computes a Linear as float64 does. Where this machine cannot build the kernels at all, the reason is still one
    true line, said once."""
    flags = native._cpu_flags()
    try:
        lib = native._library(native._compiler(), flags)
    except native.NoKernels:  # no compiler here: nothing could be cached
        lib = None
    if lib is not None:
        lib.parent.mkdir(parents=True)
        lib.write_bytes(b"\x7fELF" + bytes(4092))  # an ELF header and nothing behind it
    found = native.kernels()
    if found is None:
        why = native.why_not()
        assert why and "\n" not in why
        assert capsys.readouterr().err == f"draftsmith: native kernels off: {why}; using torch's kernels\n"
        return
    assert native.why_not() == "" and capsys.readouterr().err == ""
    assert lib.read_bytes()[:4] == b"\x7fELF" and lib.stat().st_size > 4096 and not list(lib.parent.glob("build-*"))
    x, w = torch.randn(3, 64), torch.randn(20, 64)
    assert torch.allclose(found.linear(x, w).double(), x.double() @ w.double().t(), atol=1e-4)
