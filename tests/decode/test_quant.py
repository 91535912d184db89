"""`draft_quant`: the one rule for which drafts run with int8 weights (on the CPU, float32, lean-supported)."""

from __future__ import annotations

import torch

from decode.quant import draft_quant
from decode.runner import make_runner
from tests import helpers


def test_int8_only_for_a_float32_lean_draft_on_the_cpu() -> None:
    model = helpers.tiny_llama(0, 11)
    assert draft_quant(model) == draft_quant(model, "int8") == "int8"
    make_runner(model, 16, quantize=draft_quant(model))  # and the runner takes it
    assert draft_quant(model, None) is None and draft_quant(model, "none") is None  # not asked for
    assert draft_quant(helpers.tiny_llama(0, 11, dtype=torch.float64)) is None  # int8 drafts need float32
    assert draft_quant(helpers.tiny_llama(0, 11, hidden_act="gelu")) is None  # not the lean runner's
    assert draft_quant(helpers.tiny_llama(0, 11).to("meta")) is None  # not on the CPU (fbgemm is a CPU kernel)
