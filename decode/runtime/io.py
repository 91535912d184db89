"""Files that are never half-written, and results read back with one error style.

    from draftsmith.decode.runtime.io import atomic_write_json, read_json
    atomic_write_json(out / "bench.json", result)          # readers see the old file or the new one, never half
    board = read_json(out / "leaderboard.json", missing_ok=True)   # None if absent; corrupt -> one-line error

Every writer goes through a temporary sibling (same folder, so the rename is atomic on POSIX) and
`os.replace`; files end up 0644 (mkstemp makes them 0600, and results are for everyone to read); a failure
(a full disk, Ctrl-C) removes the temporary and leaves the old file as it was. `atomic_dir` does the same
for a folder (`keep_existing=True` for a cache entry that another process may finish first).
`folder_identity` names a model folder in cache keys (resolved path, hashes of its JSON files, weight sizes).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.decode.runtime.errors import DraftsmithError


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """A temporary sibling of `final` to write; it replaces `final` only when the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _share(tmp: Path) -> None:
    for p in (tmp, *tmp.rglob("*")):  # mkdtemp (and safetensors) make owner-only files; runs are shared
        if p.is_symlink():
            continue
        executable = p.is_dir() or os.stat(p).st_mode & 0o100  # programs (llama-server) stay executable
        os.chmod(p, 0o755 if executable else 0o644)


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the finished folder `tmp` at `final`, replacing what was there (the old one removed after the swap)."""
    _share(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | Path, *, keep_existing: bool = False) -> Iterator[Path]:
    """A temporary sibling folder of `final` to fill; it replaces `final` only when the block succeeds.

    `keep_existing`: for a folder that any run builds the same (a cache entry): when another process put
    `final` in place first, its folder is kept and this one dropped."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if not keep_existing:
            replace_dir(tmp, final)
        elif final.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _share(tmp)
            try:
                os.rename(tmp, final)
            except OSError:  # another process finished the same folder in between
                if not final.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def png_bytes(fig) -> bytes:
    """A matplotlib figure as PNG bytes (tight layout, 110 dpi), the figure closed: every plot draftsmith writes
    goes through here."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def read_json(path: str | Path, *, missing_ok: bool = False, what: str = "file") -> Any:
    """The JSON in `path`; None when it is absent and `missing_ok`; otherwise one-line DraftsmithErrors."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return None
        raise DraftsmithError(f"{path}: no such {what}") from None
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise DraftsmithError(f"{path}: the {what} is not text (not UTF-8: a binary file?); expected JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path}: the {what} is not valid JSON (line {e.lineno}: {e.msg}); "
                              "remove it or rerun the step that writes it") from None


# what names a model folder (`folder_identity`): its small JSON files are hashed, its weights stat'ed
_IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def folder_identity(path: str | Path) -> dict[str, Any]:
    """What names a model folder in a cache key: its resolved path, hashes of its small JSON files, and the
    size and mtime of its weight files (hashing gigabytes of weights would cost more than many generations)."""
    path = Path(path).expanduser().resolve()
    files: dict[str, str] = {}
    if path.is_dir():
        for name in _IDENTITY_FILES:
            f = path / name
            if f.is_file():
                files[name] = hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir()):
            if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES):
                st = f.stat()
                files[f.name] = f"{st.st_size}:{st.st_mtime_ns}"
    return {"path": str(path), "files": files}


__all__ = ["atomic_dir", "atomic_path", "atomic_write_bytes", "atomic_write_json", "atomic_write_text",
           "folder_identity", "read_json", "replace_dir"]
