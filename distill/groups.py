"""Train the int4 draft's own group pairs: the served int4 weights tuned in place, at no cost a draft step.

    student = group_student(copy.deepcopy(draft.model))   # every Linear the int4 draft rounds -> GroupLinear
    ... train it (`distill.train`, `base_quant="int4"` with `lora_r=0`) ...
    model, groups = plain_model(student)                 # float weights q * scale + min, and the groups themselves

An int4 draft stores each weight as q * scale + min, q in 0..15 for each group of 32 weights of a row, the pair
(scale, min) float16 (`decode.runtime.quant`). LoRA adapters over that base (QLoRA-style) serve either unmerged,
at a cost each step (float products beside the int4 kernel), or merged and rounded to int4 again, which loses what
is finer than the int4 grid. Training the pairs themselves with the nibbles frozen (as PEQA does) needs neither:
the trained draft is the same int4 format, the same kernel, the same step. Each Linear the int4 draft rounds
(the decoder's and the LM head, untied from the input embedding) becomes a `GroupLinear`: its pairs as trainable
relative changes, scale = scale0 * (1 + u), min = min0 + scale0 * v (u, v start at 0: a step of the learning rate
is the same share of every group's step); its bias and the decoder's norm weights (float in the int4 draft too)
train as they are; the input embedding stays frozen (the int4 draft reads it in float).

`plain_model` gives what the run saves: a plain HF model whose Linear weights are the trained groups' floats, the
pairs rounded to float16 as stored, and those groups (`decode.runtime.quant.save_int4_groups` beside them, so
`int4:FOLDER` decodes with exactly them rather than rounding afresh). The float folder exports as any draft.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from draftsmith.decode.runtime.quant import GROUP, Calibration, groups_float, int4_groups


def _dequant(q: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    n = q.shape[0]
    return torch.addcmul(minimum[..., None], q.reshape(n, -1, GROUP).to(scale.dtype), scale[..., None]).reshape(n, -1)


class _GroupMatmul(torch.autograd.Function):
    """y = x @ W^T with W = q * scale + min per group, W built again in the backward pass rather than kept (a Qwen
    0.5B's decoder is 358 M weights): dW = dy^T x, summed over each group's 32 weights (times q for the scale)."""

    @staticmethod
    def forward(ctx, x: Tensor, q: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, q, scale, minimum)
        return x @ _dequant(q, scale, minimum).t()

    @staticmethod
    def backward(ctx, gy: Tensor):  # type: ignore[override]
        x, q, scale, minimum = ctx.saved_tensors
        n, k = q.shape
        gx = gy @ _dequant(q, scale, minimum) if ctx.needs_input_grad[0] else None
        gw = (gy.reshape(-1, n).t() @ x.reshape(-1, k)).reshape(n, -1, GROUP)
        g_scale = (gw * q.reshape(n, -1, GROUP).to(gw.dtype)).sum(-1)
        return gx, None, g_scale, gw.sum(-1)


class GroupLinear(nn.Module):
    """A Linear whose weight is int4 groups (q frozen) with trainable pairs, relative to the ones it started from."""

    def __init__(self, q: Tensor, sm: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q.to(torch.uint8).contiguous())
        self.register_buffer("scale0", sm[..., 0].float().contiguous())
        self.register_buffer("min0", sm[..., 1].float().contiguous())
        self.u = nn.Parameter(torch.zeros_like(self.scale0))
        self.v = nn.Parameter(torch.zeros_like(self.scale0))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())

    def pairs(self) -> tuple[Tensor, Tensor]:
        """(scale, min), float32, as trained."""
        return self.scale0 * (1 + self.u), torch.addcmul(self.min0, self.scale0, self.v)

    def stored(self) -> Tensor:
        """The pairs as an int4 draft stores them: sm (out, in / GROUP, 2), float16."""
        scale, minimum = self.pairs()
        return torch.stack([scale, minimum], -1).detach().to(torch.float16)

    def forward(self, x: Tensor) -> Tensor:
        scale, minimum = self.pairs()
        shape = x.shape
        y = _GroupMatmul.apply(x.reshape(-1, shape[-1]).to(scale.dtype), self.q, scale, minimum)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def untie_head(model: nn.Module) -> None:
    """A tied LM head given a weight of its own (in place): the int4 draft rounds a copy of the head; its input
    embedding stays float. Used here and by `distill.train.quantized_base`."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is embed.weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
        model.config.tie_word_embeddings = False


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def group_student(model: nn.Module, calib: Calibration | None = None) -> nn.Module:
    """`model` (in place; float32 on the CPU, as an int4 draft loads) with every Linear its int4 draft rounds as a
    `GroupLinear` over that draft's own groups (`int4_groups`, GPTQ on `calib` where given), its LM head untied
    first; trainable: the pairs, the Linears' biases and the norm weights, nothing else. Returns it."""
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        model.float()  # the int4 groups are fitted to the float32 weights (the dtype an int4 draft decodes from)
    groups = int4_groups(model, calib)
    untie_head(model)
    model.requires_grad_(False)
    for name, (q, sm) in groups.items():
        old = model.get_submodule(name)
        _set(model, name, GroupLinear(q, sm, old.bias).to(old.weight.device))  # (groups are fitted on the CPU)
    for name, m in model.named_modules():
        if type(m).__name__.endswith("RMSNorm") or isinstance(m, nn.LayerNorm):
            for p in m.parameters(recurse=False):
                p.requires_grad_(True)
    return model


def is_group_student(model: nn.Module) -> bool:
    return any(isinstance(m, GroupLinear) for m in model.modules())


@torch.no_grad()
def plain_model(student: nn.Module) -> tuple[nn.Module, dict[str, tuple[Tensor, Tensor]]]:
    """A plain HF copy of a `group_student` (each GroupLinear an nn.Linear of `groups_float` of its stored pairs)
    and {module name: (q, sm)}: the groups that copy's int4 draft decodes with (`save_int4_groups`)."""
    names = [n for n, m in student.named_modules() if isinstance(m, GroupLinear)]
    model = copy.deepcopy(student)
    groups = {}
    for name in names:
        m = model.get_submodule(name)
        sm = m.stored()
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        lin.weight.copy_(groups_float(m.q, sm))
        if m.bias is not None:
            lin.bias.copy_(m.bias)
        _set(model, name, lin)
        groups[name] = (m.q.clone(), sm)
    model.requires_grad_(False)
    return model, groups


__all__ = ["GroupLinear", "group_student", "is_group_student", "plain_model", "untie_head"]
