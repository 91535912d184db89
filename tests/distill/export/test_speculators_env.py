"""speculators' own environment (distill.export.speculators_env) without building it: the pip steps keep torch on
the CPU build, a failed or interrupted build leaves nothing to reuse, a built one is reused, a foreign folder is
refused. The real build and the real reader: tests/distill/export/test_speculators.py."""

from __future__ import annotations

import sys

import pytest

import draftsmith.distill.export.speculators_env as se
from draftsmith.decode.runtime.errors import DraftsmithError


@pytest.fixture()
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_SPECULATORS_ENV", str(tmp_path / "envs" / "spec"))
    return tmp_path / "envs" / "spec"


def test_torch_is_the_cpu_build_first_and_pinned_throughout(env) -> None:
    steps = se.build_steps(env)
    installs = [args[args.index("install") + 1 :] for _, args in steps if "install" in args]
    assert installs[0][-1] == "torch==2.13.0"  # before anything that depends on torch
    assert installs[1][-2:] == ["--no-deps", "speculators==0.9.0"]
    assert "torch==2.13.0" in installs[2]  # the resolver may not move it
    every = " ".join(" ".join(args) for _, args in steps)
    assert "torchvision" not in every and "torchaudio" not in every
    assert not any(r.split("=")[0].split(">")[0] == "torch" for r in se.REQUIREMENTS)
    assert steps[-1][1][-2:] == [str(se.SCRIPT), "--versions"]  # the import check runs before the rename


@pytest.mark.parametrize("stop", [DraftsmithError("pip failed"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_build_leaves_nothing_to_reuse(env, monkeypatch, stop) -> None:
    def steps(tmp):  # the first step leaves a half env behind, the second stops the build
        return [("half", [sys.executable, "-c", f"open({str(tmp / 'bin')!r}, 'w').write('x')"]), ("stop", ["x"])]

    real_run = se._run

    def run(args, log, what):
        if what == "stop":
            raise stop
        real_run(args, log, what)

    monkeypatch.setattr(se, "build_steps", steps)
    monkeypatch.setattr(se, "_run", run)
    with pytest.raises(type(stop)):
        se.speculators_python(progress=False)
    assert not env.exists()
    assert [p.name for p in env.parent.iterdir() if not p.name.endswith((".lock", ".build.log"))] == []


def test_a_failing_step_is_one_line_naming_the_step_and_the_command(env, monkeypatch) -> None:
    fail = [("pip install x", [sys.executable, "-c", "raise SystemExit(3)"])]
    monkeypatch.setattr(se, "build_steps", lambda tmp: fail)
    with pytest.raises(DraftsmithError) as e:
        se.speculators_python(progress=False)
    assert "\n" not in str(e.value) and "pip install x exited 3" in str(e.value) and se.BUILD_COMMAND in str(e.value)
    assert not env.exists()


def test_a_built_env_is_reused_and_a_foreign_folder_refused(env, monkeypatch) -> None:
    monkeypatch.setattr(se, "build_env", lambda *a, **k: pytest.fail("built again"))
    env.mkdir(parents=True)
    with pytest.raises(DraftsmithError, match="no environment draftsmith built"):
        se.speculators_python(progress=False)
    (env / "draftsmith-env.json").write_text("{}")
    assert se.speculators_python(progress=False) == env / "bin" / "python"


def test_the_default_place_is_in_the_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("DRAFTSMITH_SPECULATORS_ENV", raising=False)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    assert se.env_dir() == tmp_path / "envs" / "speculators-0.9.0"
