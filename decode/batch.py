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

A draft writes in its int4 or int8 copy (`quantized_writer(model, "int4", n)`: a lean runner quantised by
`decode.runtime.quant`, the very weights an `int4:MODEL` or int8 draft runs, GPTQ-rounded given a calibration) when
that runner is what `decode_batch` / `generate_batch` get: `BatchLM` then runs the runner's layers. Their Linears run
on draftsmith's kernel (`decode.runtime.native`), which reads a weight once for up to 12 rows and gives each row the
same bits whatever rows are beside it (int4: each row's inputs quantised to int8 on their own; int8: not
quantised), so B rows of a step cost about one row's weight read. A copy rounds its inputs, so a last-bit difference
elsewhere could still change a token; the batch therefore feeds each row exactly as the copy's runner is fed when
`decode.speculative.generate` decodes that row alone: each prompt but its last token prefilled on its own, unpadded
(no padding computed either), then one token a row a step, each attending over its own row's keys with the
runner's call. Every logit then has the runner's bits (tested), and each row gets the tokens that copy decodes for
it alone. `writer_quant` says which copy a model can have here (int8 only where draftsmith's kernel is built:
fbgemm would quantise a whole batch's inputs with one scale).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.decode.runtime import native
from draftsmith.decode.runtime.attention import grouped_attention, rms_norm, rotate_half
from draftsmith.decode.runtime.kernels import DYNAMIC_INT8, linear, native_kernels
from draftsmith.decode.runtime.lean import LeanLM, lean_parts, lean_supported
from draftsmith.decode.runtime.quant import Calibration, draft_quant
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


WRITER_QUANTS = ("int4", "int8")  # the copies a draft may write data in (`quantized_writer`)
_WRITERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (what, its last quantised copy)


def writer_quant(model, requested: str | None) -> str | None:
    """The copy a model writes data in when `requested` ("int4" | "int8" | None) is asked for: the decoder's rule
    (`decode.runtime.quant.draft_quant`: on the CPU, float32, a lean architecture; int4 where draftsmith's int4
    kernel runs, else int8), and int8 only where draftsmith's kernel is built (fbgemm quantises a whole batch's
    inputs with one scale, so rows would change one another's tokens); None: the model as loaded."""
    if requested not in (None, *WRITER_QUANTS):
        raise ValueError(f"a writer's quantisation is one of {', '.join(WRITER_QUANTS)} or None, got {requested!r}")
    got = draft_quant(model, requested)
    return None if got == "int8" and native.kernels() is None else got


def quantized_writer(model, quantize: str, max_seq_len: int, calib: Calibration | None = None) -> LeanLM:
    """`model`'s int4 or int8 copy (`decode.runtime.quant.quantize_int4` / `quantize_int8` of a lean runner, GPTQ on
    `calib` for int4: the weights `make_runner(model, n, quantize=...)` runs) for `decode_batch` / `generate_batch`
    to write with. The last one made for a model is kept while the model lives and reused while its weights are
    unchanged (their version counters) and it holds `max_seq_len` positions."""
    from draftsmith.decode.runtime.allocator import release_freed_memory
    from draftsmith.decode.runtime.quant import quantize_int4, quantize_int8

    if quantize not in WRITER_QUANTS:
        raise ValueError(f"quantize must be one of {', '.join(WRITER_QUANTS)}, got {quantize!r}")
    what = (quantize, None if calib is None else calib.key, tuple(p._version for p in model.parameters()))
    hit = _WRITERS.get(model)
    if hit is not None and hit[0] == what and hit[1].max_seq_len >= max_seq_len:
        return hit[1]
    _WRITERS.pop(model, None)  # the old copy goes before the new one is made
    runner = LeanLM(model, max_seq_len, fast_head=False)
    runner = quantize_int4(runner, calib) if quantize == "int4" else quantize_int8(runner)
    release_freed_memory()  # the float copy it quantised
    _WRITERS[model] = (what, runner)
    return runner


class TargetVocab:
    """A runner whose logits are cut or padded (-inf) to the target's vocabulary, so that every token the
    draft samples on its own is one the target can score (drafts may carry a few padding rows more or less)."""

    def __init__(self, runner: Runner, vocab_size: int) -> None:
        self.runner, self.vocab_size, self.max_seq_len = runner, vocab_size, runner.max_seq_len

    def forward(self, tokens: Tensor, pos: int, keep: int = 0) -> Tensor:
        return fit_vocab(self.runner.forward(tokens, pos, keep), self.vocab_size)


def _attend_alone(q: Tensor, k: Tensor, v: Tensor, end: int, starts: list[int]) -> Tensor:
    """One new token per row, each row's attention the very call a lean runner makes for it alone: q (1, H, 1, D)
    over its own keys, columns [starts[b], end), unmasked. A quantised copy's next layer rounds its inputs to int8,
    so the last bit of a batched kernel's other summation order could change a token; this keeps every bit."""
    Hkv, H = k.shape[1], q.shape[1]
    return torch.cat([F.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, s:end], v[b : b + 1, :, s:end],
                                                     enable_gqa=Hkv != H) for b, s in enumerate(starts)])


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
    """LeanLM's decoder block for B left-padded rows at once, on the HF model's own weights (shared) or on a lean
    runner's (`quantized_writer`: an int4 / int8 copy), with a preallocated KV cache (L, B, Hkv, S, D) and
    optional capture of a head's training features."""

    def __init__(self, model, batch: int, max_seq_len: int, capture: tuple[int, ...] = ()) -> None:
        super().__init__()
        if isinstance(model, LeanLM):  # its layers (fused projections, quantised Linears) and tables
            if model.max_seq_len < max_seq_len:
                raise ValueError(f"the runner holds {model.max_seq_len} positions, the batch needs {max_seq_len}")
            self.layers, self.cos, self.sin = model.layers, model.cos, model.sin
            n_kv, head_dim = model.layers[0].n_kv, model.layers[0].head_dim
            self.embed, self.norm, self.eps, self.lm_head = model.embed, model.norm, model.eps, model.lm_head
        else:
            self.layers, n_kv, head_dim, self.cos, self.sin = lean_parts(model, max_seq_len, "BatchLM")
            base = model.model
            self.embed, self.norm, self.eps = base.embed_tokens, base.norm.weight, model.config.rms_norm_eps
            self.lm_head = model.get_output_embeddings()
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        # int8 Linears on draftsmith's kernel: each row's inputs as they are (fbgemm's would share one scale)
        self.int8 = any(type(m) is DYNAMIC_INT8 for m in self.layers.modules())
        self.alone = isinstance(model, LeanLM)  # a runner's copy: one new token attends as that runner's would
        shape = (len(self.layers), batch, n_kv, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capture = tuple(capture)
        for i in self.capture:
            if not 0 <= i < len(self.layers):
                raise ValueError(f"capture layer {i} is outside the model's {len(self.layers)} layers")
        self.features = self.final = None
        if self.capture:  # what a head trains on, per (row, column): float16 like the head data on disk
            d = self.embed.weight.shape[1]
            self.features = torch.zeros(batch, max_seq_len, len(self.capture) * d, dtype=torch.float16, device=device)
            self.final = torch.zeros(batch, max_seq_len, d, dtype=torch.float16, device=device)

    def select(self, rows: Tensor) -> None:
        """Keep only batch rows `rows` (in that order): a copy of the cache and of the captured features."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        if self.capture:
            self.features, self.final = self.features[rows], self.final[rows]

    def _kernels(self):
        """Where the Linears run: an int8 copy's on draftsmith's kernel (`decode.runtime.kernels.native_kernels`)."""
        return native_kernels() if self.int8 else contextlib.nullcontext()

    def forward(self, tokens: Tensor, start: int, positions: Tensor, mask: Tensor, rows: slice = slice(None),
                first: int = 0) -> Tensor:
        """tokens (B, T) of batch rows `rows` (all by default) written at cache columns [start, start+T), RoPE at
        `positions` (B, T), attention over columns [first, start+T) under `mask` (B, 1, T, start+T-first) -> hidden
        states after the final norm (B, T, d)."""
        B, T = tokens.shape
        end = start + T
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (B, 1, T, D)
        x = self.embed(tokens)
        seen = {}
        starts = (end - mask[:, 0, -1].sum(-1)).tolist() if self.alone and T == 1 else None  # each row's first key
        with self._kernels():
            for i, layer in enumerate(self.layers):
                if i in self.capture:
                    seen[i] = x
                H, Hkv, D = layer.n_heads, layer.n_kv, layer.head_dim
                h = rms_norm(x, layer.norm_in, layer.eps)
                q, k, v = layer.project_qkv(h, _linear)
                q = q.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
                k = k.reshape(B, T, Hkv, D).transpose(1, 2)
                v = v.reshape(B, T, Hkv, D).transpose(1, 2)
                q = q * cos + rotate_half(q) * sin
                keys, values = self.k[i, rows], self.v[i, rows]  # views of the cache
                keys[:, :, start:end] = k * cos + rotate_half(k) * sin
                values[:, :, start:end] = v
                if starts is not None:
                    o = _attend_alone(q, keys, values, end, starts)
                else:
                    o = _attend(q, keys[:, :, first:], values[:, :, first:], end - first, mask)
                x = x + _linear(o.transpose(1, 2).reshape(B, T, H * D), layer.o)
                x = x + layer.feed_forward(rms_norm(x, layer.norm_post, layer.eps), _linear)
        h = rms_norm(x, self.norm, self.eps)
        if self.capture:
            self.features[rows, start:end] = torch.cat([seen[i] for i in self.capture], dim=-1).half()
            self.final[rows, start:end] = h.half()
        return h

    def logits(self, h: Tensor) -> Tensor:
        with self._kernels():
            logits = _linear(h, self.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()


def _linear(x: Tensor, layer: nn.Module) -> Tensor:
    """`decode.runtime.kernels.linear` over x (..., d): a float Linear takes it as it is, a quantised one (int4,
    int8: kernels over 2-D rows) as rows."""
    if type(layer) is nn.Linear:
        return linear(x, layer)
    y = linear(x.reshape(-1, x.shape[-1]), layer)
    return y.view(*x.shape[:-1], y.shape[-1])


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
        is then copied) -> the logits (B, V) each row's first new token comes from. A runner's quantised copy reads
        each prompt but its last token on its own, unpadded, then the last tokens together, one a row: as
        `decode.speculative.generate` feeds that runner, so its int8 inputs round as they do there (and no padding
        is computed)."""
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
        ids = ids.to(device)
        if lm.alone and not self.capture:  # the same bits as the runner's own decode of each prompt
            for u, p in enumerate(firsts):
                c, n = P - len(p), len(p) - 1  # its first column, the tokens before its last
                if n:
                    lm(ids[u : u + 1, c : P - 1], c, positions_u[u : u + 1, c : P - 1], causal[None, None, :n, :n],
                       rows=slice(u, u + 1), first=c)
            h = lm(ids[:, -1:], P - 1, positions_u[:, P - 1 : P], valid_u[:, None, None, :P])
        else:
            h = lm(ids, 0, positions_u[:, :P], mask)
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
    """Plain decoding of several prompts at once with a Llama-family HF model, or a lean runner's int4 / int8 copy
    of one (`quantized_writer`), through `BatchLM` (see `generate_batch` for the contract). With `capture` (a
    head's aux layers) every row's final token is fed once more so that its features exist, and the output
    carries what a head trains on. With `topk` it also keeps, for every new token, the k largest
    log-probabilities (temperature 1) of the logits it was drawn from: the teacher's top-k cache of
    distillation, with no second pass. At `deadline` (a `time.perf_counter()` value) the rows still sampling
    stop where they are (`halted`): a time budget cuts answers short, it does not change a token of them."""
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
    models run through `decode_batch` (`lean=False`: Hugging Face's forward for them too), and so does a lean
    runner (`quantized_writer`: a draft's int4 or int8 copy), whose rows are the ones it decodes alone.
    """
    from transformers import DynamicCache

    generators = _check_call(prompts, max_new_tokens, sampling, generators)
    if isinstance(model, LeanLM) or (lean and lean_supported(model.config)[0]):
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


__all__ = ["GEN_DTYPES", "WRITER_QUANTS", "BatchLM", "BatchOutput", "TargetVocab", "decode_batch", "generate_batch",
           "quantized_writer", "writer_model", "writer_quant"]
