"""Int8 drafts: dynamically quantised int8 Linear weights, one scale per output channel (fbgemm, a CPU kernel).

Cheaper draft steps; exactness is untouched since the target verifies. A lean runner's few-row steps run these
weights on draftsmith's own kernel where its row plan found that faster (`decode.native`, `LeanLM.native_rows`).
`draft_quant(model)` is the one rule for which drafts take it (on the CPU, float32, an architecture the lean runner
runs); `quantize_int8(runner)` gives a lean runner's int8 copy (`make_runner(..., quantize="int8")`; the copy stacks
each layer's q, k, v and its gate, up projections into one Linear each first: fewer calls a step, the same bits),
`quantize_linears_int8(module)` quantises any module's Linears in place (a draft head).

Int4 drafts (`quantize="int4"`, a draft spec `int4:MODEL`): every Linear's weight in groups of 32 along its input,
each group with its own scale and minimum (w = q * scale + min, q in 0..15, the pair fitted to the group by least
squares; both float16: 0.625 bytes a weight, 0.625x an int8 draft's reads), run on draftsmith's own kernel
(`decode.native`: int8 inputs, integer dot products); only where that kernel is built (`int4_ok`).
"""

from __future__ import annotations

import functools
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
    runner = quantize_linears_int8(_fused_copy(runner, "int8"))
    if native.kernels() is not None and hasattr(runner, "native_many"):
        runner.native_many = True  # its prefills on draftsmith's kernel: no activation quantisation
    return runner


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
    """What an int4 row's length must be a multiple of for draftsmith's kernel here (its group, 32); 0 where it
    has none."""
    k = native.kernels()
    return 0 if k is None else k.q4_chunk


def int4_ok(model=None) -> bool:
    """Whether int4 drafts run here (draftsmith's int4 kernel is built: AVX-512BW or AVX2) and, given a model,
    whether every Linear's row length is a multiple of its chunk."""
    chunk = int4_chunk()
    if not chunk:
        return False
    return model is None or all(m.in_features % chunk == 0 for m in model.modules() if isinstance(m, nn.Linear))


RB = native.RB  # output rows the int4 kernel interleaves: a block of them, one int32 lane each


def quantize_groups(weight: Tensor, refine: int = 4) -> tuple[Tensor, Tensor]:
    """A float weight (N, K), K % GROUP == 0 -> (q (N, K) uint8 in 0..15, sm (N, K / GROUP, 2) float16): each group
    of 32 weights of a row with its scale and minimum, as stored (w = q * scale + min).

    The pair starts at ((max - min) / 15, min); `refine` rounds then fit it by least squares to the group's weights
    given their q (w ~ scale * q + min), each group keeping the new pair only where its squared error, with the
    pair rounded to float16 as stored, is lower (`group_error`; on Gaussian weights over 5% less squared error in
    all); on the Qwen 0.5B draft, agreement with the 1.5B's greedy answers to 20 dev prompts a domain went from
    0.887 to 0.888 (code) and 0.690 to 0.696 (chat) (docs/results/pruned.md)."""
    N, K = weight.shape
    qs, sms = [], []
    for start in range(0, N, ROWS_AT_ONCE):  # bounded temporaries: an LM head is 151,936 rows
        w = weight[start:start + ROWS_AT_ONCE].detach().float().reshape(-1, K // GROUP, GROUP)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(2 ** -14)
        err = group_error(w, scale, lo)
        for _ in range(refine):
            q = _nibbles(w, scale, lo)
            qm, wm = q.mean(-1), w.mean(-1)
            var = (q - qm[..., None]).square().mean(-1)
            cov = ((q - qm[..., None]) * (w - wm[..., None])).mean(-1)
            fit_scale = torch.where(var > 0, cov / var.clamp_min(1e-12), scale).clamp_min(2 ** -14)
            fit_lo = torch.where(var > 0, wm - fit_scale * qm, lo)
            fit_err = group_error(w, fit_scale, fit_lo)
            better = fit_err < err
            scale, lo, err = (torch.where(better, a, b) for a, b in ((fit_scale, scale), (fit_lo, lo), (fit_err, err)))
        sm = torch.stack([scale, lo], -1).half()  # float16, as stored
        qs.append(_nibbles(w, sm[..., 0].float(), sm[..., 1].float()).to(torch.uint8).reshape(-1, K))
        sms.append(sm)
    return torch.cat(qs), torch.cat(sms).contiguous()


ROWS_AT_ONCE = 8192  # `quantize_groups` takes a weight's rows this many at a time


def _nibbles(w: Tensor, scale: Tensor, lo: Tensor) -> Tensor:
    """Groups (..., GROUP) against their (scale, minimum) (...) -> q = round((w - min) / scale) in 0..15, float."""
    return ((w - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15)


def group_error(w: Tensor, scale: Tensor, lo: Tensor) -> Tensor:
    """Each group's squared error (...) with its pair rounded to float16 as stored: sum (q * scale + min - w)^2."""
    s16, lo16 = scale.half().float(), lo.half().float()
    return (_nibbles(w, s16, lo16) * s16[..., None] + lo16[..., None] - w).square().sum(-1)


def interleave_int4(q: Tensor, sm: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_groups`'s (q, sm) -> the kernel's layout: rows padded with zeros to a multiple of RB and taken RB
    at a time; for each group of 32, 4 steps of 64 bytes whose byte 4 j + i holds row j's weight 8 s + i in its low
    nibble and 8 s + 4 + i in its high one (i < 4); sm as each group's RB scales then RB minimums. Shapes
    (Np, K / 2) uint8 and (Np, K / GROUP, 2) float16, Np = N rounded up to RB."""
    N, K = q.shape
    G, Np = K // GROUP, -(-N // RB) * RB
    q = torch.cat([q, q.new_zeros(Np - N, K)]) if Np > N else q
    sm = torch.cat([sm, sm.new_zeros(Np - N, G, 2)]) if Np > N else sm
    b = q.reshape(Np // RB, RB, G, 4, 2, 4)  # block, row j, group, step s, low/high half, i
    b = b[..., 0, :] | (b[..., 1, :] << 4)  # (blocks, j, G, s, i)
    packed = b.permute(0, 2, 3, 1, 4).contiguous().reshape(Np, K // 2)
    sm = sm.reshape(Np // RB, RB, G, 2).permute(0, 2, 3, 1).contiguous().reshape(Np, G, 2)
    return packed, sm


def deinterleave_int4(packed: Tensor, sm: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """`interleave_int4`'s inverse: the first `n` rows' (q (n, K) uint8, sm (n, K / GROUP, 2) float16)."""
    Np, K = packed.shape[0], packed.shape[1] * 2
    G = K // GROUP
    b = packed.reshape(Np // RB, G, 4, RB, 4).permute(0, 3, 1, 2, 4)  # block, j, G, s, i
    q = torch.stack([b & 15, b >> 4], -2).reshape(Np, K)
    sm = sm.reshape(Np // RB, G, 2, RB).permute(0, 3, 1, 2).reshape(Np, G, 2)
    return q[:n].contiguous(), sm[:n].contiguous()


def pack_int4(weight: Tensor, refine: int = 4) -> tuple[Tensor, Tensor]:
    """A float weight (N, K), K % GROUP == 0 -> the int4 kernel's (packed, sm) (`interleave_int4` of
    `quantize_groups`; `decode.native.Kernels.q4_linear`)."""
    if weight.shape[1] % GROUP:
        raise ValueError(f"int4 weights need a row length divisible by {GROUP}, got {weight.shape[1]}")
    return interleave_int4(*quantize_groups(weight, refine))


def unpack_int4(packed: Tensor, sm: Tensor, n: int) -> Tensor:
    """`pack_int4`'s parts -> the float weight of its first `n` rows (n, K): q * scale + min."""
    q, sm = deinterleave_int4(packed, sm, n)
    q = q.reshape(n, -1, GROUP).float()
    sm = sm.float()
    return torch.addcmul(sm[..., 1:], q, sm[..., :1]).reshape(n, -1)


class Int4Linear(nn.Module):
    """A Linear whose weight is `pack_int4`'s, on draftsmith's kernel for any number of float32 rows (one pass over
    the weight for 1..12 rows; a prompt's prefill or a teacher-forced pass a block of output rows at a time over
    every 12 rows). Prefills once ran on fbgemm's int8 copy of the same weights (`many`), which quantises a whole
    prompt's inputs with one scale: a Qwen 0.5B int4 draft prefilled that way agreed less often with the 1.5B's
    greedy answers (docs/results/pruned.md). The copy remains where the kernel is not built and as the source of a
    pruned head's context-id rows (`decode.pruned.head_source`), built on first use (an int4 Qwen 0.5B's copies of
    every layer would hold 0.5 GB that nothing reads); with `many=False`, rows are dequantised a slice at a time
    instead."""

    CHUNK = 8192  # output rows dequantised at once without the int8 copy (an LM head whole would be V x d floats)

    def __init__(self, linear: nn.Linear | None = None, *, many: bool = True) -> None:
        super().__init__()
        if linear is None:  # `rows_of` fills it in
            return
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed, sm = pack_int4(linear.weight)
        self.register_buffer("packed", packed)
        self.register_buffer("sm", sm)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        self._many_ok = many

    @functools.cached_property
    def many(self) -> nn.Module | None:
        """fbgemm's int8 copy of the weights (None with `many=False`), built the first time it is asked for; kept
        outside the module's children (in its `__dict__`), so it is never saved or moved with them."""
        return self._int8_copy() if self._many_ok else None

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
        cut.in_features, cut.out_features = layer.in_features, len(ids)
        q, sm = deinterleave_int4(layer.packed, layer.sm, layer.out_features)
        packed, sm = interleave_int4(q[ids], sm[ids])  # the same nibbles and pairs: the same bits out
        cut.register_buffer("packed", packed)
        cut.register_buffer("sm", sm)
        cut.register_buffer("bias", None if layer.bias is None else layer.bias[ids].contiguous())
        cut._many_ok = layer._many_ok
        return cut

    def weight_float(self, rows: slice | None = None) -> Tensor:
        """The float weight the int4 one stands for, or its output rows `rows` (a slice whose start is a multiple
        of RB)."""
        if rows is None:
            return unpack_int4(self.packed, self.sm, self.out_features)
        start, stop = rows.start or 0, min(rows.stop or self.out_features, self.out_features)
        if start % RB:
            raise ValueError(f"a slice of int4 rows starts at a multiple of {RB}, got {start}")
        end = -(-stop // RB) * RB
        return unpack_int4(self.packed[start:end], self.sm[start:end], stop - start)

    def forward(self, x: Tensor) -> Tensor:
        kernels = native.kernels()
        T = x.shape[0] if x.dim() == 2 else 0
        if (0 < T and kernels is not None and x.dtype == torch.float32
                and x.shape[1] == self.in_features and x.is_contiguous() and x.device.type == "cpu"):
            # a draft step's path (97 calls a Qwen 0.5B step), a prefill's too (the same kernel a block of rows at a
            # time: int8 inputs a row, where fbgemm's copy quantises a prompt's inputs with one scale for all of
            # them): the call alone, shapes checked when packed
            y = torch.empty(T, self.out_features)
            ptrs = self.__dict__.get("_ptrs")
            if ptrs is None or ptrs[0] != self.packed.data_ptr():  # (set again where the buffers moved)
                ptrs = self._ptrs = (self.packed.data_ptr(), self.sm.data_ptr(),
                                     0 if self.bias is None else self.bias.data_ptr())
            if not kernels._q4(x.data_ptr(), ptrs[0], ptrs[1], ptrs[2], y.data_ptr(), T, self.out_features,
                               self.in_features):
                return y
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if kernels is not None:
            y = kernels.q4_linear(x2, self.packed, self.sm, self.bias, n=self.out_features)
        elif self.many is not None:
            y = self.many(x2)
        else:
            w = self.weight_float  # (a slice of rows at a time: an LM head whole would be V x d floats)
            parts = [x2 @ w(slice(i, i + self.CHUNK)).t() for i in range(0, self.out_features, self.CHUNK)]
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
