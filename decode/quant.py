"""Int8 drafts: dynamically quantised int8 Linear weights, one scale per output channel (fbgemm, a CPU kernel).

Cheaper draft steps; exactness is untouched since the target verifies. A lean runner's few-row steps run these
weights on draftsmith's own kernel where its row plan found that faster (`decode.native`, `LeanLM.native_rows`).
`draft_quant(model)` is the one rule for which drafts take it (on the CPU, float32, an architecture the lean runner
runs); `quantize_int8(runner)` gives a lean runner's int8 copy (`make_runner(..., quantize="int8")`; the copy stacks
each layer's q, k, v and its gate, up projections into one Linear each first: fewer calls a step, the same bits),
`quantize_linears_int8(module)` quantises any module's Linears in place (a draft head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from decode.lean import lean_supported

if TYPE_CHECKING:
    from decode.runner import Runner


def quantize_int8(runner: Runner) -> Runner:
    """Dynamic int8 weights, one scale per output channel, for every Linear (fbgemm on x86 CPUs): for drafts,
    whose errors the target corrects."""
    if not isinstance(runner, nn.Module):
        raise ValueError("int8 quantisation needs the lean runner")
    import copy

    original = runner
    head_t, original.head_t = original.head_t, None  # the int8 head replaces it: don't copy it
    try:
        runner = copy.deepcopy(original)  # the weights are shared with the HF model: quantise a copy
    finally:
        original.head_t = head_t
    for layer in getattr(runner, "layers", ()):  # the copy owns its weights: 4 int8 Linear calls a layer, not 7
        if hasattr(layer, "fuse_projections"):
            layer.fuse_projections()
    return quantize_linears_int8(runner)


def quantize_linears_int8(module: nn.Module) -> nn.Module:
    """Every nn.Linear of `module` (in place) as dynamic int8 weights, one scale per output channel (fbgemm)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        # per output channel: a scale per row follows the weights more closely than one per matrix (SmolLM2's
        # int8 self-draft: accepted 0.55 vs 0.48 of drafted tokens on a code prompt), at no cost in speed
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        return torch.ao.quantization.quantize_dynamic(module, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)


def draft_quant(model, requested: str | None = "int8") -> str | None:
    """The `quantize=` a draft runner gets: "int8" only when asked for and the model can take it (on the CPU,
    float32, an architecture the lean runner runs: fbgemm's int8 is a CPU kernel), else None (as loaded)."""
    if requested != "int8":
        return None
    param = next(model.parameters())
    ok = param.device.type == "cpu" and param.dtype == torch.float32 and lean_supported(model.config)[0]
    return "int8" if ok else None
