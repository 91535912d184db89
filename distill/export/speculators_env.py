"""speculators (vLLM's EAGLE-3 library) in a virtual environment of its own: the real reader of our speculators
folders (tests/distill/export/test_speculators.py).

    .venv/bin/python -m draftsmith.distill.export.speculators_env      # build it once (1.5-3 minutes), print its python

    from draftsmith.distill.export.speculators_env import speculators_forward
    versions = speculators_forward([(vllm_dir, out_file)], inputs_file, steps=3)   # see speculators_forward.py

speculators 0.9.0 pins transformers <= 5.19 and datasets <= 5.1 (draftsmith runs 5.24 and 5.2) and lists torchvision
and torchaudio, so it cannot share our venv. Its own one lives at `<cache>/envs/speculators-0.9.0`
($DRAFTSMITH_SPECULATORS_ENV puts it elsewhere) and is reused once there. It is built in a temporary sibling folder
and renamed into place only when every step below passed, so an interrupted or failed build leaves nothing that a
later run reuses (one build at a time, under a lock). The steps (pip as `ENV/bin/python -I -m pip install ...`):

    python -m venv ENV
    pip install torch==2.13.0                      # first: the CPU build on local disk, never a CUDA one
    pip install --no-deps speculators==0.9.0
    pip install torch==2.13.0 <REQUIREMENTS>       # torch repeated so the resolver cannot move it

REQUIREMENTS are speculators 0.9.0's declared requirements less torchvision and torchaudio: none of its modules
imports either, and PyPI's builds pull a CUDA torch or fail to import beside the CPU one. Then the consumer script
imports speculators in the new env (`speculators_forward.py --versions`) before the rename. The venv is built at
the temporary path: always run it as `ENV/bin/python -m ...` (its console scripts' first lines name that path).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_dir, atomic_write_json

VERSION = "0.9.0"
TORCH = "torch==2.13.0"  # the CPU build on this machine's disk (scripts/setup.sh installs the same)
REQUIREMENTS = ("aiohttp", "click", "datasets>=4.0.0,<=5.1.0", "httpx", "huggingface-hub", "loguru>=0.7.2,<=0.7.3",
                "numpy>=2.0.0,<=2.5.4", "openai>=2.0.0", "protobuf", "psutil", "pydantic>=2.0.0",
                "pydantic-settings>=2.0.0", "rich", "safetensors", "tqdm>=4.66.3,<=4.70.1", "transformers==5.19.0",
                "typer>=0.12.0", f"hs-connectors=={VERSION}")
SCRIPT = Path(__file__).with_name("speculators_forward.py")
BUILD_COMMAND = ".venv/bin/python -m draftsmith.distill.export.speculators_env"


def env_dir() -> Path:
    """$DRAFTSMITH_SPECULATORS_ENV, else `<cache>/envs/speculators-0.9.0`."""
    override = os.environ.get("DRAFTSMITH_SPECULATORS_ENV")
    return Path(override).expanduser() if override else zoo.cache_dir() / "envs" / f"speculators-{VERSION}"


def env_python(env: Path | None = None) -> Path:
    return (env or env_dir()) / "bin" / "python"


@contextlib.contextmanager
def _lock(env: Path) -> Iterator[None]:
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f".{env.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(args: list[str], log: Path, what: str) -> None:
    """One build step; its output goes to `log`; a failure is one line naming the step and pip's last words."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(args)}\n")
        out.flush()
        rc = subprocess.call(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if rc != 0:
        tail = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()][-2:]
        raise DraftsmithError(f"cannot build speculators {VERSION}'s environment: {what} exited {rc} "
                              f"({' | '.join(tail)}; log {log}); retry with `{BUILD_COMMAND}`")


def build_steps(env: Path) -> list[tuple[str, list[str]]]:
    """(what, argument list) for each step that builds the env at `env` (the temporary folder)."""
    py = str(env_python(env))
    pip = [py, "-I", "-m", "pip", "install", "--disable-pip-version-check"]  # -I: no PYTHONPATH of ours in there
    return [("python -m venv", [sys.executable, "-m", "venv", str(env)]),
            (f"pip install {TORCH}", [*pip, TORCH]),
            (f"pip install --no-deps speculators=={VERSION}", [*pip, "--no-deps", f"speculators=={VERSION}"]),
            ("pip install speculators' requirements", [*pip, TORCH, *REQUIREMENTS]),
            ("importing speculators", [py, "-I", str(SCRIPT), "--versions"])]


def build_env(env: Path, *, progress: bool = True) -> None:
    """Build the env beside `env` and rename it into place (see the module's docstring)."""
    if sys.version_info < (3, 11):
        raise DraftsmithError(f"speculators {VERSION} needs Python >= 3.11; this is {sys.version.split()[0]}")
    log = env.parent / f"{env.name}.build.log"
    if progress:
        print(f"draftsmith: building speculators {VERSION}'s environment at {env} (1.5-3 minutes, once; log {log})",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    log.write_text("")
    with atomic_dir(env, keep_existing=True) as tmp:
        for what, args in build_steps(tmp):
            _run(args, log, what)
        atomic_write_json(tmp / "draftsmith-env.json", {"speculators": VERSION, "requirements": [TORCH, *REQUIREMENTS],
                                                        "build_seconds": round(time.perf_counter() - t0, 1)})


def speculators_python(*, progress: bool = True) -> Path:
    """The env's python, building the env first when it is not there (one-line DraftsmithError if that fails)."""
    env = env_dir()
    if not (env / "draftsmith-env.json").is_file():
        with _lock(env):
            if env.exists() and not (env / "draftsmith-env.json").is_file():
                raise DraftsmithError(f"{env} exists but is no environment draftsmith built (no draftsmith-env.json): "
                                      "remove it, or point DRAFTSMITH_SPECULATORS_ENV elsewhere")
            if not env.exists():
                build_env(env, progress=progress)
    return env_python(env)


def speculators_forward(jobs: list[tuple[str | Path, str | Path]], inputs: str | Path, *, steps: int,
                        attn: tuple[str, ...] = ("default",), timeout: float = 600) -> dict[str, str]:
    """Run speculators_forward.py in the env: each (folder, out) of `jobs` loaded by speculators, fed `inputs`, its
    logits written to `out`. Returns the versions it ran on. One-line DraftsmithError with stderr's tail on failure."""
    args = [str(speculators_python()), "-I", str(SCRIPT), "--inputs", str(inputs), "--steps", str(steps),
            "--attn", ",".join(attn), *(str(p) for job in jobs for p in job)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # the verifier is a local folder
    try:
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DraftsmithError(f"speculators did not finish the folders in {timeout:.0f} s") from None
    if r.returncode != 0:
        tail = [line.strip() for line in r.stderr.splitlines() if line.strip()][-3:]
        raise DraftsmithError(f"speculators could not run the folder (exit {r.returncode}): {' | '.join(tail)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(speculators_python())
