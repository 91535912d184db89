"""Where a number was measured: the machine and the library versions, recorded in every result file."""

from __future__ import annotations

import os
import platform
import sys

import torch

from draftsmith.decode.runtime.allocator import allocator_setting


def machine_info() -> dict:
    """Where a number was measured: CPU model, its vector instructions as torch uses them (AVX2 / AVX512: two
    "AMD EPYC" machines differ), cores, threads, platform."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
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
