"""Turn whatever the user names as a model into a loaded Hugging Face model and tokenizer.

    from draftsmith.decode.runtime.loading import load
    m = load("qwen2.5-coder-0.5b-instruct")   # zoo name (pulled on first use)
    m = load("path/to/hf_folder")             # a folder with config.json
    m = load("path/to/model.gguf")            # a GGUF file (converted once, cached)

Every model is loaded from a plain safetensors folder, so a load takes seconds: GGUF files are
dequantised once into the cache (`<cache>/hf/gguf-<key>/`), keyed by their size and first MiB. `eos_ids(m)`:
every id that ends a loaded model's reply.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.gguf_check import check_gguf

_KEY_BYTES = 1 << 20  # the first MiB holds the header and metadata, which name the model


@dataclass
class Loaded:
    """A model ready to run: HF causal LM in eval mode, its tokenizer, where it came from."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    path: Path  # the Hugging Face folder it was loaded from
    name: str  # zoo name, or the folder / file name the user gave


def gguf_cache_key(path: Path) -> str:
    """A short stable key for a GGUF file: sha256 of its first MiB and its size (cheap on GBs)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(_KEY_BYTES))
    digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()[:16]


def _resolve_gguf(path: Path) -> Path:
    """The cached Hugging Face folder converted from a GGUF file, converting it the first time."""
    check_gguf(path)
    out = zoo.cache_dir() / "hf" / f"gguf-{gguf_cache_key(path)}"
    if not (out / "config.json").is_file():
        zoo.convert_gguf(path, out)
    return out


def _unrecognised(spec: str, why: str) -> DraftsmithError:
    return DraftsmithError(
        f"{spec!r}: {why}; expected a zoo model name ({', '.join(zoo.known_models())}), "
        "a Hugging Face folder with config.json, or a .gguf file"
    )


def resolve(spec: str | Path) -> Path:
    """The Hugging Face folder for a zoo name, an HF folder, or a `.gguf` file.

    A zoo model not yet pulled is pulled now (progress on stderr); a GGUF file is validated,
    then converted once into the cache.
    """
    spec = str(spec)
    if spec in zoo.MODELS:
        if not zoo.is_pulled(spec):
            print(f"draftsmith: {spec} is not in the cache yet, pulling it", file=sys.stderr, flush=True)
            return zoo.pull(spec)
        return zoo.model_path(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise _unrecognised(spec, "folder has no config.json")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _resolve_gguf(path)
        raise _unrecognised(spec, "file is not a .gguf file")
    raise _unrecognised(spec, "no such zoo model, folder or file")


def _display_name(spec: str) -> str:
    return spec if spec in zoo.MODELS else Path(spec).expanduser().name


def load(spec: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Loaded:
    """Load model and tokenizer named by `spec` (see `resolve`) in eval mode on `device` (a GPU that torch does not
    see is one line, before anything loads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(f"device {device}: torch sees no GPU here (torch {torch.__version__})")
    path = resolve(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # unreadable or incomplete folder, unknown architecture
        raise DraftsmithError(f"{path}: cannot load model: {str(e).splitlines()[0]}") from None
    return Loaded(model=model.to(device).eval(), tokenizer=tokenizer, path=path, name=_display_name(str(spec)))


def eos_ids(loaded: Loaded) -> list[int]:
    """Every id that ends a reply: the tokenizer's EOS and the generation config's (chat models add one)."""
    ids: set[int] = set()
    for value in (loaded.tokenizer.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)
