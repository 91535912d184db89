"""`LeanLM`: the lean runner, a re-implementation of the Llama / Qwen2 / Mistral block (the architectures of the
zoo's SmolLM2 and Qwen2.5-Coder) over the Hugging Face model's own weights (shared, not copied).

A preallocated KV cache (`decode.runtime.kv_cache`), no per-step allocation of masks or cache objects, each Linear on
`decode.runtime.kernels.linear` (a matmul layout that suits the few-row verify step). On a 2-core CPU a small model's
step is dominated by per-layer overhead, which is what this removes. Besides the runner's `forward` it verifies
trees (`forward_tree`, `keep_path`: sibling rounds) and has a fixed-shape `forward_static` (CUDA graphs /
torch.compile). `lean_supported` says which configs it runs exactly; `lean_parts` gives its layers to the
batched decoder (`decode.batch.BatchLM`) too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.decode.runtime.attention import rms_norm, rotate_half
from draftsmith.decode.runtime.kernels import blas, dnn_layout, dnn_usable, linear, native_kernels
from draftsmith.decode.runtime.kv_cache import KVCache
from draftsmith.decode.runtime.native import MAX_ROWS

LEAN_ARCHITECTURES = ("llama", "qwen2", "mistral")


def lean_supported(config) -> tuple[bool, str]:
    """Whether LeanLM can run this HF config exactly, and if not, why."""
    if config.model_type not in LEAN_ARCHITECTURES:
        return False, f"architecture {config.model_type!r} is not one of {LEAN_ARCHITECTURES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return False, f"activation {config.hidden_act!r}"
    if getattr(config, "use_sliding_window", False) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        return False, "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return False, "MLP bias"
    return True, ""


FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}  # `LeanLayer.fuse_projections`: stacked -> own


class LeanLayer(nn.Module):
    """One decoder block over the HF layer's own weights (shared, not copied: no extra memory)."""

    def __init__(self, hf_layer, config, n_heads: int, n_kv: int, head_dim: int) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.eps = config.rms_norm_eps
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.qkv: nn.Linear | None = None  # `fuse_projections`: q, k, v as one Linear, gate and up as another
        self.gate_up: nn.Linear | None = None
        self.norm_in = hf_layer.input_layernorm.weight
        self.norm_post = hf_layer.post_attention_layernorm.weight

    def fuse_projections(self) -> None:
        """Replace q, k, v by one Linear over their stacked rows and gate, up by another (new weights: a copy,
        for a runner that owns its weights, as an int8 draft's). Each output row is the same dot product as
        before, so per-row int8 scales and outputs are unchanged; a step makes 4 Linear calls a layer, not 7."""
        def stack(*layers: nn.Linear) -> nn.Linear:
            w = layers[0].weight
            out = torch.nn.utils.skip_init(nn.Linear, w.shape[1], sum(l.out_features for l in layers),
                                           bias=layers[0].bias is not None, dtype=w.dtype, device=w.device)
            with torch.no_grad():
                out.weight.copy_(torch.cat([l.weight for l in layers]))
                if out.bias is not None:
                    out.bias.copy_(torch.cat([l.bias for l in layers]))
            return out

        for fused, own in FUSED.items():
            setattr(self, fused, stack(*(getattr(self, name) for name in own)))
            for name in own:
                setattr(self, name, None)

    def project_qkv(self, h: Tensor, lin=None) -> tuple[Tensor, Tensor, Tensor]:
        """The q, k, v projections of h (..., d): one Linear where `fuse_projections` stacked them. `lin(x, layer)`
        runs each Linear (default `decode.runtime.kernels.linear`; `decode.batch` passes one for (B, T, d) rows)."""
        lin = lin or linear
        if self.qkv is not None:
            H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
            q, k, v = lin(h, self.qkv).split([H * D, Hkv * D, Hkv * D], dim=-1)
            return q, k, v
        return lin(h, self.q), lin(h, self.k), lin(h, self.v)

    def feed_forward(self, h: Tensor, lin=None) -> Tensor:
        """The MLP on h (..., d): gate and up as one Linear where `fuse_projections` stacked them (`lin`: as in
        `project_qkv`)."""
        lin = lin or linear
        if self.gate_up is not None:
            gate, up = lin(h, self.gate_up).chunk(2, dim=-1)
            return lin(F.silu(gate) * up, self.down)
        return lin(F.silu(lin(h, self.gate)) * lin(h, self.up), self.down)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, pos: int | Tensor,
        mask: Tensor | None,
    ) -> Tensor:
        T = x.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        h = rms_norm(x, self.norm_in, self.eps)
        q, k, v = self.project_qkv(h)  # (T, H D), (T, Hkv D) x 2
        q = q.reshape(T, H, D).transpose(0, 1)  # (H, T, D)
        k = k.reshape(T, Hkv, D).transpose(0, 1)  # (Hkv, T, D)
        v = v.reshape(T, Hkv, D).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if isinstance(pos, Tensor):  # static shapes: attend over the whole buffer under a mask
            keys, values = cache.update_static(layer, pos, k, v)
        else:
            keys, values = cache.update(layer, pos, k, v)  # (Hkv, pos+T, D)
        o = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, enable_gqa=Hkv != H
        )[0]  # (H, T, D)
        x = x + linear(o.transpose(0, 1).reshape(T, H * D), self.o)
        return x + self.feed_forward(rms_norm(x, self.norm_post, self.eps))


def lean_parts(hf_model, max_seq_len: int, who: str):
    """What a lean runner takes from an HF Llama-family model: (layers sharing its weights, KV heads, head dim,
    RoPE cos and sin tables (max_seq_len, D) from HF's own rotary module, so every rope_type matches exactly)."""
    config = hf_model.config
    ok, why = lean_supported(config)
    if not ok:
        raise ValueError(f"{who} cannot run this model: {why}")
    param = next(hf_model.parameters())
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    base = hf_model.model
    layers = nn.ModuleList(LeanLayer(l, config, n_heads, n_kv, head_dim) for l in base.layers)
    pos_ids = torch.arange(max_seq_len, device=param.device)[None]
    cos, sin = base.rotary_emb(torch.zeros(1, dtype=param.dtype, device=param.device), pos_ids)
    return layers, n_kv, head_dim, cos[0].to(param.dtype), sin[0].to(param.dtype)


class LeanLM(nn.Module):
    """Llama-family causal LM with a preallocated KV cache, running on the HF model's own weights."""

    capture_layers: tuple[int, ...] = ()
    last_hidden: Tensor | None = None  # (T, len(capture_layers) * d) of the last forward
    row_plan: dict[int, int] = {}  # T -> rows a forward over T rows runs at (padded): `decode.runtime.plan.plan_rows`
    blas_rows: frozenset[int] = frozenset()  # forwards over these row counts run BLAS, not oneDNN: the same plan
    native_rows: frozenset[int] = frozenset()  # ... and these draftsmith's own kernel (`decode.runtime.native`), first
    native_many: bool = False  # forwards over more than 12 rows (a prefill) on it too: an int8 draft's
    # (`decode.runtime.quant.quantize_int8`; fbgemm quantises a whole prompt's inputs with one scale)

    def __init__(self, hf_model, max_seq_len: int, *, fast_head: bool = True) -> None:
        super().__init__()
        config = hf_model.config
        layers, n_kv, head_dim, cos, sin = lean_parts(hf_model, max_seq_len, "LeanLM")
        param = next(hf_model.parameters())
        dtype, device = param.dtype, param.device
        base = hf_model.model
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        self.embed = base.embed_tokens  # shared with the HF model, as are all weights below
        self.layers = layers
        self.norm = base.norm.weight
        self.lm_head = hf_model.get_output_embeddings()
        # one-row steps (plain decoding, draft steps) read the head faster as a (d, V) copy on CPUs:
        # the largest single matrix, worth its extra memory; multi-row verify steps use the shared one.
        # It is a snapshot: build a new runner after changing the model's weights.
        # (not needed where oneDNN's prepacked kernel serves one row as well: `decode.runtime.kernels.linear`)
        cpu_head = fast_head and device.type == "cpu" and not dnn_layout(self.lm_head.weight)
        self.head_t = self.lm_head.weight.detach().t().contiguous() if cpu_head else None
        self.register_buffer("cos", cos, persistent=False)  # (S, D)
        self.register_buffer("sin", sin, persistent=False)
        self.cache = KVCache(len(self.layers), n_kv, max_seq_len, head_dim, dtype, device)

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    @torch.inference_mode()
    def forward(self, tokens: Tensor, pos: int, keep: int = 0) -> Tensor:
        """tokens (T,) at positions [pos, pos+T) -> logits (T, V), or the last `keep` rows.

        Where `row_plan` says a forward over more rows is faster on this machine (`decode.runtime.plan.plan_rows`), the
        tokens are padded with copies of the last one up to that many rows and the extra rows dropped: they come
        after the real ones (causal: no real row sees them) and their cache slots lie past pos+T, which the next
        forward overwrites."""
        T = tokens.shape[0]
        rows = self.row_plan.get(T, T) if keep in (0, T) else T
        if rows > T and pos + rows <= self.max_seq_len:
            logits = self._forward(torch.cat([tokens, tokens[-1:].expand(rows - T)]), pos, 0)
            if self.last_hidden is not None and self.capture_layers:
                self.last_hidden = self.last_hidden[:T]
            return logits[:T]
        return self._forward(tokens, pos, keep)

    def _forward(self, tokens: Tensor, pos: int, keep: int) -> Tensor:
        T = tokens.shape[0]
        if pos + T > self.max_seq_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the cache ({self.max_seq_len})")
        mask = None
        if T > 1:  # new token i sees everything before it: keys j <= pos + i
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=tokens.device).tril(pos)
        cos, sin = self.cos[pos : pos + T], self.sin[pos : pos + T]
        return self._run(tokens, cos, sin, pos, mask, keep)

    @torch.inference_mode()
    def forward_tree(self, tokens: Tensor, pos: int, parents: list[int]) -> Tensor:
        """A tree of tokens in one forward: tokens (T,) go to cache slots [pos, pos+T); token 0 follows the
        sequence (at position pos), token i > 0 follows token parents[i] < i (at its position + 1) and sees the
        cache before pos and its own ancestors only, not its siblings. -> logits (T, V). `keep_path` then keeps
        the KV of one path. A chain (parents[i] = i - 1) is `forward`."""
        T = tokens.shape[0]
        if len(parents) != T or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, T)):
            raise ValueError(f"parents must start with -1 and name an earlier token for every other, got {parents}")
        if pos + T > self.max_seq_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the cache ({self.max_seq_len})")
        depth, seen = [0] * T, [[False] * T for _ in range(T)]
        for i in range(T):
            j = i
            while j >= 0:  # i and its ancestors
                seen[i][j], j = True, parents[j]
            depth[i] = depth[parents[i]] + 1 if i else 0
        mask = torch.ones(T, pos + T, dtype=torch.bool, device=tokens.device)
        mask[:, pos:] = torch.tensor(seen)
        at = torch.tensor(depth, device=self.cos.device) + pos
        return self._run(tokens, self.cos[at], self.sin[at], pos, mask)

    def keep_path(self, pos: int, rows: list[int]) -> None:
        """After `forward_tree(tokens, pos, ...)`: move the KV of tree rows `rows` (a root-to-node path, row 0
        first) to slots pos, pos+1, ..., so the cache holds that path as a plain sequence."""
        if rows != list(range(len(rows))):
            idx = torch.tensor(rows, device=self.cache.k.device) + pos
            for buf in (self.cache.k, self.cache.v):
                buf[:, :, pos : pos + len(rows)] = buf[:, :, idx]

    @torch.no_grad()  # not inference_mode: torch.compile cannot trace it (views of inference tensors)
    def forward_static(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Fixed-shape variant (tokens (T,), positions (T,) on device) for CUDA graphs / torch.compile."""
        S = self.max_seq_len
        mask = torch.arange(S, device=tokens.device)[None, :] <= positions[:, None]  # (T, S)
        return self._run(tokens, self.cos[positions], self.sin[positions], positions, mask)

    def _run(
        self, tokens: Tensor, cos: Tensor, sin: Tensor, pos: int | Tensor, mask: Tensor | None, keep: int = 0
    ) -> Tensor:
        if tokens.shape[0] in self.native_rows or (self.native_many and tokens.shape[0] > MAX_ROWS):
            with native_kernels():
                return self._layers_and_head(tokens, cos, sin, pos, mask, keep)
        if tokens.shape[0] not in self.blas_rows:  # (no context manager on this path: torch.compile traces it)
            return self._layers_and_head(tokens, cos, sin, pos, mask, keep)
        with blas():
            return self._layers_and_head(tokens, cos, sin, pos, mask, keep)

    def _layers_and_head(
        self, tokens: Tensor, cos: Tensor, sin: Tensor, pos: int | Tensor, mask: Tensor | None, keep: int
    ) -> Tensor:
        x = self.embed(tokens)  # (T, d)
        seen = {}
        for i, layer in enumerate(self.layers):
            if i in self.capture_layers:
                seen[i] = x
            x = layer(x, cos, sin, self.cache, i, pos, mask)
        if self.capture_layers:  # a head's features: no copy but the concatenation
            self.last_hidden = torch.cat([seen[i] for i in self.capture_layers], dim=-1)  # (T, 3d)
        if keep:
            x = x[-keep:]
        h = rms_norm(x, self.norm, self.eps)
        if (self.head_t is not None and h.shape[0] == 1 and type(self.lm_head) is nn.Linear
                and not dnn_usable(self.lm_head.weight)):
            logits = h @ self.head_t
        else:
            logits = linear(h, self.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()
