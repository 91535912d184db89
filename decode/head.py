"""EAGLE-3 draft heads: a draft that reads the target's hidden states (docs/design.md, "Draft heads").

    head = Eagle3Head(HeadConfig.for_target(hf.config, draft_vocab_size=N), hf.get_input_embeddings())
    head.set_vocab(*vocab_map(token_counts, N))
    out = generate(target, ids, draft=HeadDraft(head, max_seq_len=S), policy=KPolicy(k=4))

Entry t of the head (its KV-cache slot t, RoPE position t) reads g_t, the target's hidden states for token t at
the aux layers, concatenated (3H) and projected by `fc` (-> H), together with the embedding (the target's own,
frozen, never saved) of token t+1, and predicts token t+2. At depths >= 2 of a round the target has not seen the
drafted tokens, so the head feeds itself: g_t is then its own output hidden state (pre-norm, H) of entry t-1,
used as is. Aux layer id i is the residual stream entering target layer i (HF's `output_hidden_states[i]`,
vLLM's `aux_hidden_state_layers`); EAGLE-3's default is [2, L//2, L-3].

Architecture and weight names are the speculators / SpecForge Llama EAGLE-3 checkpoint's (`fc.weight` without
bias, `midlayer.{self_attn,mlp}.*`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`norm.weight`, `lm_head.weight` over the draft vocabulary, `d2t`, `t2d`): q/k/v read
concat(input_layernorm(embedding), hidden_norm(g)) (2H wide) and the residual is g itself
(`norm_before_residual: false`). Exporting is a conversion (vLLM renames `midlayer.` to `layers.0.`; llama.cpp
wants d2t as absolute ids, d2t + arange).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.decode.runtime.attention import grouped_attention, rms_norm, rotate_half
from draftsmith.decode.runtime.io import atomic_path, atomic_write_json, read_json
from draftsmith.decode.runtime.kernels import linear
from draftsmith.decode.runtime.kv_cache import KVCache
from draftsmith.decode.runtime.quant import quantize_linears_int8


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high layers [2, L//2, L-3], clamped into [0, L-1] for tiny targets."""
    return tuple(min(max(i, 0), n_layers - 1) for i in (2, n_layers // 2, n_layers - 3))  # type: ignore[return-value]


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # the target's (the head reads its embedding)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers whose input hidden states the head reads (low, mid, high)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        if len(self.aux_layers) != 3 or min(self.aux_layers) < 0:
            raise ValueError(f"aux_layers: three target layer ids >= 0, got {self.aux_layers}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def for_target(cls, config, *, draft_vocab_size: int | None = None, aux_layers=None,
                   intermediate_size: int | None = None) -> "HeadConfig":
        """A head shaped like one layer of the target (HF config), over its full vocabulary unless told."""
        n_heads, L = config.num_attention_heads, config.num_hidden_layers
        aux_layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(L)
        if max(aux_layers) >= L:
            raise ValueError(f"aux_layers {aux_layers}: the target has {L} layers")
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=intermediate_size or config.intermediate_size,
            num_attention_heads=n_heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
            vocab_size=config.vocab_size,
            draft_vocab_size=draft_vocab_size or config.vocab_size,
            aux_layers=aux_layers,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)),
            rms_norm_eps=config.rms_norm_eps,
        )


def vocab_map(token_counts: Tensor, N: int) -> tuple[Tensor, Tensor]:
    """The N most frequent target ids (ties -> lower id), in id order -> (d2t (N,) int64, t2d (V,) bool).

    target_id = draft_id + d2t[draft_id]; t2d marks the target ids in the draft vocabulary. N = V is the identity.
    """
    V = token_counts.shape[0]
    if not 1 <= N <= V:
        raise ValueError(f"draft vocabulary size must be in [1, {V}], got {N}")
    order = torch.argsort(token_counts.double(), descending=True, stable=True)  # stable: ties keep the lower id first
    ids = torch.sort(order[:N]).values  # (N,) target ids, ascending
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(N), t2d


def rope_tables(config: HeadConfig, max_seq_len: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """Default (unscaled) RoPE cos, sin (S, D), computed as HF's LlamaRotaryEmbedding does (float32, then cast)."""
    D = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        H, D = c.hidden_size, c.head_dim
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, D
        self.q_proj = nn.Linear(2 * H, self.n_heads * D, bias=False)  # reads concat(embedding, hidden): 2H
        self.k_proj = nn.Linear(2 * H, self.n_kv * D, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, pos: int, mask: Tensor | None) -> Tensor:
        T, H, Hkv, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        q = linear(x, self.q_proj).reshape(T, H, D).transpose(0, 1)  # (H, T, D)
        k = linear(x, self.k_proj).reshape(T, Hkv, D).transpose(0, 1)  # (Hkv, T, D)
        v = linear(x, self.v_proj).reshape(T, Hkv, D).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.update(0, pos, k, v)  # (Hkv, pos+T, D)
        o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=Hkv != H)[0]
        return linear(o.transpose(0, 1).reshape(T, H * D), self.o_proj)  # (T, H)


class MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj)


class MidLayer(nn.Module):
    """EAGLE-3's one decoder layer: attention over [embedding, hidden] (2H), residual from the hidden (g)."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on g
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, emb: Tensor, g: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, pos: int,
                mask: Tensor | None) -> Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)  # (T, 2H)
        h = g + self.self_attn(x, cos, sin, cache, pos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))  # (T, H)


class Eagle3Head(nn.Module):
    """The head's weights and its step; `HeadDraft` runs it inside the decoder."""

    def __init__(self, config: HeadConfig, embed: nn.Embedding | Tensor) -> None:
        super().__init__()
        c = self.config = config
        weight = (embed.weight if isinstance(embed, nn.Module) else embed).detach()
        if tuple(weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embedding {tuple(weight.shape)} does not fit the head ({c.vocab_size}, {c.hidden_size})")
        self.register_buffer("embed", weight, persistent=False)  # the target's, shared and frozen: never saved
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        for name, p in self.named_parameters():  # HF's Llama init (initializer_range 0.02); norms stay 1
            if name.endswith("proj.weight") or name in ("fc.weight", "lm_head.weight"):
                nn.init.normal_(p, std=0.02)
        d2t, t2d = vocab_map(torch.arange(c.vocab_size, 0, -1), c.draft_vocab_size)  # the first N ids until set
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.to(device=weight.device, dtype=weight.dtype)  # buffers d2t / t2d keep their integer / bool types

    def set_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install a draft vocabulary (from `vocab_map`), checked: distinct target ids, the ones t2d marks."""
        N, V = self.config.draft_vocab_size, self.config.vocab_size
        if d2t.shape != (N,) or t2d.shape != (V,):
            raise ValueError(f"d2t must be ({N},) and t2d ({V},), got {tuple(d2t.shape)} and {tuple(t2d.shape)}")
        ids = torch.arange(N) + d2t.cpu().long()
        mask = torch.zeros(V, dtype=torch.bool)
        mask[ids.clamp(0, V - 1)] = True
        if ids.min() < 0 or ids.max() >= V or mask.sum() != N or not torch.equal(mask, t2d.cpu().bool()):
            raise ValueError("d2t and t2d disagree: draft_id + d2t[draft_id] must be N distinct ids, those t2d marks")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_ids(self) -> Tensor:
        """(N,) the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_vocab(self, draft_logits: Tensor) -> Tensor:
        """(T, N) -> (T, V): -inf outside the draft vocabulary, so q is 0 there (the sampling and the ratio agree)."""
        full = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy(1, self.draft_ids, draft_logits)

    def project(self, features: Tensor) -> Tensor:
        """The target's features (T, 3H) -> g (T, H)."""
        return linear(features.to(self.embed.dtype), self.fc)

    def forward(self, g: Tensor, tokens: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, pos: int,
                mask: Tensor | None = None, keep: int | None = None) -> tuple[Tensor, Tensor]:
        """Entries [pos, pos+T): g (T, H) and the next tokens (T,) -> (logits (T, V) over the target's vocabulary,
        float32 or float64, or of the last `keep` entries only (0: none); the output hidden (T, H), pre-norm,
        which the next depth reads as its g)."""
        emb = F.embedding(tokens, self.embed).to(g.dtype)  # (T, H)
        h = self.midlayer(emb, g, cos, sin, cache, pos, mask)
        if keep == 0:
            dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
            return h.new_zeros((0, self.config.vocab_size), dtype=dtype), h
        logits = linear(self.norm(h if keep is None else h[h.shape[0] - keep :]), self.lm_head)  # (keep or T, N)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return self.to_target_vocab(logits), h


# -- a whole sequence at once, every depth of every round (training, and pairing's acceptance by depth) --


def _qkv(head: Eagle3Head, emb: Tensor, g: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(B, E, H) embeddings and g -> rotated q (B, Hq, E, D), k (B, Hkv, E, D) and v."""
    layer, c = head.midlayer, head.config
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(g)], dim=-1)  # (B, E, 2H)
    B, E, D = x.shape[0], x.shape[1], c.head_dim
    q = layer.self_attn.q_proj(x).view(B, E, c.num_attention_heads, D).transpose(1, 2)
    k = layer.self_attn.k_proj(x).view(B, E, c.num_key_value_heads, D).transpose(1, 2)
    v = layer.self_attn.v_proj(x).view(B, E, c.num_key_value_heads, D).transpose(1, 2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def ttt_mask(E: int, j: int, device=None) -> Tensor:
    """(E, j*E) bool: depth j of entry e sees depth-1 keys c <= e-j+1 and, for s = 2..j, depth-s key e-j+s."""
    e = torch.arange(E, device=device)[:, None]
    c = torch.arange(E, device=device)[None, :]
    blocks = [c <= e - j + 1] + [c == e - j + s for s in range(2, j + 1)]
    return torch.cat(blocks, dim=1)


def ttt_logits(head: Eagle3Head, features: Tensor, tokens: Tensor, steps: int, start: int = 0) -> list[Tensor]:
    """Draft-vocabulary logits (E - start, N) of entries [start, E) at depths 1..steps (E = len(tokens) - 1).
    Every entry is still computed (the later ones attend to it); `start` only skips the output head before it.
    Batched as `ttt_hidden`: (B, E - start, N) per depth."""
    return [head.lm_head(head.norm(h[..., start:, :])) for h in ttt_hidden(head, features, tokens, steps)]


def ttt_hidden(head: Eagle3Head, features: Tensor, tokens: Tensor, steps: int) -> list[Tensor]:
    """The head's output hidden (pre-norm; E, H) of every entry at depths 1..steps, the training-time unroll
    (E = len(tokens) - 1; the features of entry e are the target's at token e).

    Batched: features (B, E', 3H) and tokens (B, E+1) -> (B, E, H) per depth. Rows shorter than the batch are
    right-padded (anything): an entry only reads entries before it, so the pads change nothing."""
    if tokens.dim() == 1:
        return [x[0] for x in ttt_hidden(head, features[None], tokens[None], steps)]
    c, layer = head.config, head.midlayer
    B, E = tokens.shape[0], tokens.shape[1] - 1
    dtype = head.embed.dtype
    emb = F.embedding(tokens[:, 1:], head.embed).to(dtype)  # token e+1 for entry e
    cos, sin = rope_tables(c, E, dtype, tokens.device)
    g = head.fc(features[:, :E].to(dtype))  # (B, E, H)
    keys, values, out = [], [], []
    for j in range(1, steps + 1):
        if j > 1:  # entry e reads the output hidden of entry e-1 at the previous depth
            g = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        q, k, v = _qkv(head, emb, g, cos, sin)
        keys.append(k), values.append(v)
        o = grouped_attention(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(E, j, tokens.device))
        h = g + layer.self_attn.o_proj(o.transpose(1, 2).reshape(B, E, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        out.append(h)
    return out


def quantize_head_int8(head: Eagle3Head) -> Eagle3Head:
    """A copy of the head whose Linear layers (fc, the layer's projections, lm_head) hold dynamic int8 weights, one
    scale per output channel (fbgemm, x86 CPUs), as standalone drafts get them: a step reads a quarter of the
    bytes. Exactness is untouched (the target verifies every token). The target's embedding stays shared."""
    import copy

    if head_quant(head) is None:
        raise ValueError("int8 heads run on the CPU in float32 (fbgemm); keep this head as it is")
    embed = head._buffers["embed"]
    head._buffers["embed"] = None  # not copied: shared with the target
    try:
        q = copy.deepcopy(head)
    finally:
        head._buffers["embed"] = embed
    q._buffers["embed"] = embed
    return quantize_linears_int8(q.eval())


def head_quant(head: Eagle3Head, requested: str | None = "int8") -> str | None:
    """The `quantize=` a HeadDraft gets: "int8" when asked for and the head can take it (float32 on the CPU)."""
    ok = requested == "int8" and head.embed.dtype == torch.float32 and head.embed.device.type == "cpu"
    return "int8" if ok else None


class HeadDraft:
    """An Eagle3Head as the draft of `decode.speculative.generate`.

    `forward(tokens, pos, keep)` as any draft's (the draft has seen seq[:pos]; tokens are seq[pos:pos+T]); plus
    `observe(features, tokens, pos)`, which generate calls after each target forward with the accepted rows.
    The head then (re)computes every entry from the first one it holds target features for (entries it had fed
    its own hidden, at depths >= 2, are recomputed with the target's once verified, as EAGLE-3 does), and feeds
    itself past the last one. Its cache rolls back like any draft's: a position is the length.
    """

    reads_target = True  # generate: capture `capture_layers` on the target and hand the features over

    def __init__(self, head: Eagle3Head, max_seq_len: int, *, quantize: str | None = None) -> None:
        c = head.config
        if quantize == "int8":
            head = quantize_head_int8(head)
        elif quantize not in (None, "none"):
            raise ValueError(f"unknown quantisation {quantize!r} (choose int8 or none)")
        self.head, self.vocab_size, self.capture_layers = head, c.vocab_size, c.aux_layers
        dtype, device = head.embed.dtype, head.embed.device
        self.cache = KVCache(1, c.num_key_value_heads, max_seq_len, c.head_dim, dtype, device)
        self.cos, self.sin = rope_tables(c, max_seq_len, dtype, device)  # (S, D)
        self.tokens = torch.zeros(max_seq_len, dtype=torch.long, device=device)  # seq, as far as it was shown
        self.outs = torch.zeros(max_seq_len, c.hidden_size, dtype=dtype, device=device)  # output hidden per entry
        self.feats = torch.zeros(0, 3 * c.hidden_size, dtype=dtype, device=device)  # target features not yet read,
        self.h_len = 0  # for positions [h_len, h_len + len(feats)); entries [0, h_len) read the target's features
        self.e_len = 0  # entries [0, e_len) are in the cache (those past h_len fed the head's own hidden)

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    def observe(self, features: Tensor, tokens: Tensor, pos: int) -> None:
        """The target read `tokens` (T,) at positions [pos, pos+T) of the accepted sequence, with `features`
        (T, 3H) at the head's aux layers there. pos = 0 starts a new sequence."""
        T = tokens.shape[0]
        self.tokens[pos : pos + T] = tokens
        if pos == 0:
            self.h_len = self.e_len = 0
            self.feats = self.feats[:0]
        if not self.h_len <= pos <= self.h_len + len(self.feats):
            raise ValueError(f"features at {pos} do not continue the {self.h_len + len(self.feats)} the head holds")
        # a copy: the runner may reuse its buffer (CUDA graphs) before the head reads them
        self.feats = torch.cat([self.feats[: pos - self.h_len], features.to(self.feats.dtype)])

    @torch.inference_mode()
    def forward(self, tokens: Tensor, pos: int, keep: int = 0) -> Tensor:
        """tokens (T,) = seq[pos:pos+T] -> logits (T, V) for the tokens after each (or the last `keep` rows)."""
        T = tokens.shape[0]
        self.tokens[pos : pos + T] = tokens
        end = pos + T - 1  # entries [start, end): the last one reads token pos+T-1 and predicts the one after
        start = self.h_len if len(self.feats) else min(self.e_len, pos - 1)
        f_end = min(end, self.h_len + len(self.feats))  # entries before f_end read the target's features
        if start < self.h_len or start >= end or (start >= f_end and start < 1):
            raise ValueError(f"the head holds no target features to draft from at position {pos}: observe them first")
        need = keep or T  # the output head runs on the entries whose logits are returned only
        rows = []
        if f_end > start:  # all target-fed entries in one step
            n = f_end - start
            rows.append(self._entries(self.head.project(self.feats[:n]), start, min(n, max(0, need - (end - f_end)))))
            self.feats, self.h_len = self.feats[n:], f_end
        for e in range(max(start, f_end), end):  # past them the head feeds itself its previous output hidden
            rows.append(self._entries(self.outs[e - 1 : e], e, 1 if end - e <= need else 0))
        self.e_len = end
        return torch.cat(rows)[-need:]

    @torch.inference_mode()
    def forward_siblings(self, tokens: Tensor, pos: int) -> Tensor:
        """Candidates for seq[pos] side by side (a sibling round's): tokens (m,) -> logits (m, V) for the token
        after each, what `forward(tokens[i:i+1], pos, keep=1)` gives one at a time, in one step: m entries at
        the same position, each seeing the cache and itself. The head must have drafted seq[pos] (it holds the
        entries before pos - 1) and is left as it was: the cache slots from pos - 1 on are scratch."""
        e, m = pos - 1, tokens.shape[0]
        if e < 1 or e != self.e_len or len(self.feats):
            raise ValueError(f"forward_siblings at {pos}: the head must have drafted position {pos} last "
                             f"(it holds {self.e_len} entries and {len(self.feats)} unread features)")
        mask = torch.ones(m, e + m, dtype=torch.bool, device=tokens.device)
        mask[:, e:] = torch.eye(m, dtype=torch.bool, device=tokens.device)
        cos, sin = self.cos[e : e + 1].expand(m, -1), self.sin[e : e + 1].expand(m, -1)
        g = self.outs[e - 1 : e].expand(m, -1)  # each reads the head's output hidden of the entry before
        return self.head(g, tokens, cos, sin, self.cache, e, mask, m)[0]

    def _entries(self, g: Tensor, start: int, keep: int) -> Tensor:
        """Entries [start, start+T) from g (T, H): their output hidden into `outs`; logits of the last `keep`."""
        T = g.shape[0]
        mask = None if T == 1 else torch.ones(T, start + T, dtype=torch.bool, device=g.device).tril(start)
        cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        logits, h = self.head(g, self.tokens[start + 1 : start + 1 + T], cos, sin, self.cache, start, mask, keep)
        self.outs[start : start + T] = h
        return logits  # (keep, V)


def save_head(head: Eagle3Head, folder: str | Path) -> Path:
    """config.json + model.safetensors (the head's own weights, d2t and t2d; never the target's embedding)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    with atomic_path(folder / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    atomic_write_json(folder / "config.json", {"architectures": ["Eagle3Head"], **asdict(head.config)})
    return folder


def load_head(folder: str | Path, embed: nn.Embedding | Tensor) -> Eagle3Head:
    """A head saved by `save_head`, on the target's embedding (its device and dtype)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_json(folder / "config.json", what="head config")
    config.pop("architectures", None)
    head = Eagle3Head(HeadConfig(**config), embed)
    head.load_state_dict(load_file(str(folder / "model.safetensors"), device=str(head.embed.device)))
    return head
