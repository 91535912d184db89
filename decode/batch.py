"""Plain (non-speculative) decoding of several prompts at once, each row getting exactly the tokens that
decoding it alone gives.

    from draftsmith.decode.batch import generate_batch
    rows = generate_batch(loaded.model, [ids_a, ids_b], max_new_tokens=48, sampling=SamplingParams(1.0),
                          eos_ids=eos_ids(loaded), generators=[gen_a, gen_b])

Used where one model decodes many prompts on its own (distillation data from the draft, or from the target
without a proposer): left-padded, one Hugging Face forward per token for the whole batch, finished rows
dropped. `TargetVocab` fits a model's logits to another model's vocabulary (`decode.sampling.fit_vocab`: cut,
or padded with -inf), so a draft never samples a token its target cannot score.

Llama-family models (`decode.runtime.lean.lean_supported`) decode through `BatchLM`, LeanLM's block for B rows at
once: one preallocated (B, Hkv, S, D) KV cache per layer, a key mask for the left pads, rows compacted out of
the batch only when a quarter of it has finished (a copy of the cache each time). It can also keep, for every
token it feeds, what a draft head trains on (`decode_batch(..., capture=aux_layers)`): the residual stream
entering the aux layers, the hidden state after the final norm and the target's greedy next token. Other
architectures use Hugging Face's forward with a DynamicCache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.decode.runtime.attention import grouped_attention, rms_norm, rotate_half
from draftsmith.decode.runtime.kernels import linear
from draftsmith.decode.runtime.lean import lean_parts, lean_supported
from draftsmith.decode.runtime.runner import Runner
from draftsmith.decode.sampling import SamplingParams, fit_vocab, greedy_token, sample, to_probs


GEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what a model may write data in


def writer_model(model, dtype: str):
    """The model that writes data: `model` itself, or a copy of it in `dtype` (`model` is untouched). bfloat16
    batches run 2-3x faster on CPUs with AMX; a draft's training text and features need no more precision."""
    if dtype not in GEN_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(GEN_DTYPES)}, got {dtype!r}")
    if next(model.parameters()).dtype == GEN_DTYPES[dtype]:
        return model
    import copy

    return copy.deepcopy(model).to(GEN_DTYPES[dtype])


class TargetVocab:
    """A runner whose logits are cut or padded (-inf) to the target's vocabulary, so that every token the
    draft samples on its own is one the target can score (drafts may carry a few padding rows more or less)."""

    def __init__(self, runner: Runner, vocab_size: int) -> None:
        self.runner, self.vocab_size, self.max_seq_len = runner, vocab_size, runner.max_seq_len

    def forward(self, tokens: Tensor, pos: int, keep: int = 0) -> Tensor:
        return fit_vocab(self.runner.forward(tokens, pos, keep), self.vocab_size)


def _attend(q: Tensor, k: Tensor, v: Tensor, end: int, mask: Tensor) -> Tensor:
    """Attention of q (B, H, T, D) over cache columns [0, end) of k, v (B, Hkv, S, D) under mask (B, 1, T, end).
    One new token per row in bfloat16: two batched matmuls over the whole cache (the columns past `end` masked
    out; slicing them off would copy the cache every layer) and each kv head's group of queries, softmax in
    float32. torch's CPU flash kernel takes ~6x longer on that shape (256 rows, 150 of 224 columns: 18.5 ms
    against 2.8, on a 2-core AMD EPYC). Otherwise torch's own kernel."""
    H, T, Hkv, S = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    if T != 1 or q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], attn_mask=mask, enable_gqa=Hkv != H)
    # (B, 1, 1, 1, S): unwritten columns hold zeros (finite) and are masked out
    return grouped_attention(q, k, v, F.pad(mask, (0, S - end))[:, :, None])


class BatchLM(nn.Module):
    """LeanLM's decoder block for B left-padded rows at once, on the HF model's own weights (shared), with a
    preallocated KV cache (L, B, Hkv, S, D) and optional capture of a head's training features."""

    def __init__(self, hf_model, batch: int, max_seq_len: int, capture: tuple[int, ...] = ()) -> None:
        super().__init__()
        config = hf_model.config
        self.layers, n_kv, head_dim, self.cos, self.sin = lean_parts(hf_model, max_seq_len, "BatchLM")
        param = next(hf_model.parameters())
        dtype, device = param.dtype, param.device
        base = hf_model.model
        self.embed, self.norm, self.eps = base.embed_tokens, base.norm.weight, config.rms_norm_eps
        self.lm_head = hf_model.get_output_embeddings()
        shape = (len(self.layers), batch, n_kv, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capture = tuple(capture)
        for i in self.capture:
            if not 0 <= i < len(self.layers):
                raise ValueError(f"capture layer {i} is outside the model's {len(self.layers)} layers")
        self.features = self.final = None
        if self.capture:  # what a head trains on, per (row, column): float16 like the head data on disk
            d = config.hidden_size
            self.features = torch.zeros(batch, max_seq_len, len(self.capture) * d, dtype=torch.float16, device=device)
            self.final = torch.zeros(batch, max_seq_len, d, dtype=torch.float16, device=device)

    def select(self, rows: Tensor) -> None:
        """Keep only batch rows `rows` (in that order): a copy of the cache and of the captured features."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        if self.capture:
            self.features, self.final = self.features[rows], self.final[rows]

    def forward(self, tokens: Tensor, start: int, positions: Tensor, mask: Tensor) -> Tensor:
        """tokens (B, T) written at cache columns [start, start+T), RoPE at `positions` (B, T), attention under
        `mask` (B, 1, T, start+T) -> hidden states after the final norm (B, T, d)."""
        B, T = tokens.shape
        end = start + T
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (B, 1, T, D)
        x = self.embed(tokens)
        seen = {}
        for i, layer in enumerate(self.layers):
            if i in self.capture:
                seen[i] = x
            H, Hkv, D = layer.n_heads, layer.n_kv, layer.head_dim
            h = rms_norm(x, layer.norm_in, layer.eps)
            q = linear(h, layer.q).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
            k = linear(h, layer.k).view(B, T, Hkv, D).transpose(1, 2)
            v = linear(h, layer.v).view(B, T, Hkv, D).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            self.k[i, :, :, start:end] = k * cos + rotate_half(k) * sin
            self.v[i, :, :, start:end] = v
            o = _attend(q, self.k[i], self.v[i], end, mask)
            x = x + linear(o.transpose(1, 2).reshape(B, T, H * D), layer.o)
            h = rms_norm(x, layer.norm_post, layer.eps)
            x = x + linear(F.silu(linear(h, layer.gate)) * linear(h, layer.up), layer.down)
        h = rms_norm(x, self.norm, self.eps)
        if self.capture:
            self.features[:, start:end] = torch.cat([seen[i] for i in self.capture], dim=-1).half()
            self.final[:, start:end] = h.half()
        return h

    def logits(self, h: Tensor) -> Tensor:
        logits = linear(h, self.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()


@dataclass
class BatchOutput:
    """Each row's new tokens; with `capture`, per row over prompt + new tokens (n positions): `features`
    (n, 3H) float16, `final` (n, H) float16 (after the final norm) and `next` (n,) the target's greedy token."""

    tokens: list[list[int]]
    features: list[Tensor] = field(default_factory=list)
    final: list[Tensor] = field(default_factory=list)
    next: list[Tensor] = field(default_factory=list)
    topk_values: list[Tensor] = field(default_factory=list)  # with topk=k: (C, k) log-probs at T = 1 per new token
    topk_indices: list[Tensor] = field(default_factory=list)  # (C, k) their token ids
    halted: bool = False  # the deadline stopped the rows that were still sampling (their answers are cut short)


def _check_call(prompts, max_new_tokens, sampling, generators) -> list:
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    generators = list(generators) if generators is not None else [None] * len(prompts)
    if not sampling.greedy and any(g is None for g in generators):
        raise ValueError("sampling at temperature > 0 needs an explicit torch.Generator per prompt")
    return generators


def _pick(logits: Tensor, sampling: SamplingParams, generator) -> int:
    """The very step `decode.speculative.generate` takes without a draft."""
    if sampling.greedy:
        return int(greedy_token(logits))
    return int(sample(to_probs(logits, sampling), generator))


class _BatchDecode:
    """One `decode_batch` call as it goes: the BatchLM over the rows still in the batch (batch row j holds prompt
    rows[j]) with their key layout, and per prompt what it has given so far (tokens, captured data, top-k)."""

    def __init__(self, model, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                 eos_ids, generators: list, vocab_size: int | None, capture: tuple[int, ...], topk: int) -> None:
        self.model, self.prompts, self.max_new_tokens, self.sampling = model, prompts, max_new_tokens, sampling
        self.generators, self.vocab_size, self.capture, self.topk = generators, vocab_size, capture, topk
        self.stop = set(eos_ids)
        self.device = next(model.parameters()).device
        B = len(prompts)
        self.P = max(len(p) for p in prompts)
        self.out = BatchOutput([[] for _ in range(B)])
        if capture:
            self.out.features, self.out.final, self.out.next = [None] * B, [None] * B, [None] * B
        self.nxt_new: list[list[int]] = [[] for _ in range(B)]  # with capture: the greedy token after each new one
        self.kept_v: list[list[Tensor]] = [[] for _ in range(B)]
        self.kept_i: list[list[Tensor]] = [[] for _ in range(B)]
        self.rows = list(range(B))  # batch row j holds prompt rows[j]
        self.alive = [True] * B  # prompt b still samples
        self.fed = [False] * B  # prompt b's data is taken (captured rows leave one feed after their last token)
        self.col = self.P  # the cache column the next token goes to

    def prefill(self) -> Tensor:
        """Every distinct prompt read once, left-padded to P (samples of one prompt share its prefill, whose cache
        is then copied) -> the logits (B, V) each row's first new token comes from."""
        prompts, P, device = self.prompts, self.P, self.device
        B, S = len(prompts), P + self.max_new_tokens
        distinct: dict[tuple[int, ...], int] = {}
        src = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=device)  # (B,)
        firsts = [list(p) for p in distinct]
        U = len(firsts)
        self.lm = lm = BatchLM(self.model, U, S, self.capture)
        pad_u = torch.tensor([P - len(p) for p in firsts], device=device)  # (U,): left padding to P
        cols = torch.arange(S, device=device)
        valid_u = cols[None, :] >= pad_u[:, None]  # (U, S): a row's keys start at its first real token
        positions_u = (cols[None, :] - pad_u[:, None]).clamp(min=0)  # (U, S)
        ids = torch.zeros(U, P, dtype=torch.long)
        for u, p in enumerate(firsts):
            ids[u, P - len(p):] = torch.tensor(p)
        eye = torch.eye(P, dtype=torch.bool, device=device)
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        mask = (valid_u[:, None, None, :P] & causal) | eye  # pads see themselves
        h = lm(ids.to(device), 0, positions_u[:, :P], mask)
        logits = lm.logits(h[:, -1])[src]  # (B, V)
        self.nxt_prompt = [None] * B
        if self.capture:  # the greedy next token at every prompt position, a distinct prompt at a time (U x P x V)
            per_prompt = [lm.logits(h[u, pad_u[u]:]).argmax(-1).int().cpu() for u in range(U)]
            self.nxt_prompt = [per_prompt[int(u)] for u in src]
        if U < B:
            lm.select(src)
        self.pad, self.valid, self.positions = pad_u[src], valid_u[src], positions_u[src]
        return logits

    def sample(self, logits: Tensor) -> list[int]:
        """Each live row's next token from its logits (B', V); a finished row's data is taken once its last
        token was fed. -> the token each batch row feeds next (a finished row rides along with its last one)."""
        out = self.out
        if self.vocab_size is not None:
            logits = fit_vocab(logits, self.vocab_size)
        feed = []
        if self.capture:
            greedy_next = logits.argmax(-1).tolist()
        if self.topk:
            top = torch.log_softmax(logits.float(), dim=-1).topk(min(self.topk, logits.shape[-1]), dim=-1)
            top_v, top_i = top.values.cpu(), top.indices.to(torch.int32).cpu()
        for j, b in enumerate(self.rows):
            if self.capture and not self.fed[b] and len(out.tokens[b]) > 0:
                self.nxt_new[b].append(greedy_next[j])
            if self.alive[b]:
                if self.topk:
                    self.kept_v[b].append(top_v[j])
                    self.kept_i[b].append(top_i[j])
                tok = _pick(logits[j], self.sampling, self.generators[b])
                out.tokens[b].append(tok)
                self.alive[b] = tok not in self.stop and len(out.tokens[b]) < self.max_new_tokens
                feed.append(tok)
            else:
                if self.capture and not self.fed[b]:  # its final token was fed last step: its data is complete
                    self._take_capture(j, b)
                feed.append(out.tokens[b][-1])  # a finished row rides along until the batch is compacted
        return feed

    def _take_capture(self, j: int, b: int) -> None:
        """Prompt b's captured data (batch row j) over its prompt and new tokens."""
        n = len(self.prompts[b]) + len(self.out.tokens[b])
        j0 = int(self.pad[j])
        self.out.features[b] = self.lm.features[j, j0 : j0 + n].cpu()
        self.out.final[b] = self.lm.final[j, j0 : j0 + n].cpu()
        self.out.next[b] = torch.cat([self.nxt_prompt[b], torch.tensor(self.nxt_new[b], dtype=torch.int32)])
        self.fed[b] = True

    def halt(self) -> None:
        """No row samples again (with capture, the rows still sampling have their last token fed once more)."""
        self.out.halted = any(self.alive)
        self.alive = [False] * len(self.alive)

    def waiting(self) -> list[bool]:
        """Which batch rows need another step: to sample, or (with capture) to have their last token fed."""
        return [not self.fed[b] for b in self.rows] if self.capture else [self.alive[b] for b in self.rows]

    def compact(self, waiting: list[bool], feed: list[int]) -> list[int]:
        """The finished rows leave the batch and the cache (a copy of it) -> the waiting rows' feed."""
        keep = [j for j, w in enumerate(waiting) if w]
        sel = torch.tensor(keep, device=self.device)
        self.lm.select(sel)
        self.rows = [self.rows[j] for j in keep]
        self.valid, self.positions = self.valid[sel], self.positions[sel]
        self.pad = self.pad[sel]
        return [feed[j] for j in keep]

    def step(self, feed: list[int]) -> Tensor:
        """One token per batch row at the next cache column -> the logits of the next (B', V)."""
        col = self.col
        tokens = torch.tensor(feed, device=self.device)[:, None]
        mask = self.valid[:, None, None, : col + 1]
        h = self.lm(tokens, col, self.positions[:, col : col + 1], mask)
        self.col += 1
        return self.lm.logits(h[:, -1])

    def output(self) -> BatchOutput:
        if self.topk:
            self.out.topk_values = [torch.stack(v) for v in self.kept_v]
            self.out.topk_indices = [torch.stack(i) for i in self.kept_i]
        return self.out


@torch.inference_mode()
def decode_batch(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_ids: list[int] | tuple[int, ...] = (),
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int | None = None,
    capture: tuple[int, ...] = (),
    topk: int = 0,
    deadline: float | None = None,
) -> BatchOutput:
    """Plain decoding of several prompts at once with a Llama-family HF model through `BatchLM` (see
    `generate_batch` for the contract). With `capture` (a head's aux layers) every row's final token is fed
    once more so that its features exist, and the output carries what a head trains on. With `topk` it also
    keeps, for every new token, the k largest log-probabilities (temperature 1) of the logits it was drawn
    from: the teacher's top-k cache of distillation, with no second pass. At `deadline` (a `time.perf_counter()`
    value) the rows still sampling stop where they are (`halted`): a time budget cuts answers short, it does not
    change a token of them."""
    generators = _check_call(prompts, max_new_tokens, sampling, generators)
    run = _BatchDecode(model, prompts, max_new_tokens, sampling, eos_ids, generators, vocab_size, capture, topk)
    logits = run.prefill()
    while True:
        feed = run.sample(logits)
        if deadline is not None and not run.out.halted and time.perf_counter() >= deadline:
            run.halt()
        waiting = run.waiting()
        if not any(waiting):
            break
        if sum(waiting) <= 0.75 * len(waiting):  # compact: the finished rows leave the batch and the cache
            feed = run.compact(waiting, feed)
        logits = run.step(feed)
    return run.output()


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_ids: list[int] | tuple[int, ...] = (),
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int | None = None,
    lean: bool = True,
) -> list[list[int]]:
    """Plain decoding of several prompts at once with a Hugging Face causal LM -> each row's new tokens.

    Left padding (attention mask and position ids skip the pads), one KV cache for the batch, rows that hit
    EOS leave the batch. Row b samples from `generators[b]` (needed at temperature > 0) with the very step
    `decode.speculative.generate` takes without a draft, so a row's tokens are the ones that decoding it
    alone gives. `vocab_size` cuts or pads (-inf) the logits to another model's vocabulary. Llama-family
    models run through `decode_batch` (`lean=False`: Hugging Face's forward for them too).
    """
    from transformers import DynamicCache

    generators = _check_call(prompts, max_new_tokens, sampling, generators)
    if lean_supported(model.config)[0] and lean:
        return decode_batch(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids,
                            generators=generators, vocab_size=vocab_size).tokens
    B = len(prompts)
    device = next(model.parameters()).device
    stop = set(eos_ids)
    P = max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    attn = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        attn[b, P - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, P): a row's first real token is at position 0
    cache = DynamicCache(config=model.config)
    out: list[list[int]] = [[] for _ in range(B)]
    live = list(range(B))  # batch row j decodes prompt live[j]
    feed = ids
    for step in range(max_new_tokens):
        logits = model(input_ids=feed, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]  # (len(live), V)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if vocab_size is not None:
            logits = fit_vocab(logits, vocab_size)
        keep, nxt = [], []
        for j, b in enumerate(live):
            tok = _pick(logits[j], sampling, generators[b])
            out[b].append(tok)
            if tok not in stop:
                keep.append(j)
                nxt.append(tok)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(live):  # finished rows leave the batch (and the cache)
            rows = torch.tensor(keep, device=device)
            cache.batch_select_indices(rows)
            attn, pos = attn[rows], pos[rows]
            live = [live[j] for j in keep]
        feed = torch.tensor(nxt, device=device)[:, None]
        attn = torch.cat([attn, attn.new_ones(len(live), 1)], dim=1)
        pos = pos[:, -1:] + 1
    return out


__all__ = ["GEN_DTYPES", "BatchLM", "BatchOutput", "TargetVocab", "decode_batch", "generate_batch", "writer_model"]
