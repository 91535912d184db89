"""machine_info and versions: where a number was measured, recorded in every result file."""

from __future__ import annotations

import os
import sys

import torch
import transformers

from draftsmith.decode.runtime.allocator import allocator_setting
from draftsmith.decode.runtime.machine import MATRIX_FLAGS, cpu_flags, machine_info, versions


def test_machine_info_and_versions_say_where_a_number_was_measured() -> None:
    info = machine_info()
    assert set(info) == {"platform", "cpu", "cpu_capability", "cpu_flags", "cpu_count", "torch_threads", "cuda",
                         "allocator"}
    assert set(info["cpu_flags"]) <= set(MATRIX_FLAGS)
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512
    assert info["allocator"] == allocator_setting()
    assert info["cpu_count"] == os.cpu_count() and info["torch_threads"] == torch.get_num_threads()
    assert isinstance(info["cpu"], str) and (info["cuda"] is None) == (not torch.cuda.is_available())
    v = versions()
    assert set(v) == {"python", "torch", "transformers", "draftsmith"}
    assert v["python"] == sys.version.split()[0] and v["torch"] == torch.__version__
    assert v["transformers"] == transformers.__version__ and v["draftsmith"]


def test_cpu_flags_reads_the_matrix_features_of_the_first_flags_line() -> None:
    text = ("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu sse avx512f amx_tile avx512_vnni amx_bf16 sse2\n"
            "processor\t: 1\nflags\t\t: fpu avx512_bf16\n")
    assert cpu_flags(text) == ["avx512_vnni", "amx_bf16", "amx_tile"]  # MATRIX_FLAGS' order, the first CPU's line
    assert cpu_flags("model name : x\n") == [] and cpu_flags("flags : avx2 fma\n") == []
