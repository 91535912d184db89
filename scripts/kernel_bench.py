"""Library kernels against draftsmith's own (decode.runtime.native), whole steps side by side in one process.

    .venv/bin/python scripts/kernel_bench.py --out docs/results/kernels/bench.json \\
        --markdown docs/results/kernels/bench.md

For each model (`--models`), every Linear of one forward in order (each layer's q, k, v, o, gate, up, down, then the
LM head: the weights of a whole step, larger than the caches as in a real one; `--fused` stacks q, k, v and gate,
up as an int8 / int4 draft runs them), and each row count T of `--rows` (a draft step, a verify step or a prefill
block), one whole step's Linears is timed on each backend of a dtype family:

  int4   ours (`Kernels.q4_linear` on `pack_int4`'s layout) | torch `_weight_int4pack_mm_for_cpu` (groups of 32;
         bfloat16 and float32 activations, on the same nibbles, scales and minimums) | torchao's CPU tensor over
         torch's packed weight (Int4OpaqueTensor: F.linear through torchao) where torchao imports
  int8   ours (`Kernels.linear` on the int8 rows and per-row scales) | torch `_weight_int8pack_mm` (float32 and
         bfloat16 activations, the same rows and scales) | torch.ao's dynamic int8 Linear (fbgemm: what an int8
         draft runs outside the native kernel), whose rows ours reads
  float  ours float32 (`Kernels.linear`) | F.linear float32 on oneDNN's prepacked copy (`decode.runtime.kernels.linear`)
         | plain F.linear float32 | F.linear bfloat16

Interleaved: each T in turn, `--warmup` + `--repeats` repeats, each timing every backend of the family once in an
order rotated by one each repeat; the warm-up repeats are dropped. A backend over `--slow-cap` (3) times ours in a
T's first repeat is timed in `--slow-repeats` (3) repeats only there, and over `--drop-cap` (10) times, not at the
larger T either (torch's int8pack op on float32 rows is ~10x ours and its int4pack op ~30x, both growing with T);
`--skip` leaves backends out. Per (model, family, T): every repeat's step in ms, the median, min and max, each
library backend's median over ours (ratio: < 1, the library op is faster) and the verdict of the rule "a library op
within 10% of ours (ratio <= 1.10): use it; else keep ours" (backends whose output check failed are not candidates).
Every backend's output is checked against a float64 product with the same quantised weights (float: the float32
weights) on the first Linear of each shape (every shape of the step: the first layer's and the LM head) at the
smallest and the largest T: max abs error, and that over max |reference| (over 0.1: "wrong", a packing error). A
backend that cannot run here is recorded as not run, with the reason.

The JSON (`--out`, written atomically, also printed) has the raw timings, the machine, the versions and the command;
`--markdown FILE` writes the results page's tables (`-`: stdout), `--from JSON` renders a saved run again without
timing. Memory: the float family of Qwen2.5-Coder-1.5B holds its float32 weights, oneDNN's copy and a bfloat16 one
(~16 GB). Smoke run on a tiny model folder:

    .venv/bin/python scripts/kernel_bench.py --models TINY --rows 1,2 --repeats 1 --warmup 0 --out /tmp/kb.json
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.decode.runtime import kernels as dk
from draftsmith.decode.runtime import native
from draftsmith.decode.runtime.io import atomic_write_json, atomic_write_text
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.runtime.quant import (
    GROUP,
    RB,
    deinterleave_int4,
    interleave_int4,
    quantize_groups,
    quantize_linears_int8,
)

MODELS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct")
ROWS = (1, 2, 4, 8, 12)
FAMILIES = ("int4", "int8", "float")
OURS = {"int4": "ours int4", "int8": "ours int8", "float": "ours f32"}
MARGIN = 1.10  # a library op at most this many times ours replaces ours
WRONG = 0.1  # max abs error over max |reference| above this: the backend's output is wrong (a packing error)
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
CHUNK = 8192  # output rows of a reference weight made in float64 at once
SLOW_CAP = 3.0  # a backend over this many times ours in the first repeat at some T ...
SLOW_REPEATS = 3  # ... is timed in this many repeats at that T (torch's int8pack op on float32 rows: ~10x ours)
DROP_CAP = 10.0  # ... and over this many, not run at larger T (torch's int4pack op on float32 rows: ~30x ours)


# --- the verdict: pure functions ------------------------------------------------------------------------------

def ratios(median_ms: dict[str, float], ours: str) -> dict[str, float]:
    """Each other backend's median over ours' (library / ours: < 1, the library op is faster); {} where ours has no
    time."""
    base = median_ms.get(ours)
    if not base:
        return {}
    return {name: round(ms / base, 4) for name, ms in median_ms.items() if name != ours}


def verdict(ratio: dict[str, float], *, exclude: set[str] | frozenset[str] = frozenset(),
            margin: float = MARGIN) -> dict:
    """The rule over `ratios`' output: the fastest library op (leaving out `exclude`: wrong outputs) within `margin`
    of ours (ratio <= margin) -> "use library" with its name; else "keep ours" (naming the fastest library op)."""
    cands = {name: r for name, r in ratio.items() if name not in exclude}
    if not cands:
        return {"decision": "keep ours", "library": None, "ratio": None, "text": "keep ours (no library op ran)"}
    best = min(cands, key=cands.get)
    r = cands[best]
    if r <= margin:
        return {"decision": "use library", "library": best, "ratio": r, "text": f"use {best} ({r:.2f}x ours)"}
    return {"decision": "keep ours", "library": best, "ratio": r,
            "text": f"keep ours (fastest library: {best}, {r:.2f}x ours)"}


def summarize(times_s: dict[str, list[float]], ours: str, *, exclude: set[str] | frozenset[str] = frozenset(),
              margin: float = MARGIN) -> dict:
    """One (model, family, T) cell: per backend its repeats in ms, median, min, max; the ratios; the verdict
    ("no verdict" where ours did not run)."""
    ms = {name: [round(t * 1e3, 4) for t in ts] for name, ts in times_s.items() if ts}
    med = {name: round(statistics.median(v), 4) for name, v in ms.items()}
    ratio = ratios(med, ours)
    if ours in med:
        v = verdict(ratio, exclude=exclude, margin=margin)
    else:
        v = {"decision": "no verdict", "library": None, "ratio": None, "text": "no verdict (ours not run)"}
    return {"ms": ms, "median_ms": med, "min_ms": {n: min(v_) for n, v_ in ms.items()},
            "max_ms": {n: max(v_) for n, v_ in ms.items()}, "ratio_vs_ours": ratio, "verdict": v}


# --- the weights of one step --------------------------------------------------------------------------------

@dataclass
class Lin:
    name: str
    weight: Tensor  # (N, K) float32, contiguous
    bias: Tensor | None


def step_linears(model: nn.Module, fused: bool = False) -> list[Lin]:
    """Every Linear of one forward in order: each decoder layer's q, k, v, o, gate, up, down, then the LM head
    (weights shared with the model); `fused`: q, k, v as one stacked weight and gate, up as another (copies)."""
    layers = model.get_decoder().layers
    out: list[Lin] = []
    for i, layer in enumerate(layers):
        mods = [(p, layer.get_submodule(p)) for p in LAYER_LINEARS]
        lins = [Lin(f"layers.{i}.{p}", m.weight.detach().float().contiguous(),
                    None if m.bias is None else m.bias.detach().float().contiguous()) for p, m in mods]
        if fused:
            lins = [_stack(f"layers.{i}.qkv", lins[0:3]), lins[3], _stack(f"layers.{i}.gate_up", lins[4:6]), lins[6]]
        out.extend(lins)
    head = model.get_output_embeddings()
    out.append(Lin("lm_head", head.weight.detach().float().contiguous(),
                   None if head.bias is None else head.bias.detach().float().contiguous()))
    return out


def _stack(name: str, lins: list[Lin]) -> Lin:
    bias = None if lins[0].bias is None else torch.cat([l.bias for l in lins])
    return Lin(name, torch.cat([l.weight for l in lins]), bias)


# --- backends -----------------------------------------------------------------------------------------------

@dataclass
class Backend:
    """One way to run every Linear of the step: `fns[i](x)` -> Linear i's (T, N) output for x (T, K) in `act`."""

    name: str
    act: torch.dtype
    fns: list[Callable[[Tensor], Tensor]] | None = None
    note: str = ""
    why_not: str = ""  # not run: why
    weight_bytes: int = 0
    keep: list = field(default_factory=list)  # what its closures read (kept alive with it)

    def record(self) -> dict:
        d = {"ran": self.fns is not None, "activations": str(self.act).replace("torch.", ""), "note": self.note}
        if self.fns is None:
            d["why_not"] = self.why_not
        else:
            d["weight_bytes"] = self.weight_bytes
        return d


def not_run(name: str, act: torch.dtype, why: str, note: str = "") -> Backend:
    return Backend(name, act, None, note=note, why_not=why)


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _with_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y.add_(bias)


def torchao_probe() -> dict:
    """Whether torchao imports here, and which of its CPU int4 paths work (on a tiny Linear)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao
            from torchao.prototype.quantization.int4 import Int4OpaqueTensor  # noqa: F401
    except Exception as e:  # not installed, or built for another torch
        return {"usable": False, "version": None, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    info = {"usable": True, "version": torchao.__version__, "notes": []}
    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        m = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
        quantize_(m, Int4WeightOnlyConfig(group_size=GROUP))
        m(torch.randn(2, 64, dtype=torch.bfloat16))
        info["notes"].append(f"Int4WeightOnlyConfig runs on the CPU here: {type(m[0].weight).__name__}")
    except Exception as e:
        info["notes"].append(f"Int4WeightOnlyConfig (version 2, default packing): not usable on the CPU "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); its CPU path is "
                             f"Int4OpaqueTensor (PrototypeInt4WeightOnlyConfig), timed here over torch's packed weight")
    try:
        da8w4 = "CPU" in torch._C._dispatch_dump("torchao::da8w4_linear_cpu")
    except Exception:
        da8w4 = False
    if not da8w4:
        info["notes"].append("Int8DynamicActivationInt4WeightConfig (da8w4_linear_cpu): not usable, this torchao "
                             "build has no CPU kernels")
    info["notes"].append("Int8WeightOnlyConfig: its per-row linear converts the whole int8 weight to the activation "
                         "dtype every call (Int8Tensor: w.to(dtype), then mm): not timed")
    return info


def _torch_int4(q: Tensor, sm: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_groups`' (q (N, K) uint8, sm (N, K / 32, 2) float16) -> torch's CPU int4 weight (Np, K / 2) and its
    scales and zeros (K / 32, Np, 2) float32, Np = N rounded up to 16 (its packing's multiple; zero rows added).
    torch dequantises w = (q - 8) * scale + zero, ours w = q * scale + min: zero = min + 8 * scale."""
    N, K = q.shape
    Np = -(-N // 16) * 16
    q32 = q.to(torch.int32)
    s, lo = sm[..., 0].float(), sm[..., 1].float()
    sz = torch.stack([s, lo + 8 * s], -1)
    if Np > N:
        q32 = torch.cat([q32, q32.new_zeros(Np - N, K)])
        sz = torch.cat([sz, sz.new_zeros(Np - N, *sz.shape[1:])])
    return torch._convert_weight_to_int4pack_for_cpu(q32, 1), sz.transpose(0, 1).contiguous()


def int4_backends(lins: list[Lin], refine: int, torchao: dict) -> tuple[list[Backend], Callable | None]:
    """ours on `pack_int4`'s layout; torch's int4pack op (bfloat16, float32 activations) and torchao's tensor over it,
    all on the same (q, scale, minimum) of `quantize_groups`; and the float64 reference weight rows."""
    names = (("ours int4", torch.float32), ("torch int4 bf16", torch.bfloat16), ("torch int4 f32", torch.float32),
             ("torchao int4 bf16", torch.bfloat16))
    bad_k = sorted({l.weight.shape[1] for l in lins if l.weight.shape[1] % GROUP})
    if bad_k:
        return [not_run(n, a, f"row lengths {bad_k} are not multiples of {GROUP}") for n, a in names], None
    parts = []  # per Linear: ours (packed, sm), torch's (tp, sz16, sz32), bias float32 / bfloat16, N, K
    torch_why = ""
    for l in lins:
        q, sm = quantize_groups(l.weight, refine)
        N, K = q.shape
        p = dict(N=N, K=K, b32=l.bias, b16=None if l.bias is None else l.bias.to(torch.bfloat16))
        p["packed"], p["sm"] = interleave_int4(q, sm)
        if not torch_why:
            try:
                p["tp"], p["sz32"] = _torch_int4(q, sm)
                p["sz16"] = p["sz32"].to(torch.bfloat16)
            except (AttributeError, RuntimeError) as e:  # an older torch, a shape it refuses
                torch_why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        parts.append(p)
        del q, sm
    out = []
    k = native.kernels()
    if k is None:
        out.append(not_run("ours int4", torch.float32, f"no native kernels: {native.why_not()}"))
    elif not k.q4_chunk or any(l.weight.shape[1] % k.q4_chunk for l in lins):
        out.append(not_run("ours int4", torch.float32, f"no int4 kernel here, or a row length not a multiple of "
                                                      f"its chunk {k.q4_chunk}"))
    else:
        ahead = native.tune_q4_ahead()  # as an int4 draft sets it (timed once per machine, saved)
        out.append(Backend("ours int4", torch.float32,
                           [lambda x, p=p, k=k: k.q4_linear(x, p["packed"], p["sm"], p["b32"], n=p["N"])
                            for p in parts],
                           note=f"Kernels.q4_linear (each row quantised to int8); prefetch {ahead} bytes ahead",
                           weight_bytes=sum(_nbytes(p["packed"], p["sm"]) for p in parts)))
    if torch_why:
        return out + [not_run(n, a, f"torch's CPU int4 packing failed: {torch_why}") for n, a in names[1:]], None
    mm = torch._weight_int4pack_mm_for_cpu

    def torch_fn(p: dict, z: str, bb: str) -> Callable[[Tensor], Tensor]:
        if p["tp"].shape[0] == p["N"]:
            return lambda x: _with_bias(mm(x, p["tp"], GROUP, p[z]), p[bb])
        return lambda x: _with_bias(mm(x, p["tp"], GROUP, p[z])[:, :p["N"]], p[bb])  # padded rows cut off

    for act, z, bb in ((torch.bfloat16, "sz16", "b16"), (torch.float32, "sz32", "b32")):
        out.append(Backend(f"torch int4 {'bf16' if act == torch.bfloat16 else 'f32'}", act,
                           [torch_fn(p, z, bb) for p in parts],
                           note="torch._weight_int4pack_mm_for_cpu, group 32, scales and zeros in the activation "
                                "dtype (the bias added after)",
                           weight_bytes=sum(_nbytes(p["tp"], p[z]) for p in parts)))
    if not torchao["usable"]:
        out.append(not_run("torchao int4 bf16", torch.bfloat16, f"torchao: not usable ({torchao['reason']})"))
    else:
        try:
            from torchao.prototype.quantization.int4 import Int4OpaqueTensor

            ws = [Int4OpaqueTensor(p["tp"], p["sz16"], [1, GROUP], torch.Size([p["tp"].shape[0], p["K"]]))
                  for p in parts]
            fns = [(lambda x, w=w, p=p: F.linear(x, w, p["b16"])) if p["tp"].shape[0] == p["N"]
                   else (lambda x, w=w, p=p: _with_bias(F.linear(x, w)[:, :p["N"]], p["b16"]))
                   for w, p in zip(ws, parts)]
            out.append(Backend("torchao int4 bf16", torch.bfloat16, fns, keep=ws,
                               note=f"torchao {torchao['version']} Int4OpaqueTensor over torch's packed weight "
                                    "(F.linear dispatched through torchao to _weight_int4pack_mm_for_cpu)",
                               weight_bytes=sum(_nbytes(p["tp"], p["sz16"]) for p in parts)))
        except Exception as e:
            out.append(not_run("torchao int4 bf16", torch.bfloat16, f"torchao: not usable ({type(e).__name__}: "
                                                                  f"{str(e).splitlines()[0][:160]})"))

    def ref_rows(i: int, s: int, e: int) -> Tensor:
        p, end = parts[i], -(-e // RB) * RB
        q, sm = deinterleave_int4(p["packed"][s:end], p["sm"][s:end], e - s)
        sm = sm.double()
        return (q.reshape(e - s, -1, GROUP).double() * sm[..., :1] + sm[..., 1:]).reshape(e - s, -1)

    return out, ref_rows


def int8_backends(lins: list[Lin]) -> tuple[list[Backend], Callable | None]:
    """torch.ao's dynamic int8 Linear per output channel (as an int8 draft quantises), and on its int8 rows and
    scales: ours, torch's int8pack op (float32, bfloat16 activations); and the float64 reference weight rows."""
    layers, rows = [], []
    for l in lins:
        N, K = l.weight.shape
        lin = torch.nn.utils.skip_init(nn.Linear, K, N, bias=l.bias is not None)
        lin.weight = nn.Parameter(l.weight, requires_grad=False)  # shared: quantised into fbgemm's own copy
        if l.bias is not None:
            lin.bias = nn.Parameter(l.bias, requires_grad=False)
        layer = quantize_linears_int8(nn.Sequential(lin))[0]
        layers.append(layer)
        rows.append(dk.int8_rows(layer))
    out = [Backend("torch.ao dynamic int8", torch.float32, [lambda x, m=m: dk.linear(x, m) for m in layers],
                   keep=layers, note="torch.ao.nn.quantized.dynamic.Linear per channel (fbgemm; quantises each "
                                     "call's activations to uint8), as decode.runtime.kernels.linear runs it",
                   weight_bytes=sum(l.weight.numel() for l in lins))]
    if any(r is None for r in rows):
        why = "torch.ao's int8 weights are not symmetric per-row int8 (int8_rows: None)"
        return [not_run(n, a, why) for n, a in (("ours int8", torch.float32), ("torch int8pack f32", torch.float32),
                                                  ("torch int8pack bf16", torch.bfloat16))] + out, None
    k = native.kernels()
    if k is None:
        ours = not_run("ours int8", torch.float32, f"no native kernels: {native.why_not()}")
    elif any(r[0].shape[1] % k.lanes for r in rows):
        ours = not_run("ours int8", torch.float32, f"a row length is not a multiple of the vector width {k.lanes}")
    else:
        ours = Backend("ours int8", torch.float32, [lambda x, r=r, k=k: k.linear(x, *r) for r in rows],
                       note="Kernels.linear on torch.ao's int8 rows and per-row scales (float32 activations)",
                       weight_bytes=sum(_nbytes(r[0], r[1]) for r in rows))
    mm = torch._weight_int8pack_mm
    s16 = [(r[1].to(torch.bfloat16), None if r[2] is None else r[2].to(torch.bfloat16)) for r in rows]
    lib = [Backend("torch int8pack f32", torch.float32,
                   [lambda x, r=r: _with_bias(mm(x, r[0], r[1]), r[2]) for r in rows],
                   note="torch._weight_int8pack_mm, scales float32 (the bias added after)",
                   weight_bytes=sum(_nbytes(r[0], r[1]) for r in rows)),
           Backend("torch int8pack bf16", torch.bfloat16,
                   [lambda x, r=r, s=s: _with_bias(mm(x, r[0], s[0]), s[1]) for r, s in zip(rows, s16)],
                   note="torch._weight_int8pack_mm, scales bfloat16 (the bias added after)",
                   weight_bytes=sum(_nbytes(r[0], s[0]) for r, s in zip(rows, s16)))]

    def ref_rows(i: int, s: int, e: int) -> Tensor:
        return rows[i][0][s:e].double() * rows[i][1][s:e, None].double()

    return [ours, *lib, *out], ref_rows


def float_backends(lins: list[Lin]) -> tuple[list[Backend], Callable]:
    """ours float32, F.linear float32 on oneDNN's prepacked copy (decode.runtime.kernels.linear) and plain, F.linear
    bfloat16; the float64 reference is the float32 weight."""
    k = native.kernels()
    if k is None:
        ours = not_run("ours f32", torch.float32, f"no native kernels: {native.why_not()}")
    elif any(l.weight.shape[1] % k.lanes for l in lins):
        ours = not_run("ours f32", torch.float32, f"a row length is not a multiple of the vector width {k.lanes}")
    else:
        ours = Backend("ours f32", torch.float32, [lambda x, l=l, k=k: k.linear(x, l.weight, None, l.bias)
                                                   for l in lins],
                       note="Kernels.linear, float32 weights", weight_bytes=sum(_nbytes(l.weight) for l in lins))
    if not all(dk.dnn_layout(l.weight) for l in lins):
        dnn = not_run("F.linear f32 oneDNN", torch.float32, "oneDNN's layout is not usable here "
                                                            "(no mkldnn, or DRAFTSMITH_LINEAR names another layout)")
    else:
        mods = []
        for l in lins:
            m = torch.nn.utils.skip_init(nn.Linear, l.weight.shape[1], l.weight.shape[0], bias=l.bias is not None)
            m.weight = nn.Parameter(l.weight, requires_grad=False)
            if l.bias is not None:
                m.bias = nn.Parameter(l.bias, requires_grad=False)
            mods.append(m)
        dnn = Backend("F.linear f32 oneDNN", torch.float32, [lambda x, m=m: dk.linear(x, m) for m in mods], keep=mods,
                      note="decode.runtime.kernels.linear: oneDNN's kernel on its prepacked copy (made on first call)",
                      weight_bytes=sum(_nbytes(l.weight) for l in lins))
    plain = Backend("F.linear f32", torch.float32, [lambda x, l=l: F.linear(x, l.weight, l.bias) for l in lins],
                    note="plain F.linear (BLAS)", weight_bytes=sum(_nbytes(l.weight) for l in lins))
    bf = [(l.weight.to(torch.bfloat16), None if l.bias is None else l.bias.to(torch.bfloat16)) for l in lins]
    bf16 = Backend("F.linear bf16", torch.bfloat16, [lambda x, w=w: F.linear(x, w[0], w[1]) for w in bf], keep=bf,
                   note=f"plain F.linear on bfloat16 weights (oneDNN bfloat16 on this CPU: {dk.bf16_fast()})",
                   weight_bytes=sum(_nbytes(w[0]) for w in bf))

    def ref_rows(i: int, s: int, e: int) -> Tensor:
        return lins[i].weight[s:e].double()

    return [ours, dnn, plain, bf16], ref_rows


# --- checking and timing ------------------------------------------------------------------------------------

def check_linears(lins: list[Lin]) -> list[tuple[int, Lin]]:
    """The first Linear of each (shape, bias or not) in forward order, with its index: every shape a step has."""
    seen, out = set(), []
    for i, l in enumerate(lins):
        key = (*l.weight.shape, l.bias is None)
        if key not in seen:
            seen.add(key)
            out.append((i, l))
    return out


def check_outputs(backends: list[Backend], lins: list[Lin], ref_rows: Callable | None, rows: list[int],
                  seed: int = 1) -> dict[str, dict]:
    """Each running backend's output on `check_linears` at each T of `rows` against x (float64) @ the reference
    weight^T + bias: the max abs error, that over max |reference| and the Linear where it was largest."""
    ran = [b for b in backends if b.fns is not None]
    if ref_rows is None or not ran:
        return {}
    g = torch.Generator().manual_seed(seed)
    worst = {b.name: {"max_abs_error": 0.0, "rel_error": 0.0, "worst_linear": None} for b in ran}
    for i, l in check_linears(lins):
        N, K = l.weight.shape
        xs = {T: torch.randn(T, K, generator=g) for T in rows}
        refs = {T: torch.empty(T, N, dtype=torch.float64) for T in rows}
        for s in range(0, N, CHUNK):
            e = min(s + CHUNK, N)
            w = ref_rows(i, s, e)
            for T in rows:
                refs[T][:, s:e] = xs[T].double() @ w.t()
        for T in rows:
            ref = refs[T] if l.bias is None else refs[T] + l.bias.double()
            scale = float(ref.abs().max()) or 1.0
            for b in ran:
                y = b.fns[i](xs[T].to(b.act)).double()
                err = float((y - ref).abs().max()) if y.shape == ref.shape else float("inf")
                rec = worst[b.name]
                if err / scale > rec["rel_error"] or rec["worst_linear"] is None:
                    rec.update(rel_error=err / scale, worst_linear=f"{l.name} T={T}")
                rec["max_abs_error"] = max(rec["max_abs_error"], err)
    for rec in worst.values():
        rec["rel_error"] = float(f"{rec['rel_error']:.4g}")
        rec["max_abs_error"] = float(f"{rec['max_abs_error']:.4g}")
        rec["ok"] = rec["rel_error"] <= WRONG
    return worst


def time_steps(backends: list[Backend], lins: list[Lin], rows: list[int], repeats: int, warmup: int, ours: str,
               *, cap: float = SLOW_CAP, slow_repeats: int = SLOW_REPEATS, drop_cap: float = DROP_CAP,
               seed: int = 2) -> tuple[dict[int, dict[str, list[float]]], dict[int, dict[str, str]]]:
    """Seconds of one whole step (every Linear once, in order) per T and backend, and per T the backends timed
    less, with why. Each T in turn (ascending): `warmup` + `repeats` repeats, each running every backend once in an
    order rotated by one each repeat, the first `warmup` dropped. Every backend first runs once at the smallest T
    (lazy packing, page faults). Where ours runs, a backend whose step in a T's first repeat took over `cap` times
    ours' is clearly no replacement there: it sits out that T's other warm-up repeats and is timed in `slow_repeats`
    repeats; over `drop_cap` times ours, it is not run at the larger T either (0: never)."""
    ran = [b for b in backends if b.fns is not None]
    g = torch.Generator().manual_seed(seed)
    xs32 = {T: {K: torch.randn(T, K, generator=g) for K in {l.weight.shape[1] for l in lins}} for T in rows}
    inputs = {(T, b.act): [xs32[T][l.weight.shape[1]].to(b.act) for l in lins] for T in rows for b in ran}
    for b in ran:
        for fn, x in zip(b.fns, inputs[(min(rows), b.act)]):
            fn(x)
    times: dict[int, dict[str, list[float]]] = {T: {b.name: [] for b in ran} for T in rows}
    less: dict[int, dict[str, str]] = {T: {} for T in rows}
    dropped: dict[str, str] = {}
    clock = time.perf_counter
    has_ours = any(b.name == ours for b in ran)
    for T in sorted(rows):
        live = [b for b in ran if b.name not in dropped]
        less[T].update({name: why for name, why in dropped.items()})
        slow: set[str] = set()
        for rep in range(warmup + repeats):
            r = rep % max(len(live), 1)
            first: dict[str, float] = {}
            for b in live[r:] + live[:r]:
                if b.name in slow and (rep < warmup or len(times[T][b.name]) >= slow_repeats):
                    continue
                pairs = list(zip(b.fns, inputs[(T, b.act)]))
                t0 = clock()
                for fn, x in pairs:
                    fn(x)
                first[b.name] = clock() - t0
                if rep >= warmup:
                    times[T][b.name].append(first[b.name])
            if rep == 0 and has_ours and cap:
                for name, dt in first.items():
                    ratio = dt / first[ours]
                    if name != ours and ratio > cap:
                        slow.add(name)
                        less[T][name] = f"{ratio:.1f}x ours in the first repeat: timed in {slow_repeats} repeats"
                        if drop_cap and ratio > drop_cap:
                            dropped[name] = f"not run: {ratio:.1f}x ours at T = {T}"
    return times, {T: d for T, d in less.items() if d}


BUILDERS = {"int4": lambda lins, args, ao: int4_backends(lins, args.refine, ao),
            "int8": lambda lins, args, ao: int8_backends(lins), "float": lambda lins, args, ao: float_backends(lins)}


def bench_model(name: str, args, torchao: dict, log) -> tuple[str, dict]:
    t0 = time.perf_counter()
    loaded = load(name)
    lins = step_linears(loaded.model, args.fused)
    model_name = loaded.name
    del loaded
    gc.collect()
    shapes: dict[str, int] = {}
    for l in lins:
        key = f"{l.weight.shape[0]}x{l.weight.shape[1]}"
        shapes[key] = shapes.get(key, 0) + 1
    rec = {"linears": len(lins), "weights": sum(l.weight.numel() for l in lins), "shapes_NxK": shapes,
           "load_s": round(time.perf_counter() - t0, 2), "families": {}}
    log(f"{model_name}: {len(lins)} Linears, {rec['weights'] / 1e6:.1f}M weights")
    check_rows = sorted({min(args.rows), max(args.rows)})
    for fam in args.families:
        t1 = time.perf_counter()
        backends, ref_rows = BUILDERS[fam](lins, args, torchao)
        built = time.perf_counter() - t1
        for b in backends:
            if b.name in args.skip and b.fns is not None:
                b.fns, b.keep, b.why_not = None, [], "skipped (--skip)"
        checks = check_outputs(backends, lins, ref_rows, check_rows) if not args.no_check else {}
        wrong = {n for n, c in checks.items() if not c["ok"]}
        log(f"  {fam}: built in {built:.1f} s; checks " + ", ".join(
            f"{n} {c['rel_error']:.2g}{'' if c['ok'] else ' WRONG'}" for n, c in checks.items()))
        t2 = time.perf_counter()
        times, less = time_steps(backends, lins, args.rows, args.repeats, args.warmup, OURS[fam],
                                 cap=args.slow_cap, slow_repeats=args.slow_repeats, drop_cap=args.drop_cap)
        fam_rec = {"ours": OURS[fam], "build_s": round(built, 2), "time_s": round(time.perf_counter() - t2, 2),
                   "backends": {b.name: b.record() for b in backends}, "output_check": checks,
                   "check_rows": check_rows, "checked_linears": [l.name for _, l in check_linears(lins)],
                   "timed_less": {str(T): d for T, d in less.items()},
                   "rows": {}}
        for T in args.rows:
            cell = summarize(times[T], OURS[fam], exclude=wrong)
            fam_rec["rows"][str(T)] = cell
            log(f"    T={T}: " + ", ".join(f"{n} {m:.2f}" for n, m in cell["median_ms"].items())
                + f" ms; {cell['verdict']['text']}")
        rec["families"][fam] = fam_rec
        del backends, ref_rows
        gc.collect()
    return model_name, rec


# --- the results page ---------------------------------------------------------------------------------------

def _fmt(ms: float) -> str:
    return f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def family_summary(cells: dict[str, dict]) -> str:
    """The verdicts of one (model, family) over its row counts in one line: "keep ours at T = 1, 2; use X at T = 8"."""
    groups: dict[str, list[str]] = {}
    for T, cell in cells.items():
        v = cell["verdict"]
        key = v["decision"] if v["decision"] != "use library" else f"use {v['library']}"
        groups.setdefault(key, []).append(T)
    return "; ".join(f"{k} at T = {', '.join(ts)}" for k, ts in groups.items())


def render_markdown(result: dict) -> str:
    """The tables a results page shows: per model and family, rows x backend (median ms, min-max), the fastest
    library op over ours and the verdict; then which backends did not run and the output checks."""
    m, v = result.get("machine", {}), result.get("versions", {})
    ao = result.get("torchao", {})
    margin = result.get("margin", MARGIN)
    lines = [f"Command: `{result.get('command', '')}`", "",
             f"Machine: {m.get('cpu', '?')} ({m.get('cpu_capability', '?')}), {m.get('cpu_count', '?')} CPUs, "
             f"{m.get('torch_threads', '?')} torch threads; torch {v.get('torch', '?')}, torchao "
             f"{ao.get('version') or 'not usable (' + str(ao.get('reason')) + ')'}; {result.get('started', '')}; "
             f"{result.get('repeats')} repeats after {result.get('warmup')} warm-up, interleaved; whole steps "
             f"({'q, k, v and gate, up stacked' if result.get('fused') else 'every Linear separately'}).", "",
             f"Rule: a library op within {round((margin - 1) * 100)}% of ours (median library / ours <= "
             f"{margin:.2f}) replaces ours; else ours stays. Cells: median ms of one whole step's Linears (min-max); "
             f"* timed in {result.get('slow_repeats', SLOW_REPEATS)} repeats only (over "
             f"{result.get('slow_cap', SLOW_CAP):g}x ours in that T's first repeat); - not run (over "
             f"{result.get('drop_cap', DROP_CAP):g}x ours at a smaller T, or not at all).", ""]
    for note in ao.get("notes", []):
        lines.append(f"- torchao: {note}")
    if ao.get("notes"):
        lines.append("")
    for model, rec in result.get("models", {}).items():
        for fam, fr in rec.get("families", {}).items():
            ran = [n for n, b in fr["backends"].items() if b["ran"]]
            ours = fr["ours"]
            nbytes = fr["backends"].get(ours, {}).get("weight_bytes")
            head = f"{rec['linears']} Linears, {rec['weights'] / 1e6:.1f}M weights"
            if nbytes:
                head += f"; ours reads {_size(nbytes)} a step"
                first = next(iter(fr["rows"].values()), None)
                if first and first["median_ms"].get(ours):
                    T0 = next(iter(fr["rows"]))
                    head += f" ({nbytes / first['median_ms'][ours] / 1e6:.1f} GB/s at T = {T0})"
            lines += [f"### {model}: {fam}", "", head + ".", ""]
            lines.append("| rows | " + " | ".join(ran) + " | fastest library / ours | verdict |")
            lines.append("|---:|" + "---:|" * len(ran) + "---|---|")
            full = result.get("repeats")
            for T, cell in fr["rows"].items():
                cells = []
                for n in ran:
                    if n in cell["median_ms"]:
                        mark = "*" if full and len(cell["ms"][n]) < full else ""
                        cells.append(f"{_fmt(cell['median_ms'][n])}{mark} ({_fmt(cell['min_ms'][n])}-"
                                     f"{_fmt(cell['max_ms'][n])})")
                    else:
                        cells.append("-")
                vd = cell["verdict"]
                best = f"{vd['ratio']:.2f}x {vd['library']}" if vd.get("library") else "-"
                lines.append(f"| {T} | " + " | ".join(cells) + f" | {best} | {vd['decision']} |")
            lines += ["", f"Verdict: {family_summary(fr['rows'])}.", ""]
            for n, b in fr["backends"].items():
                if not b["ran"]:
                    lines.append(f"- {n}: not run ({b['why_not']})")
            for n, c in fr.get("output_check", {}).items():
                lines.append(f"- {n}: max abs error {c['max_abs_error']:.3g}, {c['rel_error']:.3g} of max |reference| "
                             f"(worst: {c['worst_linear']}){'' if c['ok'] else ' WRONG: not a candidate'}")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _csv(cast):
    return lambda s: [cast(p) for p in s.split(",") if p.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=_csv(str), default=list(MODELS),
                    help="zoo names or model folders, comma-separated")
    ap.add_argument("--rows", type=_csv(int), default=list(ROWS), help="row counts T, comma-separated (1-12)")
    ap.add_argument("--families", type=_csv(str), default=list(FAMILIES), help="int4,int8,float")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2, help="repeats run first and dropped")
    ap.add_argument("--refine", type=int, default=0, help="quantize_groups' least-squares passes (timing does not "
                                                          "depend on the values; the runtime uses 4)")
    ap.add_argument("--fused", action="store_true", help="q, k, v and gate, up stacked (as an int draft runs them)")
    ap.add_argument("--no-check", action="store_true", help="skip the float64 output checks")
    ap.add_argument("--skip", type=_csv(str), default=[], help="backend names not to run, comma-separated")
    ap.add_argument("--slow-cap", type=float, default=SLOW_CAP, help="a backend over this many times ours in the "
                                                                    "first repeat at a T (0: never) ...")
    ap.add_argument("--slow-repeats", type=int, default=SLOW_REPEATS, help="... is timed in this many repeats there")
    ap.add_argument("--drop-cap", type=float, default=DROP_CAP, help="over this many times ours: not run at larger "
                                                                    "T (0: never)")
    ap.add_argument("--out", type=Path, help="the JSON (written atomically)")
    ap.add_argument("--markdown", help="write the results tables here ('-': stdout)")
    ap.add_argument("--from", dest="source", type=Path, help="render a saved JSON again; nothing is timed")
    args = ap.parse_args()
    if args.source is not None:
        md = render_markdown(json.loads(args.source.read_text(encoding="utf-8")))
        if args.markdown and args.markdown != "-":
            atomic_write_text(args.markdown, md)
        else:
            print(md, end="")
        return
    bad = [f for f in args.families if f not in FAMILIES]
    if bad or not args.rows or min(args.rows) < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error(f"families from {FAMILIES}, rows >= 1, repeats >= 1, warmup >= 0 (got {args.families}, "
                 f"{args.rows}, {args.repeats}, {args.warmup})")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    torch.manual_seed(0)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    torchao = torchao_probe()
    log(f"torchao: {torchao.get('version') or 'not usable: ' + torchao['reason']}")
    result = {
        "command": shlex.join([".venv/bin/python", "scripts/kernel_bench.py", *sys.argv[1:]]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": started, "rows": args.rows, "repeats": args.repeats, "warmup": args.warmup,
        "fused": args.fused, "margin": MARGIN, "slow_cap": args.slow_cap, "slow_repeats": args.slow_repeats,
        "drop_cap": args.drop_cap,
        "wrong_above": WRONG, "torchao": torchao,
        "native": {"built": native.kernels() is not None, "why_not": native.why_not(),
                   "lanes": getattr(native.kernels(), "lanes", None)},
        "models": {},
    }
    with torch.no_grad():
        for name in args.models:
            model_name, rec = bench_model(name, args, torchao, log)
            result["models"][model_name] = rec
            gc.collect()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["machine"] = machine_info()
    result["versions"] = {**versions(), "torchao": torchao.get("version")}
    if args.out:
        atomic_write_json(args.out, result)
    print(json.dumps(result, indent=1))
    if args.markdown:
        md = render_markdown(result)
        if args.markdown == "-":
            print(md, end="")
        else:
            atomic_write_text(args.markdown, md)


if __name__ == "__main__":
    main()
