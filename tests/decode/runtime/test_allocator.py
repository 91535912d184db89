import os
import subprocess
import sys

import pytest

from draftsmith.decode.runtime import allocator
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.settings import RuntimeSettings, using

# a child process frees a 64 MiB tensor and reports whether its resident memory stayed (kept for reuse) or went
# back to the OS (glibc munmaps a block that size unless told otherwise)
CHILD = """
import os, torch
from draftsmith.decode.runtime.allocator import keep_freed_memory
from draftsmith.decode.runtime.settings import configure
from draftsmith.recipes.cli import settings_from_env
configure(settings_from_env(os.environ))  # as the CLI does
setting = keep_freed_memory()
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
x = torch.ones(16 << 20)  # 64 MiB, touched
before = rss()
del x
if os.environ.get("RELEASE"):
    from draftsmith.decode.runtime.allocator import release_freed_memory
    release_freed_memory()
print(setting, "|", (before - rss()) >> 20)
"""


def _child(env_value: str | None, release: bool = False) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("DRAFTSMITH_MALLOC", "RELEASE")}
    if release:
        env["RELEASE"] = "1"
    if env_value is not None:
        env["DRAFTSMITH_MALLOC"] = env_value
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", CHILD], env={**env, "PYTHONPATH": root}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.strip().splitlines()[-1]
    setting, freed = out.split(" | ")
    return setting, int(freed)


@pytest.mark.skipif(allocator._glibc() is None or not os.path.exists("/proc/self/statm"), reason="glibc on Linux")
def test_kept_memory_stays_with_the_process_and_the_system_setting_gives_it_back():
    kept, freed_kept = _child(None)
    system, freed_system = _child("system")
    assert kept.startswith("glibc") and system == "system"
    assert freed_kept < 8  # MiB: the block stays for the next tensor
    assert freed_system > 56  # the default: the block goes back to the OS, to be faulted in again
    # a process that kept its peak gives it back when told (before it waits on a child that loads models again)
    kept, freed_released = _child(None, release=True)
    assert kept.startswith("glibc") and freed_released > 56


def test_a_bad_setting_is_a_one_line_error(monkeypatch):
    from draftsmith.recipes.cli import settings_from_env

    with pytest.raises(DraftsmithError, match="DRAFTSMITH_MALLOC: malloc must be keep or system"):
        settings_from_env({"DRAFTSMITH_MALLOC": "jemalloc"})


def test_the_setting_is_reported_and_applied_once(monkeypatch):
    monkeypatch.setitem(allocator._state, "setting", "system")
    with using(RuntimeSettings(malloc="system")):
        assert allocator.keep_freed_memory() == "system" == allocator.allocator_setting()
    calls = []
    monkeypatch.setattr(allocator, "_glibc", lambda: calls.append(1) or None)
    assert allocator.keep_freed_memory() == "system"  # no glibc: nothing changes
    monkeypatch.setitem(allocator._state, "setting", "glibc, kept")
    assert allocator.keep_freed_memory() == "glibc, kept" and len(calls) == 1  # already applied: not again
