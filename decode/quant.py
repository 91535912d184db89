"""Int8 drafts: dynamically quantised int8 Linear weights, one scale per output channel (fbgemm, a CPU kernel).

Cheaper draft steps; exactness is untouched since the target verifies. A lean runner's few-row steps run these
weights on draftsmith's own kernel where its row plan found that faster (`decode.native`, `LeanLM.native_rows`).
`draft_quant(model)` is the one rule for which drafts take it (on the CPU, float32, an architecture the lean runner
runs); `quantize_int8(runner)` gives a lean runner's int8 copy (`make_runner(..., quantize="int8")`; the copy stacks
each layer's q, k, v and its gate, up projections into one Linear each first: fewer calls a step, the same bits),
`quantize_linears_int8(module)` quantises any module's Linears in place (a draft head).

Int4 drafts (`quantize="int4"`, a draft spec `int4:MODEL`): every Linear's weight in groups of 32 along its input,
each group with its own scale and minimum (w = q * scale + min, q in 0..15; both float16: 0.625 bytes a weight,
0.625x an int8 draft's reads), run on draftsmith's own kernel (`decode.native`: int8 inputs, integer dot
products); only where that kernel is built (`int4_ok`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from decode import native
from decode.lean import lean_supported

if TYPE_CHECKING:
    from decode.runner import Runner


def quantize_int8(runner: Runner) -> Runner:
    """Dynamic int8 weights, one scale per output channel, for every Linear (fbgemm on x86 CPUs): for drafts,
    whose errors the target corrects."""
    return quantize_linears_int8(_fused_copy(runner, "int8"))


def _fused_copy(runner: Runner, what: str) -> Runner:
    """A lean runner's own copy to quantise (its weights are shared with the HF model), each layer's projections
    stacked (4 Linear calls a layer, not 7); its float one-row head layout is left out (the quantised head
    replaces it) and its input embedding stays the HF model's (a Qwen 0.5B's is 545 MB)."""
    if not isinstance(runner, nn.Module):
        raise ValueError(f"{what} quantisation needs the lean runner")
    import copy

    head_t, runner.head_t = runner.head_t, None
    embed = getattr(runner, "embed", None)  # read only: shared, not copied (a tied head's weight is still copied)
    try:
        copied = copy.deepcopy(runner, {id(embed): embed} if embed is not None else None)
    finally:
        runner.head_t = head_t
    for layer in getattr(copied, "layers", ()):
        if hasattr(layer, "fuse_projections"):
            layer.fuse_projections()
    return copied


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
    """The `quantize=` a draft runner gets: "int8" or "int4" only when asked for and the model can take it (on the
    CPU, float32, an architecture the lean runner runs: both are CPU kernels; int4 also needs draftsmith's kernel,
    else int8), else None (as loaded)."""
    if requested not in ("int8", "int4"):
        return None
    param = next(model.parameters())
    ok = param.device.type == "cpu" and param.dtype == torch.float32 and lean_supported(model.config)[0]
    if not ok:
        return None
    return "int4" if requested == "int4" and int4_ok(model) else "int8"


INT4_PREFIX = "int4:"
GROUP = native.GROUP


def split_quant(spec: str) -> tuple[str, str | None]:
    """A draft spec `int4:MODEL` -> (MODEL, "int4"); any other spec -> (spec, None)."""
    if spec.startswith(INT4_PREFIX):
        return spec[len(INT4_PREFIX):], "int4"
    return spec, None


def int4_chunk() -> int:
    """The chunk (weights) int4 rows are packed in for draftsmith's kernel here; 0 where it has none."""
    k = native.kernels()
    return 0 if k is None else k.q4_chunk


def int4_ok(model=None) -> bool:
    """Whether int4 drafts run here (draftsmith's int4 kernel is built: AVX-512BW or AVX2) and, given a model,
    whether every Linear's row length is a multiple of its chunk."""
    chunk = int4_chunk()
    if not chunk:
        return False
    return model is None or all(m.in_features % chunk == 0 for m in model.modules() if isinstance(m, nn.Linear))


def pack_int4(weight: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """A float weight (N, K), K % chunk == 0 -> (packed (N, K / 2) uint8, sm (N, K / 32, 2) float16): each group of
    32 weights of a row as q in 0..15 with the group's scale (max - min) / 15 and its minimum (float16, as stored);
    byte i of each chunk holds weight i in its low nibble and weight chunk / 2 + i in its high one
    (`decode.native.Kernels.q4_linear`)."""
    N, K = weight.shape
    if chunk % GROUP or K % chunk:
        raise ValueError(f"int4 weights need a row length divisible by {chunk}, got {K}")
    w = weight.detach().float().reshape(N, K // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    sm = torch.stack([((hi - lo) / 15).clamp_min(2 ** -14), lo], -1).half().contiguous()  # float16, as stored
    scale, lo = sm[..., 0].float(), sm[..., 1].float()
    q = ((w - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8).reshape(N, K // chunk, chunk)
    packed = q[..., :chunk // 2] | (q[..., chunk // 2:] << 4)
    return packed.reshape(N, K // 2).contiguous(), sm


def unpack_int4(packed: Tensor, sm: Tensor, chunk: int) -> Tensor:
    """`pack_int4`'s parts -> the float weight they stand for (N, K): q * scale + min."""
    N = packed.shape[0]
    b = packed.reshape(N, -1, chunk // 2)
    q = torch.cat([b & 15, b >> 4], -1).reshape(N, -1, GROUP).float()
    sm = sm.float()
    return torch.addcmul(sm[..., 1:], q, sm[..., :1]).reshape(N, -1)


class Int4Linear(nn.Module):
    """A Linear whose weight is `pack_int4`'s: 1..12 rows on draftsmith's kernel; more (a prompt's prefill, a
    teacher-forced pass) on an int8 copy of the same weights (fbgemm, a GEMM kernel: dequantising the int4 weights
    a call made a Qwen 0.5B draft's prefill cost 0.5 s more), or, with `many=False`, dequantised a slice at a time."""

    CHUNK = 8192  # output rows dequantised at once without the int8 copy (an LM head whole would be V x d floats)

    def __init__(self, linear: nn.Linear | None = None, *, many: bool = True) -> None:
        super().__init__()
        if linear is None:  # `rows_of` fills it in
            return
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.chunk = int4_chunk()
        packed, sm = pack_int4(linear.weight, self.chunk)
        self.register_buffer("packed", packed)
        self.register_buffer("sm", sm)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        self.many = self._int8_copy() if many else None

    def _int8_copy(self) -> nn.Module:
        """The dequantised weights as fbgemm's dynamic int8 Linear (one scale a row), for many rows."""
        lin = torch.nn.utils.skip_init(nn.Linear, self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(self.weight_float())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return quantize_linears_int8(nn.Sequential(lin))[0]

    @classmethod
    def rows_of(cls, layer: Int4Linear, ids: Tensor) -> Int4Linear:
        """A new layer holding output rows `ids` of `layer` (a pruned draft's head)."""
        cut = cls()
        cut.in_features, cut.out_features, cut.chunk = layer.in_features, len(ids), layer.chunk
        cut.register_buffer("packed", layer.packed[ids].contiguous())
        cut.register_buffer("sm", layer.sm[ids].contiguous())
        cut.register_buffer("bias", None if layer.bias is None else layer.bias[ids].contiguous())
        cut.many = cut._int8_copy() if layer.many is not None else None
        return cut

    def weight_float(self) -> Tensor:
        return unpack_int4(self.packed, self.sm, self.chunk)

    def forward(self, x: Tensor) -> Tensor:
        kernels = native.kernels()
        if (x.dim() == 2 and 0 < x.shape[0] <= native.MAX_ROWS and kernels is not None and x.dtype == torch.float32
                and x.shape[1] == self.in_features and x.is_contiguous() and x.device.type == "cpu"):
            # a draft step's path (97 calls a Qwen 0.5B step): the call alone, shapes checked when packed
            y = torch.empty(x.shape[0], self.out_features)
            if not kernels._q4(x.data_ptr(), self.packed.data_ptr(), self.sm.data_ptr(),
                               0 if self.bias is None else self.bias.data_ptr(), y.data_ptr(), x.shape[0],
                               self.out_features, self.in_features):
                return y
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if kernels is not None and x2.shape[0] <= native.MAX_ROWS:
            y = kernels.q4_linear(x2, self.packed, self.sm, self.bias)
        elif self.many is not None:
            y = self.many(x2)
        else:
            parts = [x2 @ unpack_int4(self.packed[i:i + self.CHUNK], self.sm[i:i + self.CHUNK], self.chunk).t()
                     for i in range(0, self.out_features, self.CHUNK)]
            y = torch.cat(parts, -1)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def quantize_int4(runner: Runner) -> Runner:
    """An int4 copy of a lean runner (`Int4Linear` for every Linear, its LM head included), for drafts."""
    if not int4_ok():
        raise ValueError(f"int4 drafts need draftsmith's kernel: {native.why_not()}")
    runner = _fused_copy(runner, "int4")
    for module in list(runner.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int4Linear(child))
    return runner
