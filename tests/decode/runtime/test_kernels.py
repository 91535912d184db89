"""The Linear kernels: the layouts the lean runner picks between (two BLAS layouts, oneDNN's prepacked kernel)
compute the same numbers; a bad layout setting is refused."""

from __future__ import annotations

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.settings import RuntimeSettings, using


def test_both_linear_layouts_give_the_same_numbers_and_a_bad_setting_is_refused(monkeypatch) -> None:
    import draftsmith.decode.runtime.kernels as dk

    layer = torch.nn.Linear(320, 256, bias=True).double()  # large enough (>= 2^16 weights) to be timed on auto
    x = torch.randn(3, 320, dtype=torch.float64)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    for setting in ("xw", "wx", "auto"):
        with using(RuntimeSettings(linear=setting)):
            torch.testing.assert_close(dk.linear(x, layer), ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(DraftsmithError, match="linear layout must be one of"):
        RuntimeSettings(linear="fast")


def test_onednn_layout_matches_plain_follows_weight_changes_and_stays_out_of_autograd(monkeypatch) -> None:
    import draftsmith.decode.runtime.kernels as dk

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    layer = torch.nn.Linear(96, 80, bias=True)
    x = torch.randn(5, 96)
    with torch.no_grad():
        assert dk.dnn_usable(layer.weight)
        for rows in (1, 3, 5):  # the packed kernel, against float64
            ref = torch.nn.functional.linear(x[:rows].double(), layer.weight.double(), layer.bias.double())
            torch.testing.assert_close(dk.linear(x[:rows], layer), ref.float(), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(-2.0)  # changed in place (as an optimizer step does): the packed copy follows
        ref = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double()).float()
        torch.testing.assert_close(dk.linear(x, layer), ref, rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(80, 96))  # replaced: a new copy
        torch.testing.assert_close(dk.linear(x, layer), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
    assert not dk.dnn_usable(layer.weight)  # autograd on: the plain layout, which has a backward
    dk.linear(x, layer).sum().backward()
    assert layer.weight.grad is not None
    with torch.no_grad(), using(RuntimeSettings(linear="xw")):
        assert not dk.dnn_usable(layer.weight)
        assert not dk.dnn_usable(layer.weight.double())


def test_bfloat16_linears_run_on_every_cpu_and_take_onednn_only_where_it_has_a_bf16_path(monkeypatch) -> None:
    """oneDNN refuses bfloat16 weights on a CPU with AVX2 alone ("bf16 path needs ... avx512"): there a bfloat16
    Linear runs in BLAS; where it has the path, on oneDNN. Either way the numbers are the layer's."""
    import draftsmith.decode.runtime.kernels as dk

    layer = torch.nn.Linear(96, 80, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        has_path = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        assert dk.dnn_usable(layer.weight) == has_path
        ref = torch.nn.functional.linear(x.double(), layer.weight.double())
        torch.testing.assert_close(dk.linear(x, layer).double(), ref, rtol=2e-2, atol=2e-2)
        monkeypatch.setattr(dk, "bf16_fast", lambda: False)  # as on a CPU without the path
        assert not dk.dnn_usable(layer.weight) and dk.dnn_usable(layer.weight.float())
        torch.testing.assert_close(dk.linear(x, layer).double(), ref, rtol=2e-2, atol=2e-2)
