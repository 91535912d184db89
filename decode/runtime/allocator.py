"""glibc's allocator, told to keep the memory that large tensors free (the CLI does this at start).

PyTorch's CPU tensors come from malloc. glibc serves every block above its mmap threshold (which it raises only
up to 32 MiB) with a fresh mmap, and trims freed heap back to the OS, so each large temporary page-faults its
memory in again: a (1000, 8192) float32 logits block is 32 MiB, and training a head makes dozens of them a step.
`keep_freed_memory()` raises both thresholds (`mallopt`), so freed blocks are reused instead. Measured on the 2-core
Intel Xeon here (README, "How the decoder stays exact and fast"): 1.09x the tokens per second when a head trains,
no gain when the target writes head data. The cost: the process keeps its peak memory until it exits.

`RuntimeSettings(malloc="system")` (the CLI: DRAFTSMITH_MALLOC=system) leaves the allocator as it is; where the C library is not glibc, nothing changes.
`allocator_setting()` says which holds (benchmarks record it beside the machine).
"""

from __future__ import annotations

import ctypes
import ctypes.util

from draftsmith.decode.runtime.settings import current

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_BYTES = 1 << 30  # blocks below 1 GiB come from the heap; freed heap above 2 GiB goes back to the OS

_state = {"setting": "system"}


def _glibc():
    """glibc's handle, or None (another C library, or none found)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds for this process, once; returns `allocator_setting()`."""
    if current().malloc == "keep" and _state["setting"] == "system":
        libc = _glibc()
        if libc is not None and libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1:
            libc.mallopt(M_TRIM_THRESHOLD, 2 * KEEP_BYTES)
            _state["setting"] = "glibc, freed memory kept (mmap threshold 1 GiB)"
    return _state["setting"]


def release_freed_memory() -> None:
    """Collect garbage and hand the heap's free memory back to the OS (glibc's malloc_trim): a process that kept
    its peak (`keep_freed_memory`) and now waits on a child would otherwise hold it beside the child's."""
    import gc

    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def allocator_setting() -> str:
    """What `keep_freed_memory` did in this process: "system" unless it changed glibc's thresholds."""
    return _state["setting"]
