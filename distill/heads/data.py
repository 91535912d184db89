"""Training data for a draft head: the target's own text with its hidden states at the head's aux layers.

    from draftsmith.distill.heads.data import HeadDataConfig, build_head_data, load_head_data
    build_head_data(load("smollm2-135m-instruct"), prompts, Path("runs/head/data"), HeadDataConfig(samples=8))
    data = load_head_data(Path("runs/head/data"))

Each prompt gets `samples` continuations of the target (sampled at `temperature`, one generator per (prompt,
sample) seeded from `seed`, so a row does not depend on batching or interruptions), decoded in batches (rows
sorted by prompt length). Llama-family targets keep what the head needs while they decode
(`decode.batch.decode_batch(capture=...)`: no second pass); others get one teacher-forced forward of the target
over prompt + continuation afterwards. Either way, per position t: the features (the residual stream entering each aux layer, HF's `output_hidden_states[i]`,
concatenated: 3H, float16), the final hidden state after the target's norm (H, float16: the target's logits are
`lm_head(final)`, recomputed at training time over the draft vocabulary only) and the target's greedy next token.

`dtype="bfloat16"` has a bfloat16 copy of the target write (2-3x faster on CPUs with AMX; the target is
untouched); its tokens and features are the target's up to that rounding.

Folder: `settings.json` (a rerun with other settings is refused), `shard-NNNNN.safetensors` (one per batch of
prompts, written atomically: a rerun resumes after the last finished shard), `stats.json`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from draftsmith.decode.batch import GEN_DTYPES, decode_batch, generate_batch, writer_model
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_path, atomic_write_json, read_json
from draftsmith.decode.runtime.lean import lean_supported
from draftsmith.decode.runtime.loading import Loaded, eos_ids
from draftsmith.decode.prompts import Prompt
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.textgen import prompt_ids


@dataclass
class HeadDataConfig:
    """How much of the target's text a head trains on."""

    samples: int = 4  # continuations per prompt
    max_new_tokens: int = 128  # tokens per continuation
    temperature: float = 0.8  # sampling temperature of the continuations (0 = greedy: one per prompt)
    seed: int = 0
    batch_size: int = 32  # rows decoded together
    aux_layers: tuple[int, int, int] = (2, 15, 27)  # the target layers whose input hidden states are kept
    dtype: str = "float32"  # the target's weights while it writes (a copy): bfloat16 runs 2-3x faster with AMX

    def __post_init__(self) -> None:
        self.aux_layers = tuple(int(i) for i in self.aux_layers)  # type: ignore[assignment]
        if self.dtype not in GEN_DTYPES:
            raise DraftsmithError(f"dtype must be one of {', '.join(GEN_DTYPES)}, got {self.dtype!r}")
        if self.samples < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise DraftsmithError("samples, max_new_tokens and batch_size must be >= 1")
        if self.temperature < 0:
            raise DraftsmithError(f"temperature must be >= 0, got {self.temperature}")


@torch.inference_mode()
def target_features(model, seqs: list[list[int]], aux_layers: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """One teacher-forced forward over each sequence (right-padded batch): features (T, 3H), final (T, H), next (T,)."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states  # (L+1) x (B, T, H); the last one is after the final norm
    feats = torch.cat([hs[i] for i in aux_layers], dim=-1)
    rows = []
    for b, s in enumerate(seqs):
        n = len(s)
        rows.append({"tokens": torch.tensor(s, dtype=torch.int32), "features": feats[b, :n].half().cpu(),
                     "final": hs[-1][b, :n].half().cpu(), "next": out.logits[b, :n].argmax(-1).int().cpu()})
    return rows


FORMAT = 2  # 2: rows sorted by prompt length into shards


def _settings(target: Loaded, prompts: list[Prompt], cfg: HeadDataConfig) -> dict:
    settings = {"format": FORMAT, "target": target.name, "prompts": [p.id for p in prompts], **asdict(cfg),
                "aux_layers": list(cfg.aux_layers)}
    if cfg.dtype == "float32":  # folders written before the option existed stay resumable
        del settings["dtype"]
    return settings


def generation_seconds(stats: dict) -> float:
    """The seconds a head data folder's stats record for writing it (generation and features, every run)."""
    return stats["generate_seconds"] + stats["feature_seconds"]


def _write_shard(path: Path, rows: list[dict], prompt_lens: list[int]) -> torch.Tensor:
    """One shard file, written atomically -> its rows' lengths."""
    lengths = torch.tensor([len(r["tokens"]) for r in rows])
    with atomic_path(path) as tmp:
        save_file({"offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                   "prompt_len": torch.tensor(prompt_lens),
                   **{key: torch.cat([r[key] for r in rows]) for key in ("tokens", "features", "final", "next")}},
                  str(tmp))
    return lengths


def build_head_data(target: Loaded, prompts: list[Prompt], out: Path, cfg: HeadDataConfig,
                    progress: bool = True, max_seconds: float | None = None) -> dict:
    """Generate (or resume) the folder; returns its stats (tokens, rows, seconds, tokens/s of generation).

    `max_seconds` caps `generation_seconds` (over every run into the folder): each missing shard gets an equal part
    of what is left and, in the lean runner, its answers stop there (every token still the target's; other models
    write whole shards); shards with nothing left are not written (stats: `cut_shards`, `skipped_shards`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(target, prompts, cfg)
    old = read_json(out / "settings.json", missing_ok=True, what="head data settings")
    if old is not None and old != settings:
        changed = sorted(k for k in settings if old.get(k) != settings[k])
        raise DraftsmithError(f"{out}: made with other settings ({', '.join(changed)}); use another folder")
    atomic_write_json(out / "settings.json", settings)
    encoded = [prompt_ids(target.tokenizer, p.prompt) for p in prompts]
    jobs = [(i, s) for i in range(len(prompts)) for s in range(cfg.samples if cfg.temperature > 0 else 1)]
    jobs.sort(key=lambda job: len(encoded[job[0]]))  # stable: similar lengths share a batch (less padding)
    L = target.model.config.num_hidden_layers
    if any(not 0 <= i < L for i in cfg.aux_layers):
        raise DraftsmithError(f"aux layers {list(cfg.aux_layers)} outside the target's {L} layers")
    lean = lean_supported(target.model.config)[0]
    shards = [jobs[i : i + cfg.batch_size] for i in range(0, len(jobs), cfg.batch_size)]
    stats = read_json(out / "stats.json", missing_ok=True, what="head data stats") or {
        "rows": 0, "tokens": 0, "new_tokens": 0, "generate_seconds": 0.0, "feature_seconds": 0.0}
    sampling = SamplingParams(cfg.temperature)
    eos = eos_ids(target)
    bar = tqdm(total=len(shards), desc="head data", unit="shard", disable=not progress)
    model = None  # the writer, made when a shard is missing
    missing = sum(not (out / f"shard-{n:05d}.safetensors").is_file() for n in range(len(shards)))
    stats["skipped_shards"] = 0
    for n, shard in enumerate(shards):
        path = out / f"shard-{n:05d}.safetensors"
        if path.is_file():
            bar.update(1)
            continue
        deadline = None
        if max_seconds is not None:
            left = max_seconds - generation_seconds(stats)
            if left <= 0:
                stats["skipped_shards"] += 1
                bar.update(1)
                continue
            deadline = time.perf_counter() + left / missing
        missing -= 1
        gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + i * 1009 + s) for i, s in shard]
        model = model if model is not None else writer_model(target.model, cfg.dtype)
        t0 = time.perf_counter()
        kw = dict(max_new_tokens=cfg.max_new_tokens, sampling=sampling, eos_ids=eos,
                  generators=gens if cfg.temperature > 0 else None)
        batch = [encoded[i] for i, _ in shard]
        if lean:
            got = decode_batch(model, batch, capture=cfg.aux_layers, deadline=deadline, **kw)
            new = got.tokens
            stats["cut_shards"] = stats.get("cut_shards", 0) + got.halted
            rows = [{"tokens": torch.tensor(p + t, dtype=torch.int32), "features": f, "final": h, "next": n}
                    for p, t, f, h, n in zip(batch, got.tokens, got.features, got.final, got.next)]
        else:
            new = generate_batch(model, batch, **kw)
        t1 = time.perf_counter()
        if not lean:
            seqs = [p + toks for p, toks in zip(batch, new)]
            rows = []
            for k in range(0, len(seqs), 8):  # features in small batches: the hidden states of 30 layers add up
                rows += target_features(model, seqs[k : k + 8], cfg.aux_layers)
        t2 = time.perf_counter()
        lengths = _write_shard(path, rows, [len(encoded[i]) for i, _ in shard])
        stats["rows"] += len(rows)
        stats["tokens"] += int(lengths.sum())
        stats["new_tokens"] += sum(len(t) for t in new)
        stats["generate_seconds"] += t1 - t0
        stats["feature_seconds"] += t2 - t1
        stats["generate_tokens_per_s"] = stats["new_tokens"] / stats["generate_seconds"]
        atomic_write_json(out / "stats.json", stats)
        bar.update(1)
        bar.set_postfix(tok_s=f"{stats['generate_tokens_per_s']:.0f}", tokens=stats["tokens"])
    bar.close()
    if stats["skipped_shards"]:
        atomic_write_json(out / "stats.json", stats)
    return stats


def head_data_texts(folder: Path) -> list[list[int]]:
    """The continuations the target wrote in the folder (each row's tokens after its prompt), read without the
    features."""
    from safetensors import safe_open

    texts = []
    for path in sorted(Path(folder).glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tokens, off = f.get_tensor("tokens").long(), f.get_tensor("offsets").tolist()
            plen = f.get_tensor("prompt_len")
        texts += [tokens[off[b] + int(plen[b]) : off[b + 1]].tolist() for b in range(len(off) - 1)]
    if not texts:
        raise DraftsmithError(f"{folder}: no head data shards (build_head_data writes them)")
    return texts


def load_head_data(folder: Path) -> list[dict[str, torch.Tensor]]:
    """Every row of the folder: tokens (T,), features (T, 3H), final (T, H), next (T,), prompt_len."""
    rows = []
    for path in sorted(Path(folder).glob("shard-*.safetensors")):
        t = load_file(str(path))
        off = t["offsets"].tolist()
        for b in range(len(off) - 1):
            a, z = off[b], off[b + 1]
            rows.append({"tokens": t["tokens"][a:z].long(), "features": t["features"][a:z],
                         "final": t["final"][a:z], "next": t["next"][a:z].long(),
                         "prompt_len": int(t["prompt_len"][b])})
    if not rows:
        raise DraftsmithError(f"{folder}: no head data shards (build_head_data writes them)")
    return rows
