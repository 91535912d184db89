"""Where a number was measured: the machine and the library versions, recorded in every result file."""

from __future__ import annotations

import os
import platform
import sys

import torch

from draftsmith.decode.runtime.allocator import allocator_setting


# the CPU features that decide which matrix arithmetic is fast (two "Intel Xeon" hosts differ by AMX: there bfloat16
# matmuls run about 2x float32, without it slower than float32)
MATRIX_FLAGS = ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_flags(cpuinfo: str) -> list[str]:
    """The `MATRIX_FLAGS` the first "flags" line of a /proc/cpuinfo text names, in that order."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in MATRIX_FLAGS if f in have]
    return []


def machine_info() -> dict:
    """Where a number was measured: CPU model, its vector instructions as torch uses them (AVX2 / AVX512: two
    "AMD EPYC" machines differ) and its matrix features (`cpu_flags`: VNNI, bfloat16, AMX), cores, threads,
    platform."""
    cpu, text = platform.processor() or "", ""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        pass
    for line in text.splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    info = {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(text),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "allocator": allocator_setting(),
    }
    return info


def versions() -> dict:
    import transformers

    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("draftsmith")
    except PackageNotFoundError:
        ours = "unknown"
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "draftsmith": ours}
