"""The target's own continuations of a prompt set: generated once, cached on disk, resumable.

    refs = reference_continuations(load("smollm2-360m-instruct"), load_suite("code"), max_new_tokens=64)

Every draft is ranked on the same text: what the target itself writes (greedy by default). Generation uses
the built-in decoder (`decode.speculative.generate` on `decode.runtime.runner.make_runner`); with `draft=` it decodes
speculatively, which at temperature 0 gives exactly the target's tokens, only sooner.

Cache: `<cache>/reference/<key>/`, a `datasets.save_to_disk` folder with columns
id, domain, prompt, prompt_ids, continuation_ids, text. The key (`reference_key`) covers the target folder,
the prompts and the settings. While generating, finished rows are appended to
`<key>.partial/rows.jsonl`; an interrupted run resumes after the last saved prompt. The finished folder
appears in one rename, so a folder under its final name is always complete (`decode.rows`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_write_json, folder_identity
from draftsmith.decode.runtime.loading import Loaded, eos_ids
from draftsmith.decode.runtime.pair import check_vocab
from draftsmith.decode.prompts import Prompt
from draftsmith.decode.runtime.quant import draft_quant
from draftsmith.decode.rows import append_rows, read_partial, save_rows
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.speculative import generate
from draftsmith.decode.textgen import prompt_ids

FORMAT_VERSION = 1  # bump when rows or generation change meaning: old caches are then never reused

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "domain": datasets.Value("string"),
        "prompt": datasets.Value("string"),
        "prompt_ids": datasets.List(datasets.Value("int64")),
        "continuation_ids": datasets.List(datasets.Value("int64")),
        "text": datasets.Value("string"),
    }
)


def reference_key(
    target_path: Path, prompts: list[Prompt], *, max_new_tokens: int, temperature: float, seed: int, chat: bool
) -> str:
    """sha256 over the target folder's identity, the prompts (id, domain, text), the settings and FORMAT_VERSION."""
    blob = {
        "format": FORMAT_VERSION,
        "target": folder_identity(target_path),
        "prompts": [[p.id, p.domain, p.prompt] for p in prompts],
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        # greedy decoding never draws a random number: the seed does not change the result
        "seed": int(seed) if temperature > 0 else None,
        "chat": bool(chat),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:32]


def prompt_seed(seed: int, index: int) -> int:
    """The generator seed for prompt `index`: depends on nothing else, so order and resumption don't matter."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _runners(target: Loaded, draft: Loaded | None, max_seq_len: int, temperature: float):
    if draft is None or temperature > 0:
        # At temperature > 0 a draft changes which sample the generator yields (the law stays p's), so the
        # rows would depend on something outside the cache key: reference samples come from the target alone.
        return make_runner(target.model, max_seq_len), None
    check_vocab(target, draft)
    d_runner = make_runner(draft.model, max_seq_len, quantize=draft_quant(draft.model))  # int8 where it can
    return make_runner(target.model, max_seq_len), d_runner


def reference_continuations(
    target: Loaded,
    prompts: list[Prompt],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    chat: bool = True,
    draft: Loaded | None = None,
    cache_root: Path | None = None,
    progress: bool = True,
) -> datasets.Dataset:
    """The target's continuation of every prompt (see the module docstring); loads from the cache when it can.

    `draft` (same tokenizer) only speeds up greedy generation; it is not used at temperature > 0.
    `cache_root` replaces `<cache>/reference`.
    """
    if not prompts:
        raise DraftsmithError("no prompts to generate reference continuations for")
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise DraftsmithError(f"temperature must be >= 0, got {temperature}")
    key = reference_key(
        target.path, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, chat=chat
    )
    root = Path(cache_root) if cache_root is not None else zoo.cache_dir() / "reference"
    final = root / key
    if final.is_dir():
        return datasets.load_from_disk(str(final))

    partial = root / f"{key}.partial"
    part = partial / "rows.jsonl"
    try:
        partial.mkdir(parents=True, exist_ok=True)
        settings = {"format": FORMAT_VERSION, "target": str(target.path), "max_new_tokens": max_new_tokens,
                    "temperature": temperature, "seed": seed, "chat": chat, "prompts": len(prompts)}
        atomic_write_json(partial / "settings.json", settings)
    except OSError as e:
        raise DraftsmithError(f"cannot write the reference cache under {root}: {e.strerror}") from None
    rows = read_partial(part, prompts)

    tok = target.tokenizer
    ids = [prompt_ids(tok, p.prompt, chat=chat) for p in prompts]
    for p, x in zip(prompts, ids):
        if not x:
            raise DraftsmithError(f"prompt {p.id!r} has no tokens")
    if len(rows) < len(prompts):
        max_seq_len = max(len(x) for x in ids[len(rows):]) + max_new_tokens
        limit = getattr(target.model.config, "max_position_embeddings", None)
        if limit and max_seq_len > limit:
            raise DraftsmithError(
                f"a prompt plus {max_new_tokens} new tokens needs {max_seq_len} positions; "
                f"{target.name} supports {limit} (use shorter prompts or fewer new tokens)"
            )
        t_runner, d_runner = _runners(target, draft, max_seq_len, temperature)
        device = next(target.model.parameters()).device
        sampling = SamplingParams(temperature=temperature)
        stop = eos_ids(target)
        bar = tqdm(total=len(prompts), initial=len(rows), desc="reference", unit="prompt", disable=not progress)
        with part.open("a", encoding="utf-8") as f:
            for i in range(len(rows), len(prompts)):
                gen = None
                if temperature > 0:
                    gen = torch.Generator(device=device).manual_seed(prompt_seed(seed, i))
                out = generate(
                    t_runner, ids[i], draft=d_runner, max_new_tokens=max_new_tokens, sampling=sampling,
                    eos_ids=stop, generator=gen, device=device,
                ).tokens
                p = prompts[i]
                row = {"index": i, "id": p.id, "domain": p.domain, "prompt": p.prompt, "prompt_ids": ids[i],
                       "continuation_ids": out, "text": tok.decode(out, skip_special_tokens=True)}
                append_rows(f, [row])  # a checkpoint per prompt
                rows.append(row)
                bar.update(1)
        bar.close()

    ds = save_rows(rows, FEATURES, {"draftsmith_reference": settings, "key": key}, final)
    shutil.rmtree(partial, ignore_errors=True)
    return ds


__all__ = ["FEATURES", "FORMAT_VERSION", "prompt_seed", "reference_continuations", "reference_key"]
