"""LoRA adapters served unmerged: a lean runner's Linears (int4, int8 or float) plus float adapters on top.

    adapter = read_adapter("runs/x/distill/best-adapter")   # what peft saves: adapter_config.json + safetensors
    runner = with_lora(make_runner(hf, 512, quantize="int4"), adapter)   # a draft spec int4:MODEL:lora=FOLDER

A layer's output is its base Linear's (`decode.runtime.kernels.linear`: the int4 kernel for `Int4Linear`) plus
scale * (x @ A^T) @ B^T for every adapter on its rows (`LoraLinear`), in float32 for any number of rows (a draft
step's 1..12, a prefill's more). A fused Linear of the lean runner (q, k, v as `qkv`, gate, up as `gate_up`:
`decode.runtime.quant`) takes each projection's adapter on its own rows. The adapter folder is read with
safetensors (never unpickled); peft's module names (`...layers.N.self_attn.q_proj.lora_A.weight`) name the lean
layer and projection. Adapters on other modules (the LM head, embeddings), DoRA, per-module alphas and biases are
refused in one line: the draft's training (`distill.train`, `base_quant`) puts them on the decoder's Linears only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.kernels import linear

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_([AB])\.weight")


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter read from a folder: {(layer, projection): (A (r, in), B (out, r) times its scale)}, float32."""

    pairs: dict[tuple[int, str], tuple[Tensor, Tensor]]
    source: str = ""

    def delta(self, layer: int, projection: str) -> Tensor:
        """The weight change the adapter makes to one projection: scale * B @ A (out, in)."""
        a, b = self.pairs[(layer, projection)]
        return b @ a


def adapter_scale(config: dict, r: int) -> float:
    """peft's scale of a rank-r adapter: lora_alpha / r, or / sqrt(r) with use_rslora."""
    alpha = float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def check_adapter_config(folder: str | Path) -> dict:
    """The adapter folder's config, checked (a LoRA adapter this runtime adds as it trained); one line otherwise."""
    folder = Path(folder).expanduser()
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DraftsmithError(f"{folder}: no LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, as peft saves "
                              "them, e.g. RUN/distill/best-adapter)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{folder / ADAPTER_CONFIG}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise DraftsmithError(f"{folder}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    unsupported = [key for key in ("use_dora", "fan_in_fan_out", "lora_bias", "alpha_pattern", "modules_to_save",
                                   "trainable_token_indices") if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']!r}")
    if unsupported:
        raise DraftsmithError(f"{folder}: this adapter uses {', '.join(unsupported)}; the unmerged runtime adds "
                              "plain LoRA (B A) only: merge it instead (distill.export)")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise DraftsmithError(f"{folder}: no {ADAPTER_WEIGHTS} (the adapter's weights, as peft saves them)")
    return config


def read_adapter(folder: str | Path) -> Adapter:
    """A peft LoRA folder -> its Adapter, checked: every tensor a decoder projection's A or B, in pairs of one rank."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    config = check_adapter_config(folder)
    try:
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except Exception as e:  # noqa: BLE001 - a damaged file, said in one line
        raise DraftsmithError(f"{folder / ADAPTER_WEIGHTS}: unreadable ({type(e).__name__}: {e})") from None
    found: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise DraftsmithError(f"{folder}: adapter tensor {key!r} is not on a decoder projection "
                                  f"({'/'.join(PROJECTIONS)}_proj of a layer): not served unmerged")
        found.setdefault((int(m[1]), m[2]), {})[m[3]] = t.detach().float()
    pairs = {}
    for (layer, proj), ab in sorted(found.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise DraftsmithError(f"{folder}: layer {layer} {proj}_proj needs lora_A (r, in) and lora_B (out, r)")
        pairs[(layer, proj)] = (a.contiguous(), (b * adapter_scale(config, a.shape[0])).contiguous())
    if not pairs:
        raise DraftsmithError(f"{folder}: the adapter holds no LoRA weights")
    return Adapter(pairs, str(folder))


class LoraLinear(nn.Module):
    """A Linear `base` (any layer `decode.runtime.kernels.linear` runs) plus adapters on slices of its output rows:
    y = base(x); y[:, off:off + n] += (x @ A^T) @ B^T for each (off, A, B) in `parts` (B carries the scale). The
    A's of all parts are stacked: one product with x, then one per part."""

    def __init__(self, base: nn.Module, parts: list[tuple[int, Tensor, Tensor]]) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_buffer("a_t", torch.cat([a for _, a, _ in parts]).t().contiguous())  # (in, R)
        self.slices: list[tuple[int, int, int, int]] = []  # (row offset, rows, first rank, last rank)
        r0 = 0
        for i, (off, a, b) in enumerate(parts):
            self.register_buffer(f"b_t{i}", b.t().contiguous())  # (r, n)
            self.slices.append((off, b.shape[0], r0, r0 + a.shape[0]))
            r0 += a.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        y = linear(x, self.base)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        a_t = self.a_t if self.a_t.dtype == x.dtype else self.a_t.to(x.dtype)
        xa = (x2 @ a_t).to(y.dtype)  # (T, R)
        for i, (off, n, r0, r1) in enumerate(self.slices):
            b_t = getattr(self, f"b_t{i}")
            b_t = b_t if b_t.dtype == y.dtype else b_t.to(y.dtype)
            if off == 0 and n == y2.shape[1]:
                y2.addmm_(xa[:, r0:r1], b_t)
            else:
                y2[:, off:off + n].addmm_(xa[:, r0:r1], b_t)
        return y


def _layer_parts(layer: nn.Module) -> dict[str, list[tuple[str, int]]]:
    """A lean layer's Linear attributes -> the projections on their rows as (name, rows), in row order."""
    H, Hkv, D = layer.n_heads, layer.n_kv, layer.head_dim
    out: dict[str, list[tuple[str, int]]] = {"o": [("o", layer.o.out_features)],
                                             "down": [("down", layer.down.out_features)]}
    if getattr(layer, "qkv", None) is not None:
        out["qkv"] = [("q", H * D), ("k", Hkv * D), ("v", Hkv * D)]
    else:
        out.update({p: [(p, getattr(layer, p).out_features)] for p in ("q", "k", "v")})
    if getattr(layer, "gate_up", None) is not None:
        half = layer.gate_up.out_features // 2
        out["gate_up"] = [("gate", half), ("up", half)]
    else:
        out.update({p: [(p, getattr(layer, p).out_features)] for p in ("gate", "up")})
    return out


def with_lora(runner: nn.Module, adapter: Adapter) -> nn.Module:
    """`runner` (a lean runner: `decode.runtime.lean.LeanLM`, float, int8 or int4) with the adapter's projections as
    `LoraLinear`s, in place; returns it. A projection the runner lacks, or of another shape, is one line."""
    layers = getattr(runner, "layers", None)
    if not isinstance(runner, nn.Module) or layers is None:
        raise DraftsmithError(f"{adapter.source}: a LoRA adapter is served on the lean runner only "
                              "(Llama / Qwen2 / Mistral)")
    left = dict(adapter.pairs)
    for i, layer in enumerate(layers):
        for attr, projections in _layer_parts(layer).items():
            base, parts, off = getattr(layer, attr), [], 0
            for proj, rows in projections:
                ab = left.pop((i, proj), None)
                if ab is not None:
                    a, b = ab
                    if a.shape[1] != base.in_features or b.shape[0] != rows:
                        raise DraftsmithError(f"{adapter.source}: layer {i} {proj}_proj is ({b.shape[0]}, "
                                              f"{a.shape[1]}) in the adapter, ({rows}, {base.in_features}) here")
                    parts.append((off, a, b))
                off += rows
            if parts:
                setattr(layer, attr, LoraLinear(base, parts))
    if left:
        (i, proj), = list(left)[:1]
        raise DraftsmithError(f"{adapter.source}: the adapter has layer {i} {proj}_proj, this draft has "
                              f"{len(layers)} layers")
    return runner


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "Adapter", "LoraLinear", "adapter_scale", "check_adapter_config",
           "read_adapter", "with_lora"]
