"""The target's top-k log-probabilities on every training row, computed once and kept on disk for reuse.

    from draftsmith.distill.teacher_cache import build_teacher_cache
    cache = build_teacher_cache(load(target), rows, Path("runs/x/distill/data/teacher-topk"), k=64)
    logits = cache.logits([0, 3], mask)           # (B, T, V) teacher logits for a training micro-batch

`rows` are the training rows, (prompt_ids, continuation_ids) pairs, in the order training indexes them.
For row i (P prompt and C continuation tokens) the cache holds, at each of the C positions whose logits
predict a continuation token, the k largest log softmax(target logits) and their token ids. They are taken
at temperature 1: the top-k set is the same at every temperature and log-probs differ from logits by a
per-position constant, so one cache serves every `TrainConfig.temperature`. `logits` rebuilds them with
`distill.divergences.topk_teacher_logits` (-inf outside the top k): at k = V that is the target itself.

They come from a batched prefill of the rows (teacher-forced: far cheaper a token than the target writing them):
rows of like length batched together, a Llama-family target's LM head run only at the scored positions, and rows
answering one prompt (`samples_per_prompt`) scored over one prefill of it, its KV cache shared; the
progress bar counts rows and shows continuation tokens scored a second. `dtype="float16"` keeps the values in
half the space (ids are int32 either way): the compact form, 6 bytes an entry.

Folder `root/<key>/`, key = sha256 of the target (folder identity and a sample of its weights), the rows,
k, the value dtype and FORMAT_VERSION, so a cache made for another target, other data or another k is never
read: a new one is built, and complete caches under other keys are removed once it is done.
- `settings.json`: what the key covers, readable.
- `shard-NNNNN.safetensors`: rows [N*S, (N+1)*S) as `values` (positions, k), `indices` (positions, k) and
  `lengths` (rows,); each is written beside and renamed into place, so an interrupted build resumes at the
  shards still missing. With several processes shard N is built by rank N % processes.
- `done.json`: every shard is there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_path, atomic_write_json, atomic_write_text, folder_identity
from draftsmith.decode.runtime.lean import lean_supported
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.distill.data import collate
from draftsmith.distill.divergences import topk_teacher_logits

FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "float16": torch.float16}
ROWS_PER_SHARD = 256
DONE = "done.json"

Rows = list[tuple[list[int], list[int]]]


def _weights_sample(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape, dtype and first and last 256 values: different weights
    (another seed, another fine-tune saved in the same folder) give another key, without hashing gigabytes."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            for part in (flat[:256], flat[-256:]):
                h.update(part.to(torch.float64).cpu().numpy().tobytes())
    return h.hexdigest()


def cache_settings(target: Loaded, rows: Rows, k: int, dtype: str) -> dict:
    """Everything the cached numbers depend on."""
    rows_blob = json.dumps([[list(p), list(c)] for p, c in rows], separators=(",", ":")).encode()
    return {
        "format": FORMAT_VERSION,
        "target": folder_identity(target.path),
        "target_weights": _weights_sample(target.model),
        "rows": len(rows),
        "rows_sha256": hashlib.sha256(rows_blob).hexdigest(),
        "k": int(k),
        "dtype": dtype,
        "rows_per_shard": ROWS_PER_SHARD,
    }


def cache_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]


class TeacherTopK:
    """A finished cache, held in memory: row i's (values, indices), and teacher logits for a micro-batch."""

    def __init__(self, folder: Path, vocab_size: int) -> None:
        from safetensors.torch import load_file

        self.folder, self.vocab_size = Path(folder), vocab_size
        shards = sorted(self.folder.glob("shard-*.safetensors"))
        parts = [load_file(str(s)) for s in shards]
        if not parts:
            raise DraftsmithError(f"{folder} holds no teacher shards")
        self.values = torch.cat([p["values"] for p in parts])  # (positions, k)
        self.indices = torch.cat([p["indices"] for p in parts])  # (positions, k)
        lengths = torch.cat([p["lengths"] for p in parts])  # (rows,)
        self.offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        self.offsets[1:] = lengths.cumsum(0)
        self.k = self.values.shape[-1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> tuple[Tensor, Tensor]:
        """(values (C, k) log-probs, indices (C, k) token ids) of row i, one line per continuation token."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.values[a:b], self.indices[a:b]

    def logits(self, idx: list[int], mask: Tensor) -> Tensor:
        """Teacher logits (B, T, V) float32 for rows `idx` collated with loss mask `mask` (B, T): row b's
        cached positions fill its masked-in positions in order; elsewhere 0 (never read by a divergence)."""
        B, T = mask.shape
        parts = [self.row(i) for i in idx]
        values = torch.cat([v for v, _ in parts]).float()
        indices = torch.cat([j for _, j in parts])
        if values.shape[0] != int(mask.sum()):
            raise DraftsmithError(f"teacher cache {self.folder} does not match the rows being trained on")
        out = torch.zeros(B, T, self.vocab_size, dtype=torch.float32, device=mask.device)
        out[mask] = topk_teacher_logits(values, indices, self.vocab_size).to(mask.device)
        return out


@torch.no_grad()
def _shard(target: Loaded, rows: Rows, lo: int, hi: int, k: int, dtype: torch.dtype, batch_size: int,
           device: torch.device, bar=None) -> dict[str, Tensor]:
    """Rows [lo, hi)'s top-k, `batch_size` rows a prefill: rows of like length together (less padding), each
    row's numbers back in its place. `bar` (a `_Rate`) is told the rows and continuation tokens of each batch."""
    values: dict[int, Tensor] = {}
    indices: dict[int, Tensor] = {}

    def keep(idx: list[int], logits: Tensor) -> None:
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
        v, j = top.values.to(dtype).cpu(), top.indices.to(torch.int32).cpu()
        n = [len(rows[i][1]) for i in idx]
        for i, vi, ji in zip(idx, v.split(n), j.split(n)):
            values[i], indices[i] = vi, ji
        if bar is not None:
            bar(len(idx), sum(n))

    single = list(range(lo, hi))
    if _lean_body(target.model):  # answers to one prompt (samples_per_prompt): the prompt prefilled once for them
        groups: dict[tuple[int, ...], list[int]] = {}
        for i in range(lo, hi):
            groups.setdefault(tuple(rows[i][0]) if rows[i][1] else ("row", i), []).append(i)
        single = [g[0] for g in groups.values() if len(g) == 1]
        for g in (g for g in groups.values() if len(g) > 1):
            for a in range(0, len(g), batch_size):
                keep(g[a : a + batch_size], _shared_prompt_logits(target.model, rows, g[a : a + batch_size], device))
    order = sorted(single, key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    for a in range(0, len(order), batch_size):
        idx = order[a : a + batch_size]
        ids, attn, mask = collate(rows, idx, device)
        keep(idx, _masked_logits(target.model, ids, attn, mask))
    lengths = torch.tensor([len(rows[i][1]) for i in range(lo, hi)], dtype=torch.long)
    return {"values": torch.cat([values[i] for i in range(lo, hi)]).contiguous(),
            "indices": torch.cat([indices[i] for i in range(lo, hi)]).contiguous(), "lengths": lengths}


class _Rate:
    """A tqdm bar counting rows, its postfix the continuation tokens scored a second."""

    def __init__(self, bar) -> None:
        self.bar, self.tokens, self.t0 = bar, 0, time.perf_counter()

    def __call__(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.1f} tokens/s",
                                 refresh=False)
        self.bar.update(rows)


def _lean_body(model) -> bool:
    """Whether `model` is a Llama-family causal LM whose logits are its LM head over its body's last hidden state."""
    return lean_supported(model.config)[0] and hasattr(model, "model")


def _shared_prompt_logits(model, rows: Rows, idx: list[int], device) -> Tensor:
    """The logits (N, V) at the positions predicting the continuation tokens of rows `idx`, which share one
    prompt: the prompt prefilled once (its last position predicts every row's first token), its KV cache repeated
    for the rows, then all continuations (right-padded, each but its last token) in one forward over that cache.
    Rows in `idx` order, each row's positions in order: what `_masked_logits` of the rows collated gives."""
    prompt = rows[idx[0]][0]
    body, head = model.model, model.get_output_embeddings()
    out = body(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    first = out.last_hidden_state[0, -1:]
    conts = [rows[i][1] for i in idx]
    L = max(len(c) for c in conts) - 1
    if L < 1:
        return head(first.expand(len(idx), -1))
    cache = out.cache
    cache.batch_repeat_interleave(len(idx))
    P = len(prompt)
    ids = torch.zeros(len(idx), L, dtype=torch.long, device=device)
    attn = torch.zeros(len(idx), P + L, dtype=torch.long, device=device)
    attn[:, :P] = 1
    for b, c in enumerate(conts):
        ids[b, : len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
        attn[b, P : P + len(c) - 1] = 1
    h = body(input_ids=ids, attention_mask=attn, cache=cache, use_cache=False,
             position_ids=torch.arange(P, P + L, device=device).expand(len(idx), -1)).last_hidden_state
    return head(torch.cat([torch.cat([first, h[b, : len(c) - 1]]) for b, c in enumerate(conts)]))


def _masked_logits(model, ids: Tensor, attn: Tensor, mask: Tensor) -> Tensor:
    """The logits (N, V) at the N positions `mask` marks (those predicting continuation tokens). A Llama-family
    model's LM head runs on those positions only (its logits are the head of the final hidden state); other
    models through their own forward, whole."""
    if _lean_body(model):
        h = model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        return model.get_output_embeddings()(h[mask])
    return model(input_ids=ids, attention_mask=attn, use_cache=False).logits[mask]


def build_teacher_cache(
    target: Loaded,
    rows: Rows,
    root: Path,
    *,
    k: int = 64,
    dtype: str = "float32",
    batch_size: int = 8,
    rank: int = 0,
    processes: int = 1,
    wait: Callable[[], None] | None = None,
    progress: bool = True,
) -> TeacherTopK:
    """The cache of `target`'s top-k on `rows` under `root` (see the module docstring): loaded when complete,
    else built (resuming at the missing shards). k is capped at the target's vocabulary size.

    Several processes: every rank calls this with its `rank`, the number of `processes` and a `wait` that
    blocks until all ranks arrive (accelerate's wait_for_everyone); each builds its own shards."""
    folder, settings, k, V = _place(target, rows, root, k, dtype)
    root = Path(root)
    wait = wait or (lambda: None)
    if not (folder / DONE).is_file():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_json(folder / "settings.json", settings)
        except OSError as e:
            raise DraftsmithError(f"cannot write the teacher cache under {root}: {e.strerror}") from None
        n_shards = -(-len(rows) // ROWS_PER_SHARD)
        mine = [j for j in range(n_shards) if j % processes == rank and not (folder / _shard_name(j)).is_file()]
        device = next(target.model.parameters()).device
        was_training = target.model.training
        target.model.eval()
        spans = [(j * ROWS_PER_SHARD, min((j + 1) * ROWS_PER_SHARD, len(rows))) for j in mine]
        bar = tqdm(total=sum(hi - lo for lo, hi in spans), desc=f"teacher top-{k}", unit="row", disable=not progress)
        rate = _Rate(bar)
        try:
            for j, (lo, hi) in zip(mine, spans):
                _write_shard(folder / _shard_name(j), _shard(target, rows, lo, hi, k, DTYPES[dtype], batch_size, device,
                                                             rate))
        finally:
            bar.close()
            target.model.train(was_training)
        wait()
        missing = [j for j in range(n_shards) if not (folder / _shard_name(j)).is_file()]
        if missing:
            raise DraftsmithError(f"teacher cache {folder} lacks shard(s) {missing[:5]} after building")
        if rank == 0:
            _seal(folder, n_shards, len(rows))
        wait()
    return TeacherTopK(folder, V)


def _place(target: Loaded, rows: Rows, root: Path, k: int, dtype: str) -> tuple[Path, dict, int, int]:
    """(folder, settings, k capped at the vocabulary, V) of the cache for these arguments."""
    if dtype not in DTYPES:
        raise DraftsmithError(f"teacher cache dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if k < 1:
        raise DraftsmithError(f"teacher top-k must be >= 1, got {k}")
    if not rows or any(not p or not c for p, c in rows):
        raise DraftsmithError("every training row needs prompt and continuation tokens")
    V = target.model.get_output_embeddings().weight.shape[0]
    k = min(k, V)
    settings = cache_settings(target, rows, k, dtype)
    return Path(root) / cache_key(settings), settings, k, V


def write_teacher_cache(target: Loaded, rows: Rows, root: Path, values: list[Tensor], indices: list[Tensor], *,
                        dtype: str = "float32") -> TeacherTopK:
    """The cache from top-k log-probs kept while the target generated `rows` (row i: values and indices
    (C_i, k), k = the cache's k), written where `build_teacher_cache` with the same arguments looks, so
    training finds it complete. The numbers are the target's, computed in decoding's batches rather than
    teacher-forced ones: they agree to rounding."""
    if len(values) != len(rows) or len(indices) != len(rows):
        raise DraftsmithError(f"top-k for {len(values)} rows, {len(rows)} rows to cache")
    k = values[0].shape[-1]
    folder, settings, k_capped, V = _place(target, rows, root, k, dtype)
    for (_, c), v, j in zip(rows, values, indices):
        if v.shape != (len(c), k) or j.shape != (len(c), k):
            raise DraftsmithError("kept top-k does not match the rows' continuations")
    if k != k_capped:
        raise DraftsmithError(f"kept top-{k} exceeds the target's vocabulary ({V})")
    if not (folder / DONE).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(folder / "settings.json", settings)
        for j, lo in enumerate(range(0, len(rows), ROWS_PER_SHARD)):
            hi = min(lo + ROWS_PER_SHARD, len(rows))
            _write_shard(folder / _shard_name(j), {
                "values": torch.cat(values[lo:hi]).to(DTYPES[dtype]).contiguous(),
                "indices": torch.cat(indices[lo:hi]).to(torch.int32).contiguous(),
                "lengths": torch.tensor([len(rows[i][1]) for i in range(lo, hi)], dtype=torch.long)})
        _seal(folder, -(-len(rows) // ROWS_PER_SHARD), len(rows))
    return TeacherTopK(folder, V)


def _shard_name(j: int) -> str:
    return f"shard-{j:05d}.safetensors"


def _write_shard(path: Path, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


def _seal(folder: Path, n_shards: int, n_rows: int) -> None:
    """Mark the cache in `folder` complete; complete caches beside it (other keys) go."""
    atomic_write_text(folder / DONE, json.dumps({"shards": n_shards, "rows": n_rows}) + "\n")
    _remove_stale(folder.parent, keep=folder)


def _remove_stale(root: Path, keep: Path) -> None:
    """Complete caches under other keys (another target, data or k) will never be read again."""
    for other in root.iterdir():
        if other != keep and other.is_dir() and (other / DONE).is_file():
            shutil.rmtree(other, ignore_errors=True)


__all__ = ["TeacherTopK", "build_teacher_cache", "cache_key", "cache_settings", "write_teacher_cache"]
