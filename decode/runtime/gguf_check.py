"""Read the key metadata of a GGUF file, or say in one line why it is not a usable one.

    from draftsmith.decode.runtime.gguf_check import check_gguf
    check_gguf("model.gguf")  # {'architecture': 'llama', 'n_vocab': 49152, ...}

A GGUF file is a header (magic, version, counts), key/value metadata, tensor descriptions, then
the tensor data, aligned. `gguf.GGUFReader` parses it lazily through a memory map, so a file cut
short in its header raises an arbitrary numpy error and one cut short in its data parses fine:
we turn the first into a `DraftsmithError` and catch the second by comparing sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.decode.runtime.errors import DraftsmithError

GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic (4) + version (4) + tensor count (8) + key/value count (8)


def _invalid(path: Path, why: str) -> DraftsmithError:
    return DraftsmithError(f"{path}: not a valid GGUF file (truncated? corrupt?): {why}")


def _check_header(path: Path) -> int:
    """Fail early on a missing, empty or non-GGUF file; return its size in bytes."""
    if not path.is_file():
        raise DraftsmithError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        raise _invalid(path, f"only {size} bytes")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise _invalid(path, f"starts with {magic!r}, expected {GGUF_MAGIC!r}")
    return size


def _read(path: Path) -> Any:
    """Parse the header, metadata and tensor table; any parse failure becomes a DraftsmithError."""
    from gguf import GGUFReader  # imported here: `gguf` pulls in numpy machinery not every caller needs

    try:
        return GGUFReader(path)
    except Exception as e:  # numpy raises many kinds of errors on a short or garbled header
        detail = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        raise _invalid(path, f"header or tensor table unreadable ({detail})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """The decoded value of a metadata field, or `default` when it is absent or unreadable."""
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception:
        return default


def _field_len(reader: Any, key: str) -> int | None:
    """Number of elements of an array field (e.g. the token list), without decoding it."""
    field = reader.get_field(key)
    return None if field is None else len(field.data)


def check_gguf(path: str | Path) -> dict[str, Any]:
    """Validate a GGUF file and return the metadata that pairing and export compare.

    Keys: path, size_bytes, version, architecture, name, n_vocab (tokens in the vocabulary),
    tokenizer_model (llama.cpp vocab type: 'gpt2', 'llama', ...), tokenizer_pre, bos_token_id,
    eos_token_id, add_bos_token, add_eos_token, tensor_count, n_params (elements of all tensors),
    has_chat_template.
    Raises DraftsmithError when the file is missing, not GGUF, or truncated/corrupt.
    """
    path = Path(path)
    size = _check_header(path)
    reader = _read(path)
    data_end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=reader.data_offset)
    if data_end > size:
        raise _invalid(path, f"tensor data needs {data_end} bytes, file has {size}")
    architecture = _field(reader, "general.architecture")
    if architecture is None:
        raise _invalid(path, "no general.architecture key")
    return {
        "path": str(path),
        "size_bytes": size,
        "version": _field(reader, "GGUF.version"),
        "architecture": architecture,
        "name": _field(reader, "general.name"),
        "n_vocab": _field_len(reader, "tokenizer.ggml.tokens"),
        "tokenizer_model": _field(reader, "tokenizer.ggml.model"),
        "tokenizer_pre": _field(reader, "tokenizer.ggml.pre"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "add_bos_token": _field(reader, "tokenizer.ggml.add_bos_token"),
        "add_eos_token": _field(reader, "tokenizer.ggml.add_eos_token"),
        "tensor_count": len(reader.tensors),
        "n_params": sum(int(t.n_elements) for t in reader.tensors),
        "has_chat_template": reader.get_field("tokenizer.chat_template") is not None,
    }


def gguf_chat_template(path: str | Path) -> str | None:
    """The chat template (Jinja) stored in a GGUF file's metadata, if any."""
    path = Path(path)
    _check_header(path)
    template = _field(_read(path), "tokenizer.chat_template")
    return template if isinstance(template, str) else None
