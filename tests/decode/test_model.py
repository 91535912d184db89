"""`draft_quant`: the one rule for which drafts run with int8 weights (on the CPU, float32, lean-supported); the
two Linear layouts the lean runner picks between compute the same numbers."""

from __future__ import annotations

import pytest
import torch

from decode.model import draft_quant, make_runner
from tests import helpers


def test_int8_only_for_a_float32_lean_draft_on_the_cpu() -> None:
    model = helpers.tiny_llama(0, 11)
    assert draft_quant(model) == draft_quant(model, "int8") == "int8"
    make_runner(model, 16, quantize=draft_quant(model))  # and the runner takes it
    assert draft_quant(model, None) is None and draft_quant(model, "none") is None  # not asked for
    assert draft_quant(helpers.tiny_llama(0, 11, dtype=torch.float64)) is None  # int8 drafts need float32
    assert draft_quant(helpers.tiny_llama(0, 11, hidden_act="gelu")) is None  # not the lean runner's
    assert draft_quant(helpers.tiny_llama(0, 11).to("meta")) is None  # not on the CPU (fbgemm is a CPU kernel)


def test_both_linear_layouts_give_the_same_numbers_and_a_bad_setting_is_refused(monkeypatch) -> None:
    import decode.model as dm

    layer = torch.nn.Linear(320, 256, bias=True).double()  # large enough (>= 2^16 weights) to be timed on auto
    x = torch.randn(3, 320, dtype=torch.float64)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    for setting in ("xw", "wx", "auto"):
        monkeypatch.setenv("DRAFTSMITH_LINEAR", setting)
        torch.testing.assert_close(dm._linear(x, layer), ref, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("DRAFTSMITH_LINEAR", "fast")
    with pytest.raises(ValueError, match="DRAFTSMITH_LINEAR"):
        dm._linear(x, layer)


def test_onednn_layout_matches_plain_follows_weight_changes_and_stays_out_of_autograd(monkeypatch) -> None:
    import decode.model as dm

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setenv("DRAFTSMITH_LINEAR", "auto")
    layer = torch.nn.Linear(96, 80, bias=True)
    x = torch.randn(5, 96)
    with torch.no_grad():
        assert dm.dnn_usable(layer.weight)
        for rows in (1, 3, 5):  # the packed kernel, against float64
            ref = torch.nn.functional.linear(x[:rows].double(), layer.weight.double(), layer.bias.double())
            torch.testing.assert_close(dm._linear(x[:rows], layer), ref.float(), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(-2.0)  # changed in place (as an optimizer step does): the packed copy follows
        ref = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double()).float()
        torch.testing.assert_close(dm._linear(x, layer), ref, rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(80, 96))  # replaced: a new copy
        torch.testing.assert_close(dm._linear(x, layer), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
    assert not dm.dnn_usable(layer.weight)  # autograd on: the plain layout, which has a backward
    dm._linear(x, layer).sum().backward()
    assert layer.weight.grad is not None
    monkeypatch.setenv("DRAFTSMITH_LINEAR", "xw")
    with torch.no_grad():
        assert not dm.dnn_usable(layer.weight)
        assert not dm.dnn_usable(layer.weight.double())
