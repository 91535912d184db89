"""Training sequences for distillation: prompts plus continuations, generated once into a folder, resumable.

    from draftsmith.distill.data import generate_data
    data = generate_data(load(target), load(draft), load_suite("code"), Path("runs/x/distill/data"),
                         source="mixed", mix=0.5, max_new_tokens=64, temperature=1.0)

Where the continuations come from (`source`):
- "target": the target's own text, sampled at `temperature` (greedy at 0) by the speculative decoder with the
  draft as int8 proposer: exact (the output law is the target's), only faster. At temperature > 0 which
  sample a seed yields depends on the draft too, so the draft's identity is part of the folder's settings.
- "draft": on-policy text sampled from the current draft alone: as loaded (full precision), or with
  `draft_quant="int4"` / `"int8"` in its quantised copy (`decode.batch.quantized_writer`, the weights an int4 /
  int8 draft runs), many rows at once on draftsmith's kernel: the fast writer of on-policy data. The target
  scores it afterwards by a batched prefill (`distill.teacher_cache.build_teacher_cache`, gen-data's teacher
  cache) or at training time.
- "mixed": round(mix * n) prompts, chosen by a permutation seeded from `seed`, from the draft, the rest
  from the target.

Columns: id, domain, source ("target" | "draft"), prompt_ids, continuation_ids. Training feeds
`prompt_ids + continuation_ids` and puts the loss on the continuation positions only.

Batching (`batch_size` prompts at a time, default 8): rows decoded by one model alone (the draft's on-policy
rows, and the target's with `speculative=False`) are generated together by `decode.batch.generate_batch`:
left-padded, one Hugging Face forward per token for the whole batch, finished rows dropped from it. Each row
keeps its own generator and sampling step, so it gets the tokens that model decodes for it alone (barring
exact floating-point ties). Speculative rows are decoded one prompt at a time. `batch_size=1` decodes every
row alone through `decode.speculative.generate`, as before batching existed (a quantised writer's rows go
through `decode.batch` at every batch size: one row at a time there gives the same tokens). At temperature > 0 a seed
samples other (equally distributed) target text through the speculative decoder than plainly, so
`settings.json` records which (`speculative`).

Folder `out`: `settings.json` (what the rows depend on; a rerun with other settings is refused),
`rows.partial.jsonl` (finished prompts, appended a batch at a time, in prompt order), and at the end
`dataset/` (a `datasets.save_to_disk` folder, renamed into place so that it is always complete), and
`stats.json` (rows, new tokens, seconds and tokens/s of generation, summed over the sessions that generated; the
seconds spent making runners and quantised copies apart, `setup_seconds`). The progress bar shows tokens/s. Prompt i
samples from its own generator seeded from (seed, i), so an interrupted run resumes after the last saved
prompt and yields the same rows as an uninterrupted one, whatever the batch size.

`training_rows` and `collate` turn the rows into what training feeds the models.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from torch import Tensor
from tqdm.auto import tqdm

from draftsmith.decode.batch import (WRITER_QUANTS, TargetVocab, decode_batch, generate_batch, quantized_writer,
                                     writer_quant)
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_path, atomic_write_json, folder_identity, read_json
from draftsmith.decode.runtime.lean import lean_supported
from draftsmith.decode.runtime.loading import Loaded, eos_ids
from draftsmith.decode.runtime.pair import check_vocab
from draftsmith.decode.prompts import Prompt
from draftsmith.decode.runtime.quant import Calibration, draft_quant, read_calib
from draftsmith.decode.rows import append_rows, read_partial, save_rows
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.speculative import generate
from draftsmith.decode.textgen import prompt_ids
from draftsmith.pairing.reference import prompt_seed

FORMAT_VERSION = 1  # bump when rows or generation change meaning: old folders are then refused, not mixed in
SOURCES = ("target", "draft", "mixed")
DATASET_DIR = "dataset"
PARTIAL = "rows.partial.jsonl"
TOPK_DIR = "topk.partial"  # the target's top-k kept while it generated, a file per batch
STATS = "stats.json"
SETTINGS = "settings.json"
SHARDS = "shards"  # one folder per process of a data-parallel run (`accelerate launch`)

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "domain": datasets.Value("string"),
        "source": datasets.Value("string"),
        "prompt_ids": datasets.List(datasets.Value("int64")),
        "continuation_ids": datasets.List(datasets.Value("int64")),
    }
)


def draft_prompts(n: int, source: str, mix: float, seed: int) -> set[int]:
    """Indices of the prompts whose continuation comes from the draft: none, all, or round(mix * n) of them
    picked by a permutation seeded from `seed` (the same seed always picks the same prompts)."""
    if source == "target":
        return set()
    if source == "draft":
        return set(range(n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return set(perm[: round(mix * n)].tolist())


def _settings(target: Loaded, draft: Loaded, prompts: list[Prompt], source: str, mix: float,
              max_new_tokens: int, temperature: float, seed: int, chat: bool, speculative: bool) -> dict:
    """Everything the rows depend on (and nothing else, so that a rerun is not refused for nothing)."""
    draft_matters = source != "target" or temperature > 0  # greedy target text is the same with any draft
    # a seed samples other (equally distributed) target text through the speculative decoder than plainly
    sampled_target = temperature > 0 and source != "draft"
    prompts_blob = json.dumps([[p.id, p.domain, p.prompt] for p in prompts]).encode()
    return {
        "format": FORMAT_VERSION,
        "source": source,
        "mix": float(mix) if source == "mixed" else None,
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "seed": int(seed) if temperature > 0 or source == "mixed" else None,
        "chat": bool(chat),
        "speculative": bool(speculative) if sampled_target else None,
        "prompts": len(prompts),
        "prompts_sha256": hashlib.sha256(prompts_blob).hexdigest(),
        "target": folder_identity(target.path),
        "draft": folder_identity(draft.path) if draft_matters else None,
    }


# keys written only where they differ from these: a folder without one was made with this value (an older
# draftsmith's on-policy rows came from the draft as loaded), so a rerun with another value is refused
UNSET = {"draft_quant": None, "draft_calib": None}


def _check_settings(out: Path, settings: dict) -> None:
    """Write settings.json on the first run; refuse a folder made with other settings. A key the folder lacks
    was added to draftsmith after the folder was made (what it would have said is not known), so it counts as
    unchanged; except the keys of UNSET, whose absence means their default."""
    path = out / SETTINGS
    if path.is_file():
        old = read_json(path, what="settings file")  # a file that is not JSON: a one-line error naming it
        if isinstance(old, dict):
            differ = {k for k in settings if k in old and old[k] != settings[k]}
            differ |= {k for k, d in UNSET.items() if old.get(k, d) != settings.get(k, d)}
            changed = sorted(differ | (old.keys() - settings.keys() - UNSET.keys()))
        else:
            changed = ["unreadable settings"]
        if changed:
            raise DraftsmithError(
                f"{out} holds data generated with other settings ({', '.join(changed)}); "
                "remove it or choose another folder"
            )
        return
    atomic_write_json(path, settings)


def _open_folder(out: Path, settings: dict) -> None:
    """Make `out` and write its settings, or check them against those it holds."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        _check_settings(out, settings)
    except OSError as e:
        raise DraftsmithError(f"cannot write training data under {out}: {e.strerror}") from None


def _check_args(source: str, mix: float, max_new_tokens: int, temperature: float, prompts: list[Prompt],
                batch_size: int, engine: str, speculative: bool) -> None:
    if engine not in ("hf", "vllm"):
        raise DraftsmithError(f"engine must be hf or vllm, got {engine!r}")
    if engine == "vllm" and speculative:
        raise DraftsmithError("engine vllm decodes the target's rows itself: drop speculative (use --plain-data)")
    if batch_size < 1:
        raise DraftsmithError(f"batch_size must be >= 1, got {batch_size}")
    if source not in SOURCES:
        raise DraftsmithError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    if not 0.0 <= mix <= 1.0:
        raise DraftsmithError(f"mix must be in [0, 1], got {mix}")
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise DraftsmithError(f"temperature must be >= 0, got {temperature}")
    if not prompts:
        raise DraftsmithError("no prompts to generate training data for")


def generate_data(
    target: Loaded,
    draft: Loaded,
    prompts: list[Prompt],
    out: Path,
    *,
    source: str = "target",
    mix: float = 0.5,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    chat: bool = True,
    progress: bool = True,
    speculative: bool = False,
    batch_size: int = 8,
    topk: int = 0,
    shard: tuple[int, int] | None = None,
    engine: str = "hf",
    draft_quant: str | None = None,
    draft_calib: str | Path | None = None,
) -> datasets.Dataset | None:
    """Prompt + continuation rows for distillation (see the module docstring); resumes or loads `out`.

    `speculative=False` generates the target's rows with the target alone: the same text, and faster when the
    draft is still poor (a freshly derived draft is accepted a few percent of the time), more so batched.
    `batch_size` prompts are decoded together where a model decodes alone (1 = one at a time). `topk` > 0
    keeps the target's top-k log-probs of every row it decodes plainly in a batch (Llama-family targets) in
    `<out>/topk.partial/`; `captured_topk` returns them once every row has them (the teacher cache, no
    second pass).

    `shard=(rank, world)`: generate only this process's contiguous share of the prompts into
    `<out>/shards/<rank>-of-<world>/` (each row seeded by its index in the whole list, so the shards hold the
    rows one process would) and return None; `merge_shards` then makes the dataset. `gen_data` does both under
    `accelerate launch`.

    `engine="vllm"` decodes the target's rows with vLLM where it is installed (`vllm_rows`: its own batching,
    its own sampler, so other text for a seed than `hf`; the engine is part of the folder's settings).

    `draft_quant="int4"` | `"int8"` writes the on-policy rows with the draft's int4 / int8 copy
    (`decode.batch.quantized_writer`; int4 GPTQ-rounded on `draft_calib`, a `decode.runtime.quant.write_calib`
    file), many rows at once (`batch_size`); the copy in force (`decode.batch.writer_quant`: none where the model
    cannot take it) is part of the folder's settings."""
    _check_args(source, mix, max_new_tokens, temperature, prompts, batch_size, engine, speculative)
    check_vocab(target, draft)
    out = Path(out)
    quant, calib = _writer_choice(draft, source, draft_quant, draft_calib)
    settings = _settings(target, draft, prompts, source, mix, max_new_tokens, temperature, seed, chat,
                         speculative)
    if engine != "hf":  # absent for hf, so folders made before engines existed still resume
        settings["engine"] = engine
    settings.update({k: v for k, v in (("draft_quant", quant), ("draft_calib", calib and calib.key)) if v})
    _open_folder(out, settings)
    final = out / DATASET_DIR
    if final.is_dir():
        return datasets.load_from_disk(str(final))

    from_draft = draft_prompts(len(prompts), source, mix, seed)
    offset, home = 0, out
    if shard is not None:
        rank, world = shard
        offset, end = shard_bounds(len(prompts), rank, world)
        home = out / SHARDS / f"{rank}-of-{world}"
        home.mkdir(parents=True, exist_ok=True)
        prompts = prompts[offset:end]
        from_draft = {i - offset for i in from_draft if offset <= i < end}
    part = home / PARTIAL
    rows = read_partial(part, prompts)
    if len(rows) < len(prompts):
        before, t0 = len(rows), time.perf_counter()
        setup = _generate_rows(target, draft, prompts, rows, part, from_draft, max_new_tokens, temperature, seed,
                               chat, progress, speculative, batch_size, topk, offset, engine, quant, calib)
        _record_speed(home / STATS, rows[before:], time.perf_counter() - t0 - setup, batch_size, setup)
    if shard is not None:
        return None

    ds = save_rows(rows, FEATURES, {"draftsmith_distill_data": settings}, final)
    part.unlink(missing_ok=True)
    return ds


def _generate_rows(
    target: Loaded, draft: Loaded, prompts: list[Prompt], rows: list[dict], part: Path, from_draft: set[int],
    max_new_tokens: int, temperature: float, seed: int, chat: bool, progress: bool, speculative: bool = True,
    batch_size: int = 1, topk: int = 0, offset: int = 0, engine: str = "hf", quant: str | None = None,
    calib: Calibration | None = None,
) -> float:
    """Generate the rows after `rows`, `batch_size` prompts at a time, appending each finished batch to `part`
    (in prompt order) and to `rows`; -> the seconds spent making the runners (quantised copies), not decoding.
    Prompt i samples from a generator seeded by (seed, offset + i): its index in the whole list when these
    prompts are one shard of it. The bar shows new tokens/s."""
    ids = [prompt_ids(target.tokenizer, p.prompt, chat=chat) for p in prompts]
    for p, x in zip(prompts, ids):
        if not x:
            raise DraftsmithError(f"prompt {p.id!r} has no tokens")
    todo = range(len(rows), len(prompts))
    max_seq_len = max(len(ids[i]) for i in todo) + max_new_tokens
    for who in (target, draft):
        limit = getattr(who.model.config, "max_position_embeddings", None)
        if limit and max_seq_len > limit:
            raise DraftsmithError(
                f"a prompt plus {max_new_tokens} new tokens needs {max_seq_len} positions; "
                f"{who.name} supports {limit} (use shorter prompts or fewer new tokens)"
            )
    t0 = time.perf_counter()
    writer = _row_writer(target, draft, ids, from_draft, todo, max_seq_len, max_new_tokens=max_new_tokens,
                         temperature=temperature, speculative=speculative, batch_size=batch_size, topk=topk,
                         engine=engine, quant=quant, calib=calib)
    setup, t0, tokens = time.perf_counter() - t0, time.perf_counter(), 0
    bar = tqdm(total=len(prompts), initial=len(rows), desc="distill data", unit="prompt", disable=not progress)
    with part.open("a", encoding="utf-8") as f:
        for start in range(len(rows), len(prompts), batch_size):
            chunk = range(start, min(start + batch_size, len(prompts)))
            outs, tops = writer.continuations(chunk, [prompt_seed(seed, offset + i) for i in chunk])
            if len(tops) == len(chunk):  # every row of the batch has its top-k: kept beside the rows
                _save_topk(part.parent / TOPK_DIR, start, [tops[i] for i in chunk])
            new = [{"index": i, "id": prompts[i].id, "domain": prompts[i].domain,
                    "source": "draft" if i in from_draft else "target", "prompt_ids": ids[i],
                    "continuation_ids": outs[i]} for i in chunk]
            rows.extend(new)
            append_rows(f, new)  # a checkpoint per batch
            tokens += sum(len(outs[i]) for i in chunk)
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f} tokens/s", refresh=False)
            bar.update(len(chunk))
    bar.close()
    return setup


@dataclass
class _RowWriter:
    """Who writes each row: the draft (on-policy rows, `from_draft`) or the target, with the decoder the settings
    ask for. `batched`: the rows a model decodes alone go through its HF model a batch at a time (else one at a
    time through a runner); the target's rows are speculative (`t_runner` verifying `proposer`) unless batched
    plain, or vLLM's (`llm`). On-policy rows come from the draft's quantised copy (`writer`, through
    `decode.batch` at any batch size) where the settings name one. `topk` > 0: the target keeps its top-k
    log-probs as it decodes its rows."""

    target: Loaded
    draft: Loaded
    ids: list[list[int]]  # prompt i's token ids
    from_draft: set[int]
    max_new_tokens: int
    temperature: float
    stop: list[int]  # the target's EOS ids: every row ends at one (or at max_new_tokens)
    batched: bool
    speculative: bool
    topk: int
    vocab_size: int
    device: torch.device
    t_runner: object | None
    proposer: object | None
    alone: object | None  # the draft's own runner for on-policy rows one at a time
    llm: object | None
    writer: object | None = None  # the draft's int4 / int8 copy (`decode.batch.quantized_writer`) for on-policy rows

    def continuations(self, chunk: range, seeds: list[int]) -> tuple[dict[int, list[int]], dict[int, tuple]]:
        """New tokens of every prompt in `chunk` (on-policy ones first), and the target's top-k of the rows that
        kept them. Prompt i samples with its own generator seeded with its seed."""
        gens = {i: torch.Generator(device=self.device).manual_seed(s) if self.temperature > 0 else None
                for i, s in zip(chunk, seeds)}
        seed_of = dict(zip(chunk, seeds))
        outs: dict[int, list[int]] = {}
        tops: dict[int, tuple] = {}
        for on_policy in (True, False):
            group = [i for i in chunk if (i in self.from_draft) == on_policy]
            if group:
                toks, got_tops = self._decode(group, on_policy, gens, seed_of)
                outs.update(zip(group, toks))
                tops.update(zip(group, got_tops or []))
        return outs, tops

    def _decode(self, group: list[int], on_policy: bool, gens: dict,
                seed_of: dict[int, int]) -> tuple[list, list | None]:
        """One group's continuations (all the draft's or all the target's) and their top-k, None when not kept."""
        prompts = [self.ids[i] for i in group]
        sampling, stop = SamplingParams(temperature=self.temperature), self.stop
        if self.llm is not None and not on_policy:
            return vllm_rows(self.llm, prompts, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                             seeds=[seed_of[i] for i in group], eos_ids=stop, topk=self.topk)
        quantized = on_policy and self.writer is not None  # batched at any size: the same kernels as one row
        if (self.batched and (on_policy or not self.speculative)) or quantized:
            kw = dict(max_new_tokens=self.max_new_tokens, sampling=sampling, eos_ids=stop,
                      generators=[gens[i] for i in group], vocab_size=self.vocab_size)
            if not on_policy and self.topk:  # the target's own rows: keep its top-k as it decodes
                got = decode_batch(self.target.model, prompts, topk=self.topk, **kw)
                return got.tokens, list(zip(got.topk_values, got.topk_indices))
            model = (self.writer or self.draft.model) if on_policy else self.target.model
            return generate_batch(model, prompts, **kw), None
        runner, proposing = (self.alone, None) if on_policy else (self.t_runner, self.proposer)
        return [generate(runner, self.ids[i], draft=proposing, max_new_tokens=self.max_new_tokens, sampling=sampling,
                         eos_ids=stop, generator=gens[i], device=self.device).tokens for i in group], None


def _row_writer(target: Loaded, draft: Loaded, ids: list[list[int]], from_draft: set[int], todo: range,
                max_seq_len: int, *, max_new_tokens: int, temperature: float, speculative: bool, batch_size: int,
                topk: int, engine: str, quant: str | None = None, calib: Calibration | None = None) -> _RowWriter:
    """The runners (or engine) the rows in `todo` need, and no others."""
    batched = batch_size > 1
    V = target_vocab(target)
    need_target = any(i not in from_draft for i in todo)
    need_draft = any(i in from_draft for i in todo)
    t_runner = make_runner(target.model, max_seq_len) if need_target and (speculative or not batched) else None
    proposer = None
    if need_target and speculative:  # int8 where it can (decode.runtime.quant.draft_quant): cheaper proposals, exact text
        proposer = make_runner(draft.model, max_seq_len, quantize=draft_quant(draft.model))
    alone = writer = None
    if need_draft and quant is not None:  # on-policy text from the draft's int4 / int8 copy, as the settings say
        writer = quantized_writer(draft.model, quant, max_seq_len, calib)
    elif need_draft and not batched:  # on-policy text comes from the draft itself, not from its int8 proposer
        alone = make_runner(draft.model, max_seq_len)
        if alone.vocab_size != V:
            alone = TargetVocab(alone, V)
    keep_topk = topk > 0 and (engine == "vllm" or lean_supported(target.model.config)[0])
    device = next(target.model.parameters()).device
    llm = vllm_engine(target) if engine == "vllm" and need_target else None
    return _RowWriter(target, draft, ids, from_draft, max_new_tokens, temperature, eos_ids(target), batched,
                      speculative, topk if keep_topk else 0, V, device, t_runner, proposer, alone, llm, writer)


def _writer_choice(draft: Loaded, source: str, requested: str | None,
                   calib_file: str | Path | None) -> tuple[str | None, Calibration | None]:
    """(the copy the on-policy rows are written in, its calibration): what `requested` gives on this machine
    (`decode.batch.writer_quant`; a note on stderr where that is not what was asked), None without on-policy rows."""
    if requested not in (None, *WRITER_QUANTS):
        raise DraftsmithError(f"draft_quant must be one of {', '.join(WRITER_QUANTS)} or None, got {requested!r}")
    if calib_file and requested != "int4":
        raise DraftsmithError("a calibration file (draft_calib) rounds an int4 writer: set draft_quant int4")
    if source == "target" or requested is None:
        return None, None
    quant = writer_quant(draft.model, requested)
    if quant != requested:
        print(f"draft_quant {requested} -> {quant or 'none'}: the draft writes as loaded here", file=sys.stderr)
    calib = read_calib(calib_file) if calib_file and quant == "int4" else None
    return quant, calib


def vllm_engine(target: Loaded):
    """vLLM's LLM over the target's HF folder; a one-line error where vLLM is not installed."""
    try:
        from vllm import LLM
    except ImportError:
        raise DraftsmithError("engine vllm: vllm is not installed here (it needs a CUDA machine: pip install vllm); "
                              "use engine hf") from None
    return LLM(model=str(target.path), tokenizer=str(target.path), seed=0)


def vllm_rows(llm, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seeds: list[int],
              eos_ids: list[int], topk: int = 0) -> tuple[list[list[int]], list[tuple[Tensor, Tensor]]]:
    """Each prompt's new tokens from vLLM (request i sampled with its own seed; stops at an EOS id, which is
    kept, as `decode.batch` keeps it) and, with topk > 0, the top-k log-probs (raw, temperature 1, as the
    teacher cache stores them) of each new token's position: (values, indices), each (C, k)."""
    from vllm import SamplingParams as VllmSampling

    params = [VllmSampling(temperature=temperature, max_tokens=max_new_tokens, seed=s, stop_token_ids=list(eos_ids),
                           include_stop_str_in_output=True, logprobs=topk or None) for s in seeds]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens, tops = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        if topk:
            values = torch.full((len(c.token_ids), topk), float("-inf"))
            indices = torch.zeros((len(c.token_ids), topk), dtype=torch.long)
            for t, lp in enumerate(c.logprobs or []):  # id -> Logprob: the top-k, plus the sampled id if outside them
                best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:topk]
                for j, (tok, v) in enumerate(best):
                    values[t, j], indices[t, j] = v.logprob, tok
            tops.append((values, indices))
    return tokens, tops


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of process `rank`'s contiguous share of n prompts (the shares differ by at most one)."""
    if world < 1 or not 0 <= rank < world:
        raise DraftsmithError(f"shard {rank} of {world}: rank must lie in [0, world)")
    return rank * n // world, (rank + 1) * n // world


def merge_shards(out: Path, prompts: list[Prompt], world: int) -> datasets.Dataset:
    """The dataset of a data-parallel run: every shard's rows in prompt order, their kept top-k (as one file per
    shard under `topk.partial/`, as `captured_topk` reads them), and stats.json (tokens summed; seconds: the
    slowest shard, the run's wall time). The shard folders are removed once the dataset is in place."""
    out = Path(out)
    final = out / DATASET_DIR
    if final.is_dir():
        return datasets.load_from_disk(str(final))
    rows: list[dict] = []
    stats = {"rows": 0, "new_tokens": 0, "seconds": 0.0, "processes": world}
    for rank in range(world):
        lo, hi = shard_bounds(len(prompts), rank, world)
        home = out / SHARDS / f"{rank}-of-{world}"
        got = read_partial(home / PARTIAL, prompts[lo:hi])
        if len(got) != hi - lo:
            raise DraftsmithError(f"{home}: {len(got)} of {hi - lo} rows; rerun the same command to finish it")
        rows += [{**r, "index": lo + r["index"]} for r in got]
        kept = captured_topk(home, hi - lo)
        if kept is not None:
            _save_topk(out / TOPK_DIR, lo, list(zip(*kept)))
        s = read_json(home / STATS, missing_ok=True, what="shard stats") or {}
        stats["rows"] += s.get("rows", 0)
        stats["new_tokens"] += s.get("new_tokens", 0)
        stats["seconds"] = max(stats["seconds"], s.get("seconds", 0.0))
        stats["setup_seconds"] = max(stats.get("setup_seconds", 0.0), s.get("setup_seconds", 0.0))
        stats["batch_size"] = s.get("batch_size")
    stats["tokens_per_s"] = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    settings = read_json(out / SETTINGS, what="settings file")
    ds = save_rows(rows, FEATURES, {"draftsmith_distill_data": settings}, final)
    atomic_write_json(out / STATS, stats)
    shutil.rmtree(out / SHARDS, ignore_errors=True)
    return ds


def _save_topk(folder: Path, start: int, tops: list[tuple]) -> None:
    """Rows [start, start + len(tops)): their kept top-k, one file, written atomically before the rows."""
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    with atomic_path(folder / f"rows-{start:07d}.safetensors") as tmp:
        save_file({"values": torch.cat([v for v, _ in tops]).contiguous(),
                   "indices": torch.cat([i for _, i in tops]).contiguous(),
                   "lengths": torch.tensor([len(v) for v, _ in tops]), "start": torch.tensor([start])}, str(tmp))


def captured_topk(out: Path, n_rows: int) -> tuple[list[Tensor], list[Tensor]] | None:
    """The target's top-k kept while generating `out` (row i: values, indices (C_i, k)), or None unless all
    `n_rows` rows have it (some rows came from the draft, another model family, or an earlier run without it)."""
    from safetensors.torch import load_file

    values: dict[int, Tensor] = {}
    indices: dict[int, Tensor] = {}
    for path in sorted((Path(out) / TOPK_DIR).glob("rows-*.safetensors")):
        t = load_file(str(path))
        start, off = int(t["start"]), 0
        for r, n in enumerate(t["lengths"].tolist()):
            values[start + r], indices[start + r] = t["values"][off : off + n], t["indices"][off : off + n]
            off += n
    if any(i not in values for i in range(n_rows)):
        return None
    return [values[i] for i in range(n_rows)], [indices[i] for i in range(n_rows)]


def _record_speed(path: Path, new_rows: list[dict], seconds: float, batch_size: int, setup: float = 0.0) -> None:
    """Add this session's rows to `stats.json` (generation tokens/s over every session that generated; the
    seconds spent making runners and quantised copies apart, as `setup_seconds`)."""
    stats = read_json(path, missing_ok=True, what="data stats") or {"rows": 0, "new_tokens": 0, "seconds": 0.0}
    stats["rows"] += len(new_rows)
    stats["new_tokens"] += sum(len(r["continuation_ids"]) for r in new_rows)
    stats["seconds"] += seconds
    stats["setup_seconds"] = stats.get("setup_seconds", 0.0) + setup
    stats["tokens_per_s"] = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    stats["batch_size"] = batch_size
    atomic_write_json(path, stats)


def data_stats(out: Path) -> dict | None:
    """What generating the folder took (rows, new tokens, seconds, tokens/s), or None."""
    return read_json(Path(out) / STATS, missing_ok=True, what="data stats")


def target_vocab(target: Loaded) -> int:
    """The target's number of logit rows."""
    return target.model.get_output_embeddings().weight.shape[0]


# -- what training feeds the models ------------------------------------------------------------------------


def load_data_folder(folder: Path, target: Loaded) -> datasets.Dataset:
    """Rows to train on from a folder `generate_data` wrote (`draftsmith gen-data`), or any `datasets` folder
    with prompt_ids and continuation_ids columns; a gen-data folder made for another target is refused."""
    folder = Path(folder)
    path = folder / DATASET_DIR if (folder / DATASET_DIR).is_dir() else folder
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DraftsmithError(f"cannot read training data {folder}: {why}") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DraftsmithError(f"{folder} holds several splits ({', '.join(ds)}); point at one of them")
    settings = read_json(folder / "settings.json", missing_ok=True, what="training data settings")
    if settings and settings.get("target") not in (None, folder_identity(target.path)):
        raise DraftsmithError(f"{folder} was generated for another target ({settings['target']})")
    training_rows(ds)  # the columns and at least one usable row
    return ds


def training_rows(data: datasets.Dataset) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, continuation_ids) of every row that has both, in the data's order."""
    missing = {"prompt_ids", "continuation_ids"} - set(data.column_names)
    if missing:
        raise DraftsmithError(f"training data lacks column(s) {', '.join(sorted(missing))}")
    rows = [(list(p), list(c)) for p, c in zip(data["prompt_ids"], data["continuation_ids"]) if p and c]
    if not rows:
        raise DraftsmithError("the training data has no row with both prompt and continuation tokens")
    return rows


def collate(rows: list[tuple[list[int], list[int]]], idx: list[int], device: torch.device | str = "cpu"):
    """Rows `idx` right-padded -> (input_ids, attention_mask, loss mask), each (B, T); the loss mask marks the
    positions whose logits predict continuation tokens (position t predicts token t + 1)."""
    seqs = [rows[i][0] + rows[i][1] for i in idx]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    attn = torch.zeros(len(idx), T, dtype=torch.long)
    mask = torch.zeros(len(idx), T, dtype=torch.bool)
    for b, i in enumerate(idx):
        P, C = len(rows[i][0]), len(rows[i][1])
        ids[b, : P + C] = torch.tensor(seqs[b])
        attn[b, : P + C] = 1
        mask[b, P - 1 : P + C - 1] = True
    return ids.to(device), attn.to(device), mask.to(device)


__all__ = ["FEATURES", "SOURCES", "TOPK_DIR", "captured_topk", "collate", "data_stats", "draft_prompts",
           "generate_data", "load_data_folder", "training_rows"]
