"""Prompts the target writes itself: the pre-query template (Magpie, Xu et al. 2024), deduplicated, resumable.

    from draftsmith.distill.prompt_gen import generate_prompts
    ds = generate_prompts(load("qwen2.5-coder-0.5b-instruct"), 2000, ["code", "json", "summarize", "chat"],
                          Path("runs/x/prompts"))
    prompts = load_prompts(Path("runs/x/prompts"))        # decode.prompts reads the folder as it is

An instruct model given its chat template up to the start of a user turn (a system line per domain, then the
user header, no user text) writes a plausible user request and closes the turn. Attempt i writes for domain
`domains[i % len(domains)]` with a generator seeded from (seed, i), so its text depends on nothing else; a
domain stops getting attempts once it holds its share of `n` (round-robin). A request is kept when it ended
the turn (not the token cap), has `min_chars` characters, and is neither an exact duplicate (after
`normalize`) nor a near-duplicate (word 3-gram Jaccard >= `dedup_threshold` with a kept one: MinHash LSH
finds candidates, the exact Jaccard decides). Decisions replay in attempt order, so the kept set does not
depend on `batch_size` or on interruptions.

Folder `out` (appears in one rename, always complete): a `datasets.save_to_disk` dataset (id, domain, prompt),
`settings.json` (a rerun with other settings is refused) and `stats.json`. While generating, `<out>.partial/`
holds settings.json and rows.jsonl (every attempt, a batch at a time); a rerun resumes after its last row.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import time
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from tqdm.auto import tqdm

from draftsmith.decode.batch import GEN_DTYPES, generate_batch, writer_model
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_dir, atomic_write_json, atomic_write_text, folder_identity, read_json
from draftsmith.decode.runtime.loading import Loaded, eos_ids
from draftsmith.decode.rows import append_rows
from draftsmith.decode.sampling import SamplingParams
from draftsmith.pairing.reference import prompt_seed

FORMAT_VERSION = 1
DOMAINS: dict[str, str] = {  # the system line that steers what the "user" asks for
    "code": "You are a coding assistant. Users ask you to write, explain, debug or review code.",
    "json": "You are a data assistant. Users ask for JSON: extracting fields from text, converting data, "
            "or filling a schema.",
    "summarize": "You are a summarization assistant. Users paste a passage (an article, email, report or "
                 "transcript) and ask for a summary of it.",
    "chat": "You are a helpful assistant. Users ask everyday questions, seek advice, or request explanations "
            "and creative writing.",
}
REASONS = ("length_cap", "too_short", "duplicate", "near_duplicate")
SETTINGS, STATS, ROWS = "settings.json", "stats.json", "rows.jsonl"
FEATURES = datasets.Features({k: datasets.Value("string") for k in ("id", "domain", "prompt")})
_SENTINEL = "DRAFTSMITHUSERTURN"  # alphanumeric: survives templates that trim or escape the content
_NUM_PERM = 128
_ROW_KEYS = {"index", "domain", "text", "tokens", "clean"}


# -- deduplication: small pure functions ---------------------------------------------------------------------


def normalize(text: str) -> str:
    """Case-folded NFKC text with every run of non-alphanumerics one space: what counts as "the same"."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return re.sub(r"[\W_]+", " ", text).strip()


def shingles(text: str, n: int = 3) -> frozenset[str]:
    """The word n-grams of the normalized text; a text of fewer than n words is one shingle (empty: none)."""
    words = normalize(text).split()
    return frozenset(" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1)) if words)


def jaccard(a: frozenset[str] | set[str], b: frozenset[str] | set[str]) -> float:
    """|a & b| / |a | b|; two empty sets are identical (1.0)."""
    return len(a & b) / len(a | b) if a or b else 1.0


def minhash_signature(items: Iterable[str], num_perm: int = _NUM_PERM, seed: int = 0) -> np.ndarray:
    """(num_perm,) minima of multiply-shift hashes of the items' 32-bit blake2b values: P(equal entry) between
    two signatures is the Jaccard similarity of the sets."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2**64, size=num_perm, dtype=np.uint64) | np.uint64(1)  # odd multipliers
    b = rng.integers(0, 2**64, size=num_perm, dtype=np.uint64)
    x = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=4).digest(), "little") for s in items],
                 dtype=np.uint64)
    if x.size == 0:
        return np.full(num_perm, 2**32 - 1, dtype=np.uint64)
    return ((x[:, None] * a[None] + b[None]) >> np.uint64(32)).min(axis=0)  # (S, K) wraps mod 2^64 -> (K,)


def lsh_rows(threshold: float, num_perm: int = _NUM_PERM, recall: float = 0.995) -> int:
    """Rows per LSH band: the most (fewest false candidates) that still find a pair at `threshold` with
    probability >= `recall` (1 - (1 - t^r)^(num_perm / r))."""
    fits = [r for r in (1, 2, 4, 8, 16) if 1 - (1 - threshold**r) ** (num_perm // r) >= recall]
    return max(fits, default=1)


class NearDuplicates:
    """Kept shingle sets; `find` says whether a new one has Jaccard >= threshold with any (MinHash LSH buckets
    give the candidates, the exact Jaccard decides: no false positives)."""

    def __init__(self, threshold: float, num_perm: int = _NUM_PERM) -> None:
        self.threshold, self.num_perm, self.rows = threshold, num_perm, lsh_rows(threshold, num_perm)
        self.kept: list[frozenset[str]] = []
        self.buckets: dict[tuple, list[int]] = {}

    def _keys(self, s: frozenset[str]) -> list[tuple]:
        sig, r = minhash_signature(sorted(s), self.num_perm), self.rows
        return [(band, sig[band * r : (band + 1) * r].tobytes()) for band in range(self.num_perm // r)]

    def find(self, s: frozenset[str]) -> bool:
        seen = {j for key in self._keys(s) for j in self.buckets.get(key, ())}
        return any(jaccard(s, self.kept[j]) >= self.threshold for j in seen)

    def add(self, s: frozenset[str]) -> None:
        for key in self._keys(s):
            self.buckets.setdefault(key, []).append(len(self.kept))
        self.kept.append(s)


class _Filter:
    """Replays attempts in index order: per-domain quotas, quality checks, dedup, counts."""

    def __init__(self, n: int, domains: list[str], min_chars: int, threshold: float) -> None:
        self.quota = {d: n // len(domains) + (k < n % len(domains)) for k, d in enumerate(domains)}
        self.min_chars, self.seen, self.near = min_chars, set(), NearDuplicates(threshold)
        self.kept: list[dict] = []
        self.count: Counter = Counter()

    def full(self, domain: str) -> bool:
        return self.count[f"kept:{domain}"] >= self.quota[domain]

    def consider(self, row: dict) -> str:
        reason = self._reason(row)
        self.count[reason] += 1
        if reason == "kept":
            self.count[f"kept:{row['domain']}"] += 1
            self.kept.append(row)
        return reason

    def stats(self, n: int, attempts: int) -> dict:
        """What the replay counted; the unique fraction is kept / requests that ended their turn."""
        clean = sum(self.count[r] for r in ("kept", *REASONS[1:]))
        return {"n_requested": n, "generated": sum(self.count[r] for r in ("kept", *REASONS)),
                "surplus": self.count["surplus"], "attempt_indices": attempts, "kept": len(self.kept),
                "kept_by_domain": {d: self.count[f"kept:{d}"] for d in self.quota}, "cleanly_ended": clean,
                "unique_fraction": len(self.kept) / clean if clean else 0.0,
                "rejected": {r: self.count[r] for r in REASONS}, "complete": len(self.kept) == sum(self.quota.values())}

    def _reason(self, row: dict) -> str:
        if self.full(row["domain"]):
            return "surplus"  # written in a batch after its domain filled up: decided as if never attempted
        if not row["clean"]:
            return "length_cap"
        if len(row["text"]) < self.min_chars:
            return "too_short"
        key, sh = normalize(row["text"]), shingles(row["text"])
        if key in self.seen:
            return "duplicate"
        if self.near.find(sh):
            return "near_duplicate"
        self.seen.add(key)
        self.near.add(sh)
        return "kept"


# -- the pre-query template ----------------------------------------------------------------------------------


def pre_query(tokenizer, domain: str) -> tuple[list[int], int | None]:
    """Token ids of the chat up to the start of a user turn's text (system line for `domain`), and the id that
    ends a user turn in this template (None when that is not one special token)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError("the target's tokenizer has no chat template; self-written prompts need an "
                              "instruct model")
    user = {"role": "user", "content": _SENTINEL}
    try:
        text = tokenizer.apply_chat_template([{"role": "system", "content": DOMAINS[domain]}, user], tokenize=False)
    except Exception:  # templates without a system role (Gemma): unsteered, the domain is only a label
        text = tokenizer.apply_chat_template([user], tokenize=False)
    if _SENTINEL not in text:
        raise DraftsmithError("the target's chat template drops the user's text; cannot cut it at a user turn")
    prefix, suffix = text.split(_SENTINEL, 1)
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    after = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix.strip() else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    end = after[0] if after and after[0] in special else None
    return list(ids), end


# -- the folder ----------------------------------------------------------------------------------------------


def _read_rows(part: Path) -> list[dict]:
    """The attempts saved so far; a torn last line (or anything after it) is dropped and the file rewritten."""
    if not part.is_file():
        return []
    lines, rows = part.read_text(encoding="utf-8").split("\n"), []
    for line in lines[:-1]:  # what follows the last newline was being written when the run stopped
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(row, dict) or not _ROW_KEYS <= row.keys() or (rows and row["index"] <= rows[-1]["index"]):
            break
        rows.append(row)
    if len(rows) != len(lines) - 1 or lines[-1]:
        atomic_write_text(part, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _check_settings(folder: Path, settings: dict) -> bool:
    """True when `folder` holds settings.json equal to `settings`, False when it holds none; other settings
    are refused."""
    old = read_json(folder / SETTINGS, missing_ok=True, what="settings file")
    if old is None:
        return False
    changed = sorted(k for k in settings.keys() | old.keys() if old.get(k) != settings.get(k)) \
        if isinstance(old, dict) else ["unreadable settings"]
    if changed:
        raise DraftsmithError(f"{folder} holds prompts generated with other settings ({', '.join(changed)}); "
                              "remove it or choose another folder")
    return True


def generate_prompts(
    target: Loaded, n: int, domains: list[str], out: Path, *, temperature: float = 1.0, seed: int = 0,
    batch_size: int = 16, max_prompt_tokens: int = 256, min_chars: int = 16, dedup_threshold: float = 0.7,
    max_attempts: int | None = None, dtype: str = "float32", progress: bool = True,
    max_seconds: float | None = None,
) -> datasets.Dataset:
    """`n` requests the target writes itself, ~n/len(domains) per domain (see the module docstring); resumes
    or loads `out`. Attempt indices stop at `max_attempts` (default 4n, i.e. ~4 tries per wanted prompt in
    every domain): fewer than n are kept then (stats.json says `"complete": false`). `dtype` bfloat16 writes
    with a bfloat16 copy of the target (`decode.batch.writer_model`: 2-3x faster on CPUs with AMX).
    `max_seconds` stops starting new batches of attempts once this run has written for that long (fewer than n
    kept then, as with `max_attempts`)."""
    domains = list(dict.fromkeys(domains))
    _check_arguments(domains, n=n, temperature=temperature, batch_size=batch_size,
                     max_prompt_tokens=max_prompt_tokens, min_chars=min_chars, dedup_threshold=dedup_threshold,
                     max_attempts=max_attempts, dtype=dtype)
    max_attempts = 4 * n if max_attempts is None else max_attempts
    prefix = {d: pre_query(target.tokenizer, d) for d in domains}  # domain -> (ids, end-of-turn id)
    _check_positions(target, prefix, max_prompt_tokens)
    out = Path(out)
    settings = {"format": FORMAT_VERSION, "n": n, "domains": domains, "temperature": float(temperature),
                "seed": seed, "max_prompt_tokens": max_prompt_tokens, "min_chars": min_chars,
                "dedup_threshold": float(dedup_threshold), "max_attempts": max_attempts,
                "prefix_sha256": hashlib.sha256(json.dumps(prefix).encode()).hexdigest(),
                "target": folder_identity(target.path)}
    if dtype != "float32":  # folders written before the option existed keep their settings
        settings["dtype"] = dtype
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not _check_settings(out, settings):
            raise DraftsmithError(f"{out} exists and is not a generate_prompts folder; remove it or choose another")
        return datasets.load_from_disk(str(out))
    partial = _partial_folder(out, settings)

    filt = _Filter(n, domains, min_chars, dedup_threshold)
    rows = _read_rows(partial / ROWS)
    for row in rows:
        filt.consider(row)
    stop = sorted(set(eos_ids(target)) | {end for _, end in prefix.values() if end is not None})
    attempts = _Attempts(domains, prefix, stop, seed, temperature, max_prompt_tokens)
    start = rows[-1]["index"] + 1 if rows else 0  # resume after the last attempt saved
    t0 = time.perf_counter()
    nxt, new_tokens = _write_until_full(target, attempts, filt, partial / ROWS, start=start, n=n,
                                        max_attempts=max_attempts, batch_size=batch_size, dtype=dtype,
                                        progress=progress, max_seconds=max_seconds)
    seconds = time.perf_counter() - t0
    stats = filt.stats(n, nxt) | {"new_tokens_this_run": new_tokens, "seconds_this_run": round(seconds, 3),
                                  "tokens_per_s": round(new_tokens / seconds, 1) if new_tokens else None}
    if not filt.kept:
        why = ", ".join(f"{k} {v}" for k, v in stats["rejected"].items())
        raise DraftsmithError(f"no request kept out of {stats['generated']} attempts ({why}); raise max_attempts "
                              "or max_prompt_tokens, or lower min_chars")
    if not stats["complete"]:
        print(f"draftsmith: kept {len(filt.kept)} of {n} prompts after {nxt} attempts", file=sys.stderr)
    _save(out, filt.kept, settings, stats)
    shutil.rmtree(partial, ignore_errors=True)
    return datasets.load_from_disk(str(out))


def _check_arguments(domains: list[str], *, n: int, temperature: float, batch_size: int, max_prompt_tokens: int,
                     min_chars: int, dedup_threshold: float, max_attempts: int | None, dtype: str) -> None:
    """Known domains (at least one) and every number in its range; a one-line error otherwise."""
    unknown = [d for d in domains if d not in DOMAINS] or ([] if domains else ["(none given)"])
    if unknown:
        raise DraftsmithError(f"unknown prompt domain {unknown[0]!r}; known domains: {', '.join(DOMAINS)}")
    for name, value, ok, need in (
            ("n", n, n >= 1, ">= 1"), ("temperature", temperature, temperature > 0, "> 0 (greedy repeats itself)"),
            ("batch_size", batch_size, batch_size >= 1, ">= 1"),
            ("max_prompt_tokens", max_prompt_tokens, max_prompt_tokens >= 1, ">= 1"),
            ("min_chars", min_chars, min_chars >= 0, ">= 0"),
            ("dedup_threshold", dedup_threshold, 0 < dedup_threshold <= 1, "in (0, 1]"),
            ("max_attempts", max_attempts, max_attempts is None or max_attempts >= 1, ">= 1"),
            ("dtype", dtype, dtype in GEN_DTYPES, f"one of {', '.join(GEN_DTYPES)}")):
        if not ok:
            raise DraftsmithError(f"{name} must be {need}, got {value}")


def _check_positions(target: Loaded, prefix: dict[str, tuple[list[int], int | None]], max_prompt_tokens: int) -> None:
    """The longest pre-query prefix plus a whole request must fit the target's positions."""
    limit = getattr(target.model.config, "max_position_embeddings", None)
    need = max(len(ids) for ids, _ in prefix.values()) + max_prompt_tokens
    if limit and need > limit:
        raise DraftsmithError(f"a pre-query prefix plus {max_prompt_tokens} tokens needs {need} positions; "
                              f"{target.name} supports {limit} (lower max_prompt_tokens)")


def _partial_folder(out: Path, settings: dict) -> Path:
    """`<out>.partial`, holding `settings` (an earlier run's with the same settings is resumed as it is)."""
    partial = out.with_name(out.name + ".partial")
    try:
        partial.mkdir(parents=True, exist_ok=True)
        if not _check_settings(partial, settings):
            atomic_write_json(partial / SETTINGS, settings)
    except OSError as e:
        raise DraftsmithError(f"cannot write prompts under {partial}: {e.strerror}") from None
    return partial


# -- writing -------------------------------------------------------------------------------------------------


@dataclass
class _Attempts:
    """What attempt i writes: a request for domain `domains[i % len(domains)]` after its pre-query prefix,
    sampled with a generator seeded from (seed, i), until a `stop` id or `max_tokens` tokens."""

    domains: list[str]
    prefix: dict[str, tuple[list[int], int | None]]
    stop: list[int]
    seed: int
    temperature: float
    max_tokens: int

    def domain(self, i: int) -> str:
        return self.domains[i % len(self.domains)]

    def next_batch(self, filt: _Filter, start: int, size: int, end: int) -> tuple[list[int], int]:
        """Up to `size` attempt indices from `start` (below `end`) whose domain still wants prompts, and the
        index after the last one looked at."""
        batch, nxt = [], start
        while len(batch) < size and nxt < end:
            batch += [] if filt.full(self.domain(nxt)) else [nxt]
            nxt += 1
        return batch, nxt

    def write(self, model, tokenizer, batch: list[int], device) -> list[dict]:
        """The batch's attempts decoded together: one row each (index, domain, text, tokens, clean: it ended
        on a stop id rather than at the token cap)."""
        doms = [self.domain(i) for i in batch]
        gens = [torch.Generator(device=device).manual_seed(prompt_seed(self.seed, i)) for i in batch]
        outs = generate_batch(model, [self.prefix[d][0] for d in doms], max_new_tokens=self.max_tokens,
                              sampling=SamplingParams(self.temperature), eos_ids=self.stop, generators=gens)
        rows = []
        for i, d, toks in zip(batch, doms, outs):
            clean = bool(toks) and toks[-1] in self.stop
            text = tokenizer.decode(toks[:-1] if clean else toks, skip_special_tokens=True).strip()
            rows.append({"index": i, "domain": d, "text": text, "tokens": len(toks), "clean": clean})
        return rows


def _write_until_full(target: Loaded, attempts: _Attempts, filt: _Filter, rows_file: Path, *, start: int, n: int,
                      max_attempts: int, batch_size: int, dtype: str, progress: bool,
                      max_seconds: float | None = None) -> tuple[int, int]:
    """Batches of attempts from index `start` until `filt` holds `n`, the indices reach `max_attempts` or
    `max_seconds` have passed; every batch's rows are appended to `rows_file` (a checkpoint) and replayed through
    `filt`. Returns (the next attempt index, tokens generated)."""
    nxt, new_tokens, device = start, 0, next(target.model.parameters()).device
    t0 = time.perf_counter()
    model = writer_model(target.model, dtype) if len(filt.kept) < n and nxt < max_attempts else None
    bar = tqdm(total=n, initial=len(filt.kept), desc="prompts", unit="prompt", disable=not progress)
    with rows_file.open("a", encoding="utf-8") as f:
        while len(filt.kept) < n and nxt < max_attempts:
            if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                break
            batch, nxt = attempts.next_batch(filt, nxt, batch_size, max_attempts)
            if not batch:  # the last indices all belong to domains that are full
                break
            new = attempts.write(model, target.tokenizer, batch, device)
            append_rows(f, new)  # a checkpoint per batch
            before = len(filt.kept)
            for row in new:
                filt.consider(row)
            new_tokens += sum(r["tokens"] for r in new)
            bar.update(len(filt.kept) - before)
            bar.set_postfix(attempts=nxt, refresh=False)
    bar.close()
    return nxt, new_tokens


def _save(out: Path, kept: list[dict], settings: dict, stats: dict) -> None:
    """The kept requests as a `save_to_disk` folder at `out` with settings.json and stats.json, in one rename."""
    ds = datasets.Dataset.from_list(
        [{"id": f"{r['domain']}-{r['index']:06d}", "domain": r["domain"], "prompt": r["text"]} for r in kept],
        features=FEATURES, info=datasets.DatasetInfo(description=json.dumps({"draftsmith_prompts": settings}),
                                                     features=FEATURES))
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Saving the dataset" is noise after the generation bar
    try:
        with atomic_dir(out) as tmp:
            ds.save_to_disk(str(tmp))
            atomic_write_json(tmp / SETTINGS, settings)
            atomic_write_json(tmp / STATS, stats)
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


__all__ = ["DOMAINS", "FEATURES", "NearDuplicates", "generate_prompts", "jaccard", "lsh_rows", "minhash_signature",
           "normalize", "pre_query", "shingles"]
