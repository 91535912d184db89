"""Device hygiene: every tensor the decoder and the sampling math create follows its inputs' device, so the sampled
path runs where the models run (a GPU). Checked without a GPU: by reading the modules (no tensor constructor without
`device=`), and by running the pure sampling functions on the `meta` device (a tensor made on the CPU beside a meta
input raises there, as it would beside a CUDA one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from draftsmith.decode import sampling
from draftsmith.decode.speculative import lookup_q

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["decode/sampling.py", "decode/speculative.py", "decode/lookup.py"]  # the decoder and its sampling math
CONSTRUCTORS = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
                "linspace", "eye"}


def constructors_without_device(source: str) -> list[int]:
    """Lines of `torch.<constructor>(...)` calls that do not say `device=`."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CONSTRUCTORS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            bad.append(node.lineno)
    return bad


@pytest.mark.parametrize("module", MODULES)
def test_no_tensor_constructor_in_the_decoder_lacks_a_device(module: str) -> None:
    bad = constructors_without_device((ROOT / module).read_text())
    assert not bad, f"{module}: torch constructors without device= at lines {bad}"


def test_the_reader_catches_a_constructor_without_a_device() -> None:
    """The negative control: the check is not vacuous."""
    assert constructors_without_device("import torch\nx = torch.arange(3)\ny = torch.zeros(2, device=d)\n") == [2]
    assert constructors_without_device("import torch\ny = torch.rand(2, generator=g, device=x.device)\n") == []


def test_the_sampling_math_stays_on_its_inputs_device() -> None:
    """On `meta` (shapes and devices only): the residual, the acceptance ratio and the lookup law come out on the
    inputs' device; a CPU tensor mixed in would raise. (The functions that read values back, `verify` and the
    candidates' acceptance, cannot run on meta: the reading check above covers them.)"""
    p = torch.rand(3, 11, device="meta").softmax(-1)
    q = torch.rand(3, 11, device="meta").softmax(-1)
    assert sampling.residual(p, q).device.type == "meta"
    assert all(t.device.type == "meta" for t in lookup_q([2, 5], 11, p))
    assert sampling.accept_probability(p[:, 1], q[:, 1]).device.type == "meta"
