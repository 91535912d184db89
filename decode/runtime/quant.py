"""Int8 drafts: dynamically quantised int8 Linear weights, one scale per output channel (fbgemm, a CPU kernel).

Cheaper draft steps; exactness is untouched since the target verifies. A lean runner's few-row steps run these
weights on draftsmith's own kernel where its row plan found that faster (`decode.runtime.native`, `LeanLM.native_rows`).
`draft_quant(model)` is the one rule for which drafts take it (on the CPU, float32, an architecture the lean runner
runs); `quantize_int8(runner)` gives a lean runner's int8 copy (`make_runner(..., quantize="int8")`; the copy stacks
each layer's q, k, v and its gate, up projections into one Linear each first: fewer calls a step, the same bits),
`quantize_linears_int8(module)` quantises any module's Linears in place (a draft head).

Int4 drafts (`quantize="int4"`, a draft spec `int4:MODEL`): every Linear's weight in groups of 32 along its input,
each group with its own scale and minimum (w = q * scale + min, q in 0..15, the pair fitted to the group by least
squares; both float16: 0.625 bytes a weight, 0.625x an int8 draft's reads), run on draftsmith's own kernel
(`decode.runtime.native`: int8 inputs, integer dot products); only where that kernel is built (`int4_ok`).

Calibrated int4 (`int4:MODEL:calib=FILE`, FILE from `write_calib`: token sequences, e.g. the target's own answers):
the same format, its nibbles chosen by GPTQ (`gptq_groups`): each column's rounding error is spread over the columns
not yet rounded, weighted by the inputs' second moments on the calibration text, so the layer's outputs, not its
weights, stay close. Built once per (weights, calibration) and cached under `<cache>/derived/int4-gptq/`.

`int4_float_weights(hf_model, calib)` reads those weights back as floats by the HF model's module names (the same
rounding, bit for bit, with no kernel needed): the frozen base `distill.train` trains LoRA adapters over with
`base_quant`, which the decoder then adds unmerged to this very runner (`decode.runtime.lora`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from draftsmith.decode.runtime import native
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_path, atomic_write_json
from draftsmith.decode.runtime.lean import lean_supported

if TYPE_CHECKING:
    from draftsmith.decode.runtime.runner import Runner


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


GROUP = native.GROUP


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


def pack_int4(weight: Tensor, refine: int = 4, hessian: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A float weight (N, K), K % GROUP == 0 -> the int4 kernel's (packed, sm) (`interleave_int4` of
    `quantize_groups`, or of `gptq_groups` given the inputs' `hessian`; `decode.runtime.native.Kernels.q4_linear`)."""
    if weight.shape[1] % GROUP:
        raise ValueError(f"int4 weights need a row length divisible by {GROUP}, got {weight.shape[1]}")
    return interleave_int4(*(quantize_groups(weight, refine) if hessian is None else gptq_groups(weight, hessian)))


GPTQ_DAMP = 0.01  # added to the Hessian's diagonal, times its mean: keeps it invertible where inputs are few
GPTQ_BLOCK = 128  # columns rounded before the rest are updated at once (a multiple of GROUP)


def gptq_groups(weight: Tensor, hessian: Tensor, *, damp: float = GPTQ_DAMP,
                block: int = GPTQ_BLOCK) -> tuple[Tensor, Tensor]:
    """`quantize_groups`'s (q, sm) for a weight (N, K) whose inputs x have second moments `hessian` (K, K) = sum x
    x^T: GPTQ. Columns are rounded in order; each one's error is taken off the columns after it in proportion to
    the inverse Hessian (the least-squares update of the layer's output on those inputs), and each group's
    (scale, minimum) is fitted (`quantize_groups`) to its columns as updated when its first one comes up. With
    hessian = I nothing is carried over: the same (q, sm) as `quantize_groups`. Float64 weights are worked in
    float64, others in float32."""
    N, K = weight.shape
    if K % GROUP or block % GROUP:
        raise ValueError(f"GPTQ needs a row length and block divisible by {GROUP}, got {K} and {block}")
    if hessian.shape != (K, K):
        raise ValueError(f"a ({N}, {K}) weight needs a ({K}, {K}) Hessian, got {tuple(hessian.shape)}")
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    H = hessian.detach().double().clone()
    diag = H.diagonal()
    diag[diag <= 0] = 1.0  # an input never seen: its column rounds on its own
    diag.add_(damp * float(diag.mean()))
    # the upper Cholesky factor of H^-1: row c / its diagonal is the update of the columns after c
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).to(dtype)
    qs, sms = [], []
    for start in range(0, N, ROWS_AT_ONCE):
        W = weight[start:start + ROWS_AT_ONCE].detach().to(dtype).clone()
        q = torch.empty(W.shape, dtype=torch.uint8)
        sm = torch.empty(W.shape[0], K // GROUP, 2, dtype=torch.float16)
        for i1 in range(0, K, block):
            i2 = min(i1 + block, K)
            W1, E1 = W[:, i1:i2], torch.empty(W.shape[0], i2 - i1, dtype=dtype)
            for i in range(i2 - i1):
                c = i1 + i
                if c % GROUP == 0:
                    pair = quantize_groups(W1[:, i:i + GROUP])[1][:, 0]
                    sm[:, c // GROUP] = pair
                    scale, lo = pair[:, 0].to(dtype), pair[:, 1].to(dtype)
                w = W1[:, i]
                qc = _nibbles(w[:, None], scale, lo)[:, 0]
                q[:, c] = qc.to(torch.uint8)
                err = (w - (qc * scale + lo)) / U[c, c]
                W1[:, i:].addr_(err, U[c, c:i2], alpha=-1)
                E1[:, i] = err
            if i2 < K:
                W[:, i2:].addmm_(E1, U[i1:i2, i2:], alpha=-1)
        qs.append(q)
        sms.append(sm)
    return torch.cat(qs), torch.cat(sms).contiguous()


def unpack_int4(packed: Tensor, sm: Tensor, n: int) -> Tensor:
    """`pack_int4`'s parts -> the float weight of its first `n` rows (n, K): q * scale + min."""
    return groups_float(*deinterleave_int4(packed, sm, n))


def groups_float(q: Tensor, sm: Tensor) -> Tensor:
    """`quantize_groups`' parts (q (N, K), sm (N, K / GROUP, 2)) -> the float32 weight they stand for (N, K):
    q * scale + min, computed as every int4 path here computes it (bit for bit)."""
    n = q.shape[0]
    sm = sm.float()
    return torch.addcmul(sm[..., 1:], q.reshape(n, -1, GROUP).float(), sm[..., :1]).reshape(n, -1)


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

    def __init__(self, linear: nn.Linear | None = None, *, many: bool = True,
                 packed: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__()
        if linear is None:  # `rows_of` fills it in
            return
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed, sm = pack_int4(linear.weight) if packed is None else packed  # `packed`: GPTQ's, calibrated
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


def quantize_int4(runner: Runner, calib: Calibration | None = None,
                  groups: dict[str, tuple[Tensor, Tensor]] | None = None) -> Runner:
    """An int4 copy of a lean runner (`Int4Linear` for every Linear, its LM head included), for drafts; with
    `calib`, each weight rounded by GPTQ on the runner's own inputs over its sequences (`calibrated_int4`); with
    `groups` ({lean Linear name: (packed, sm)}, `stored_int4_groups`: a folder that carries its own), those."""
    if not int4_ok():
        raise ValueError(f"int4 drafts need draftsmith's kernel: {native.why_not()}")
    native.tune_q4_ahead()  # the kernel's prefetch distance for this machine (timed once, saved)
    return _int4_copy(runner, calib, groups)


def _int4_copy(runner: Runner, calib: Calibration | None,
               groups: dict[str, tuple[Tensor, Tensor]] | None = None) -> Runner:
    """`quantize_int4` without asking for the kernel: packing and `Int4Linear.weight_float` need none."""
    runner = _fused_copy(runner, "int4")
    places = _linear_places(runner)
    packed = groups or (calibrated_int4(runner, places, calib) if calib is not None else {})
    for parent, child_name, name in places:
        setattr(parent, child_name, Int4Linear(getattr(parent, child_name), packed=packed.get(name)))
    return runner


def int4_float_weights(hf_model: nn.Module, calib: Calibration | None = None,
                       max_seq_len: int | None = None) -> dict[str, Tensor]:
    """{module name in `hf_model`: the float weight (out, in) it decodes with as an int4 draft}: the very rounding
    of `make_runner(hf_model, max_seq_len, quantize="int4", calib=calib)` (`quantize_int4`: every Linear of the
    decoder and the LM head; the fused q, k, v and gate, up rows split back to their modules), bit for bit
    (`groups_float` of `int4_groups`); the kernel is not needed."""
    return {name: groups_float(q, sm) for name, (q, sm) in int4_groups(hf_model, calib, max_seq_len).items()}


def int4_groups(hf_model: nn.Module, calib: Calibration | None = None,
                max_seq_len: int | None = None) -> dict[str, tuple[Tensor, Tensor]]:
    """{module name in `hf_model`: (q (out, in) uint8 in 0..15, sm (out, in / GROUP, 2) float16)}: the nibbles and
    group pairs `make_runner(hf_model, max_seq_len, quantize="int4", calib=calib)` decodes with (the fused q, k, v
    and gate, up rows split back to their modules). The model is read on the CPU in float32 (a copy where it is
    not there already: an int4 draft decodes from float32 weights on the CPU). `max_seq_len` cuts the calibration
    sequences as a runner that long does (default: the longest, up to CALIB_MAX_TOKENS)."""
    from draftsmith.decode.runtime.lean import LeanLM

    ok, why = lean_supported(hf_model.config)
    if not ok:
        raise DraftsmithError(f"int4 weights need an architecture the lean runner runs: {why}")
    bad = sorted({m.in_features for m in hf_model.modules() if isinstance(m, nn.Linear) and m.in_features % GROUP})
    if bad:
        raise DraftsmithError(f"int4 weights need Linear row lengths divisible by {GROUP}, this model has {bad}")
    param = next(hf_model.parameters())
    src = hf_model
    if param.device.type != "cpu" or param.dtype != torch.float32:
        import copy

        src = copy.deepcopy(hf_model).to("cpu", torch.float32)
    if max_seq_len is None:
        longest = max((len(s) for s in calib.sequences), default=1) if calib is not None else 1
        max_seq_len = max(1, min(longest, CALIB_MAX_TOKENS))
    lean = LeanLM(src, max_seq_len, fast_head=False)
    parts = _lean_parts(lean, src)
    names = dict(src.named_modules())
    out = {}
    for name, m in _int4_copy(lean, calib).named_modules():
        if isinstance(m, Int4Linear):
            hf = parts[name]
            q, sm = deinterleave_int4(m.packed, m.sm, m.out_features)
            rows = [names[n].out_features for n in hf]
            out.update((n, (a.contiguous(), b.contiguous())) for n, a, b in zip(hf, q.split(rows), sm.split(rows)))
    return out


def _lean_parts(lean: nn.Module, hf_model: nn.Module) -> dict[str, list[str]]:
    """{a lean runner's Linear name once fused ("lm_head", "layers.N.qkv", ...): the HF module names whose rows it
    stacks, in order}; `lean` is the unfused runner over `hf_model`'s modules."""
    from draftsmith.decode.runtime.lean import FUSED

    modules = {id(m): n for n, m in hf_model.named_modules()}
    parts: dict[str, list[str]] = {"lm_head": [modules[id(lean.lm_head)]]}
    for i, layer in enumerate(lean.layers):
        for fused, own in {**FUSED, "o": ("o",), "down": ("down",)}.items():
            parts[f"layers.{i}.{fused}"] = [modules[id(getattr(layer, a))] for a in own]
    return parts


GROUPS_FILE = "int4_groups.safetensors"  # in a model folder: the int4 groups its weights are exactly


def pack_nibbles(q: Tensor) -> Tensor:
    """q (N, K) uint8 in 0..15, K even -> (N, K / 2) uint8, two to a byte (the even column low)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(p: Tensor) -> Tensor:
    """`pack_nibbles` undone."""
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)


def save_int4_groups(folder: str | Path, groups: dict[str, tuple[Tensor, Tensor]]) -> Path:
    """`groups` ({HF module name: (q, sm)}, as `int4_groups` gives them) into FOLDER/GROUPS_FILE, atomically: a
    model folder whose weights are `groups_float` of them decodes as `int4:FOLDER` with these very groups
    (`stored_int4_groups`), not rounded again (rounding q * scale + min afresh need not give q, scale, min back)."""
    from safetensors.torch import save_file

    path = Path(folder) / GROUPS_FILE
    with atomic_path(path) as tmp:
        save_file({f"{n}.{part}": t.contiguous() for n, (q, sm) in groups.items()
                   for part, t in (("q4", pack_nibbles(q)), ("sm", sm.to(torch.float16)))}, str(tmp))
    return path


def stored_int4_groups(hf_model: nn.Module, lean: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """{lean Linear name once fused: (packed, sm)} from GROUPS_FILE in the folder `hf_model` was loaded from
    (`save_int4_groups`; {} where there is none), each checked to stand for the folder's weights exactly: a file
    that does not (weights edited after it was written) is one line, never silently used. `lean` is the unfused
    lean runner over `hf_model`."""
    from safetensors.torch import load_file

    folder = getattr(hf_model.config, "name_or_path", "") or getattr(hf_model, "name_or_path", "")
    path = Path(folder) / GROUPS_FILE if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        saved = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged file, said in one line
        raise DraftsmithError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    names = dict(hf_model.named_modules())
    out = {}
    for fused, hf in _lean_parts(lean, hf_model).items():
        qs, sms = [], []
        for n in hf:
            if f"{n}.q4" not in saved or f"{n}.sm" not in saved:
                raise DraftsmithError(f"{path}: no int4 groups for {n}: remove the file to round the weights afresh")
            q, sm = unpack_nibbles(saved[f"{n}.q4"]), saved[f"{n}.sm"]
            w = names[n].weight
            if q.shape != w.shape or sm.shape != (w.shape[0], w.shape[1] // GROUP, 2) or not torch.equal(
                    groups_float(q, sm), w.detach().float()):
                raise DraftsmithError(f"{path}: the int4 groups of {n} are not its weights in this folder (edited "
                                      "since?): remove the file to round the weights afresh")
            qs.append(q)
            sms.append(sm)
        out[fused] = interleave_int4(torch.cat(qs), torch.cat(sms))
    return out


def _linear_places(module: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """Every plain nn.Linear under `module` as (its parent, its attribute there, its full name)."""
    return [(parent, child_name, f"{parent_name}.{child_name}" if parent_name else child_name)
            for parent_name, parent in module.named_modules() for child_name, child in parent.named_children()
            if type(child) is nn.Linear]


# --- calibration: GPTQ on token sequences ----------------------------------------------------------------

CALIB_FORMAT = "draftsmith-calib-1"
GPTQ_VERSION = 1  # bump when `gptq_groups` or the Hessians change: cached weights are then never reused
CALIB_MAX_TOKENS = 8192  # tokens a calibration reads at most (the down projections' inputs are kept whole)
_KEEP_INPUTS = 1024  # a Linear with more inputs than this keeps its inputs, not their (K, K) Hessian, until used


@dataclass(frozen=True)
class Calibration:
    """Token sequences whose activations weigh GPTQ's rounding (`read_calib`); `key` hashes them."""

    sequences: tuple[tuple[int, ...], ...]
    source: str = ""

    @functools.cached_property
    def key(self) -> str:
        return hashlib.sha256(json.dumps([CALIB_FORMAT, self.sequences]).encode()).hexdigest()[:32]


def write_calib(path: str | Path, sequences: list[list[int]], *, note: str = "") -> Path:
    """Token sequences (ids of the draft's tokenizer) -> a calibration file for `int4:MODEL:calib=FILE`."""
    seqs = [[int(t) for t in s] for s in sequences if len(s)]
    if not seqs:
        raise DraftsmithError("a calibration file needs at least one non-empty token sequence")
    atomic_write_json(path, {"format": CALIB_FORMAT, "note": note, "sequences": seqs})
    return Path(path)


def read_calib(path: str | Path) -> Calibration:
    """A `write_calib` file -> its Calibration; a missing or malformed file is a one-line DraftsmithError."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DraftsmithError(f"{path}: no such calibration file (write one with decode.runtime.quant.write_calib)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path}: not a calibration file ({type(e).__name__}: {e})") from None
    seqs = data.get("sequences") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("format") != CALIB_FORMAT or not isinstance(seqs, list) or not seqs
            or not all(isinstance(s, list) and s and all(type(t) is int and t >= 0 for t in s) for s in seqs)):
        raise DraftsmithError(f"{path}: not a calibration file (expected format {CALIB_FORMAT!r} with non-empty "
                              "lists of token ids under 'sequences')")
    return Calibration(tuple(tuple(s) for s in seqs), str(path))


def _fingerprint(linears: dict[str, nn.Linear]) -> str:
    """A hash of the Linears' names, shapes and a strided sample of their weights: names the weights in cache keys
    without reading all of them."""
    h = hashlib.sha256()
    for name, m in sorted(linears.items()):
        w = m.weight.detach().float().reshape(-1)
        h.update(f"{name}:{tuple(m.weight.shape)}:".encode())
        h.update(w[::97].contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


class _Recording(nn.Module):
    """A Linear that hands its inputs to `record` as it runs (`decode.runtime.kernels.linear` calls any other layer type)."""

    def __init__(self, linear: nn.Linear, record) -> None:
        super().__init__()
        self.linear, self.record = linear, record

    def forward(self, x: Tensor) -> Tensor:
        self.record(x.detach().reshape(-1, x.shape[-1]))
        return torch.nn.functional.linear(x, self.linear.weight, self.linear.bias)


def _hessians(runner: nn.Module, places: list[tuple[nn.Module, str, str]], calib: Calibration) -> dict[str, Tensor]:
    """Each Linear's inputs over the calibration sequences (each from position 0, cut to the runner's length and to
    CALIB_MAX_TOKENS in all): their Hessian sum x x^T (K, K) float64, or for K > _KEEP_INPUTS the inputs (n, K)."""
    linears = {name: getattr(parent, child_name) for parent, child_name, name in places}
    vocab = runner.vocab_size
    if max(max(s) for s in calib.sequences) >= vocab:
        raise DraftsmithError(f"{calib.source or 'calibration'}: token ids beyond the draft's vocabulary ({vocab})")
    small = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64)
             for n, m in linears.items() if m.in_features <= _KEEP_INPUTS}
    kept: dict[str, list[Tensor]] = {n: [] for n, m in linears.items() if m.in_features > _KEEP_INPUTS}

    def record(name):
        def f(x: Tensor) -> None:
            if name in small:
                small[name].addmm_(x.double().t(), x.double())
            else:
                kept[name].append(x.float().clone())
        return f

    try:
        for parent, child_name, name in places:
            setattr(parent, child_name, _Recording(getattr(parent, child_name), record(name)))
        left = CALIB_MAX_TOKENS
        for seq in calib.sequences:
            ids = torch.tensor(seq[:min(runner.max_seq_len, left)], dtype=torch.long)
            if len(ids) == 0:
                break
            with torch.inference_mode():
                runner._forward(ids, 0, 0)
            left -= len(ids)
    finally:
        for parent, child_name, _ in places:
            layer = getattr(parent, child_name)
            if isinstance(layer, _Recording):
                setattr(parent, child_name, layer.linear)
    # (a Linear the forward never ran has H = 0: rounded plainly, `gptq_groups` treating each input as unseen)
    return {**small, **{n: torch.cat(xs) if xs else torch.zeros(0, linears[n].in_features) for n, xs in kept.items()}}


def calibrated_int4(runner: nn.Module, places: list[tuple[nn.Module, str, str]],
                    calib: Calibration) -> dict[str, tuple]:
    """{Linear name: its GPTQ (packed, sm)} for a lean runner's fused float copy (its Linears at `places`,
    `_linear_places`), from the cache when there
    (`<cache>/derived/int4-gptq/KEY.safetensors`, KEY over the weights and the calibration), else computed (a Qwen
    0.5B on ~2,000 tokens: about a minute on 2 cores) and saved for the next runner."""
    from safetensors.torch import load_file, save_file

    from draftsmith.decode.runtime.zoo import cache_dir

    linears = {name: getattr(parent, child_name) for parent, child_name, name in places}
    key = hashlib.sha256(f"{GPTQ_VERSION}:{GPTQ_DAMP}:{CALIB_MAX_TOKENS}:{_fingerprint(linears)}:{calib.key}"
                         .encode()).hexdigest()[:32]
    path = cache_dir() / "derived" / "int4-gptq" / f"{key}.safetensors"
    if path.is_file():
        try:
            saved = load_file(str(path))
            out = {n: (saved[f"{n}.packed"], saved[f"{n}.sm"]) for n in linears}
            if all(p.shape == (-(-m.out_features // RB) * RB, m.in_features // 2) for (p, _), m in
                   zip(out.values(), linears.values())):
                return out
        except Exception:  # a damaged or foreign file: computed again and replaced
            pass
    stats = _hessians(runner, places, calib)
    out = {}
    for name, m in linears.items():
        s = stats.pop(name)
        H = s if m.in_features <= _KEEP_INPUTS else s.double().t() @ s.double()
        out[name] = interleave_int4(*gptq_groups(m.weight, H))
        del s, H
    with atomic_path(path) as tmp:
        save_file({f"{n}.{part}": t.contiguous() for n, (p, sm) in out.items()
                   for part, t in (("packed", p), ("sm", sm))}, str(tmp))
    return out

