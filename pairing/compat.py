"""Can this draft speculate for this target token by token, and would llama.cpp accept the pair?

    from draftsmith.pairing.compat import check_pair
    c = check_pair(load("qwen2.5-coder-1.5b-instruct"), load("qwen2.5-coder-0.5b-instruct"))
    c.kind, c.compatible, c.notes, c.llama_cpp, c.llama_cpp_notes

Two questions, two answers:
- Same tokenizer family (token-level speculation possible): vocabularies equal up to padding rows
  (ids past the end of one that the other fills with padding: no text, `[PAD123]`, `<unused7>`...),
  the same text for every shared id, the same BOS and EOS. Otherwise the pair is "cross-tokenizer":
  not refused, but measured through text.
- llama.cpp's rule (`common_speculative_are_compatible`, what `llama-speculative` and `llama-server -md`
  check): same vocab type, same BOS/EOS ids, same add-BOS/add-EOS flags, n_vocab within 128, identical
  token text from id 5 on. `llama_cpp_rule` is pure over two `tokenizer_meta` dicts so export can run it
  on GGUF metadata. (Recent llama.cpp compares a BOS/EOS id only when it is added; we keep the strict
  form, which passes on every version.)

Token text is compared as stored in the vocabulary (`Ġthe`, `▁the`, `<0x0A>`), as llama.cpp does.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import Loaded

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp common/speculative.cpp
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5  # ids below this (special tokens) may differ

# Rows a vocabulary fills to reach a round size: no text, convert_hf_to_gguf's `[PAD123]`, `<pad>`,
# `<unused7>`, `<|reserved_special_token_3|>`. Not `<|fim_pad|>`: that is a real Qwen token.
_PADDING = re.compile(r"\[PAD\d+\]|<\|?(?:pad|unused|reserved)[\w-]*\|?>", re.IGNORECASE)


@dataclass
class Compat:
    """The verdict on a (target, draft) pair; notes say why, in words."""

    kind: str  # "same-tokenizer" or "cross-tokenizer"
    compatible: bool  # token-level speculative decoding possible
    notes: list[str] = field(default_factory=list)
    llama_cpp: bool | None = None  # llama.cpp's draft rule; None when it cannot be evaluated
    llama_cpp_notes: list[str] = field(default_factory=list)  # each failed clause

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_padding(text: str | None) -> bool:
    """True for a vocabulary row that holds no real token."""
    return not text or _PADDING.fullmatch(text) is not None


# ---------------------------------------------------------------------------------------------
# Tokenizer metadata: {"vocab_type", "n_vocab", "bos_id", "eos_id", "add_bos", "add_eos", "tokens"}

# `gguf.GGUFReader` decodes every field of the file up front (merges included): 15-30 s on a 150k
# vocabulary. We need six tokenizer keys, so we walk the key/value section ourselves: under a second.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_KEYS = {
    "tokenizer.ggml.model": "vocab_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.bos_token_id": "bos_id",
    "tokenizer.ggml.eos_token_id": "eos_id",
    "tokenizer.ggml.add_bos_token": "add_bos",
    "tokenizer.ggml.add_eos_token": "add_eos",
}
# llama.cpp's defaults when a GGUF has no add_bos/add_eos key (SPM and WPM vocabularies add BOS)
_DEFAULT_ADD_BOS = {"llama": True, "bert": True}


def _gguf_tokenizer_fields(path: Path) -> dict[str, Any]:
    """The tokenizer keys of a GGUF file's metadata (little-endian GGUF v2/v3)."""
    wanted = set(_GGUF_KEYS)
    found: dict[str, Any] = {}
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:

        def string(off: int) -> tuple[int, bytes]:
            (n,) = struct.unpack_from("<Q", m, off)
            if off + 8 + n > len(m):
                raise ValueError("string runs past the end of the file")
            return off + 8 + n, m[off + 8 : off + 8 + n]

        def value(off: int, vtype: int, keep: bool) -> tuple[int, Any]:
            if vtype in _GGUF_SCALARS:
                fmt = "<" + _GGUF_SCALARS[vtype]
                return off + struct.calcsize(fmt), struct.unpack_from(fmt, m, off)[0] if keep else None
            if vtype == _GGUF_STRING:
                off, raw = string(off)
                return off, raw.decode("utf-8", errors="replace") if keep else None
            if vtype == _GGUF_ARRAY:
                item_type, n = struct.unpack_from("<IQ", m, off)
                off += 12
                if item_type in _GGUF_SCALARS:
                    size = struct.calcsize("<" + _GGUF_SCALARS[item_type])
                    items = list(struct.unpack_from(f"<{n}{_GGUF_SCALARS[item_type]}", m, off)) if keep else None
                    return off + n * size, items
                items = []
                for _ in range(n):
                    off, item = value(off, item_type, keep)
                    items.append(item)
                return off, items if keep else None
            raise ValueError(f"unknown value type {vtype}")

        magic, version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", m, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"magic {magic!r} version {version}")
        off = 24
        for _ in range(n_kv):
            off, raw_key = string(off)
            key = raw_key.decode("utf-8", errors="replace")
            (vtype,) = struct.unpack_from("<I", m, off)
            off, v = value(off + 4, vtype, key in wanted)
            if key in wanted:
                found[_GGUF_KEYS[key]] = v
                wanted.discard(key)
                if not wanted:
                    break
    return found


def _gguf_meta(path: Path) -> dict[str, Any]:
    try:
        fields = _gguf_tokenizer_fields(path)
    except (OSError, ValueError, struct.error) as e:
        raise DraftsmithError(f"{path}: cannot read the GGUF tokenizer metadata ({e})") from None
    tokens = fields.get("tokens")
    if not tokens:
        raise DraftsmithError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
    vocab_type = fields.get("vocab_type")
    add_bos = fields.get("add_bos")
    return {
        "vocab_type": vocab_type,
        "n_vocab": len(tokens),
        "bos_id": fields.get("bos_id"),
        "eos_id": fields.get("eos_id"),
        "add_bos": _DEFAULT_ADD_BOS.get(vocab_type, False) if add_bos is None else bool(add_bos),
        "add_eos": bool(fields.get("add_eos", False)),
        "tokens": tokens,
    }


def _hf_vocab_type(tokenizer: Any) -> str | None:
    """llama.cpp's name for the tokenizer's algorithm: what convert_hf_to_gguf would write."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: sentencepiece models are llama.cpp's SPM
        return "llama" if hasattr(tokenizer, "sp_model") else None
    model = backend.model
    kind = type(model).__name__
    if kind == "BPE":  # sentencepiece BPE (Llama 2, Gemma) converts to BPE with byte fallback
        return "llama" if getattr(model, "byte_fallback", False) else "gpt2"
    return {"Unigram": "t5", "WordPiece": "bert"}.get(kind, kind.lower())


def _added_specials(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after the text on its own (the add-BOS/EOS behaviour)."""
    full = list(tokenizer("a")["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def _hf_meta(tokenizer: Any, n_rows: int | None) -> dict[str, Any]:
    n = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    tokens = [t or "" for t in tokenizer.convert_ids_to_tokens(list(range(n)))]
    if n_rows is not None and n_rows > n:  # model rows past the tokenizer, named as convert_hf_to_gguf does
        tokens += [f"[PAD{i}]" for i in range(n, n_rows)]
    before, after = _added_specials(tokenizer)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return {
        "vocab_type": _hf_vocab_type(tokenizer),
        "n_vocab": len(tokens),
        "bos_id": bos,
        "eos_id": eos,
        "add_bos": bos is not None and bos in before,
        "add_eos": eos is not None and eos in after,
        "tokens": tokens,
    }


def tokenizer_meta(tokenizer: Any, *, gguf_path: Path | None = None, n_rows: int | None = None) -> dict[str, Any]:
    """What llama.cpp would see of a vocabulary: from `gguf_path` when given, else from the HF tokenizer.

    Keys: vocab_type ('gpt2', 'llama', 't5', 'bert'...; None if unknown), n_vocab, bos_id, eos_id,
    add_bos, add_eos, tokens (text by id). `n_rows`, the model's embedding rows, pads an HF vocabulary
    with `[PAD{id}]` rows as convert_hf_to_gguf does (ignored for a GGUF, which is already padded).
    """
    if gguf_path is not None:
        return _gguf_meta(Path(gguf_path))
    return _hf_meta(tokenizer, n_rows)


# ---------------------------------------------------------------------------------------------
# The rules


def _differing_ids(a: list[str], b: list[str], start: int, end: int) -> list[int]:
    if a[start:end] == b[start:end]:  # the common case, at C speed
        return []
    return [i for i in range(start, end) if a[i] != b[i]]


def _first(ids: list[int], a: list[str], b: list[str]) -> str:
    i = ids[0]
    return f"first at id {i}: {a[i][:40]!r} vs {b[i][:40]!r}"


def llama_cpp_rule(target_meta: dict[str, Any], draft_meta: dict[str, Any]) -> tuple[bool, list[str]]:
    """llama.cpp's draft-compatibility rule over two `tokenizer_meta` dicts: (passes, failed clauses).

    Every clause is evaluated (llama.cpp stops at the first), so the notes list all that fail.
    """
    t, d = target_meta, draft_meta
    failed = []
    if t["vocab_type"] != d["vocab_type"]:
        failed.append(f"vocab type: target {t['vocab_type']!r} vs draft {d['vocab_type']!r}")
    for key, name in (("bos_id", "BOS id"), ("eos_id", "EOS id"), ("add_bos", "add-BOS flag"),
                      ("add_eos", "add-EOS flag")):  # fmt: skip
        if t[key] != d[key]:
            failed.append(f"{name}: target {t[key]} vs draft {d[key]}")
    diff = abs(t["n_vocab"] - d["n_vocab"])
    if diff > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        failed.append(
            f"n_vocab difference {diff} > {SPEC_VOCAB_MAX_SIZE_DIFFERENCE} "
            f"(target {t['n_vocab']}, draft {d['n_vocab']})"
        )
    end = min(t["n_vocab"], d["n_vocab"], len(t["tokens"]), len(d["tokens"]))
    differ = _differing_ids(t["tokens"], d["tokens"], SPEC_VOCAB_CHECK_START_TOKEN_ID, end)
    if differ:
        failed.append(
            f"token text differs at {len(differ)} of ids {SPEC_VOCAB_CHECK_START_TOKEN_ID}..{end - 1} "
            f"({_first(differ, t['tokens'], d['tokens'])})"
        )
    return not failed, failed


def _same_text(a: str, b: str, spm: bool) -> bool:
    """Two differing vocabulary entries that still mean the same: padding on both sides, or (SPM) a
    space stored as ' ' on one side and '▁' on the other (Gemma's GGUF vs its HF conversion)."""
    if is_padding(a) and is_padding(b):
        return True
    return spm and a.replace(" ", "▁") == b.replace(" ", "▁")


def same_tokenizer(target_meta: dict[str, Any], draft_meta: dict[str, Any]) -> tuple[bool, list[str]]:
    """Our own rule for token-level speculation: (same family, notes). Rows past the shorter
    vocabulary must be padding; shared ids must have the same text (see `_same_text`); BOS and EOS
    ids must match."""
    a, b = target_meta["tokens"], draft_meta["tokens"]
    spm = target_meta["vocab_type"] == draft_meta["vocab_type"] == "llama"
    shared = min(len(a), len(b))
    notes, ok = [], True
    differ = [i for i in _differing_ids(a, b, 0, shared) if not _same_text(a[i], b[i], spm)]
    if differ:
        ok = False
        notes.append(f"token text differs at {len(differ)} of {shared} shared ids ({_first(differ, a, b)})")
    if len(a) != len(b):
        longer, side = (a, "target") if len(a) > len(b) else (b, "draft")
        real = sum(not is_padding(text) for text in longer[shared:])
        if real:
            ok = False
            notes.append(
                f"target vocab {len(a)} vs draft {len(b)}: {real} of the {side}'s ids past {shared} are real tokens"
            )
        else:
            notes.append(f"target vocab {len(a)} vs draft {len(b)}: {len(longer) - shared} padding rows")
    for key, name in (("bos_id", "BOS"), ("eos_id", "EOS")):
        if target_meta[key] != draft_meta[key]:
            ok = False
            notes.append(f"target {name} {target_meta[key]} vs draft {draft_meta[key]}")
    return ok, notes


# ---------------------------------------------------------------------------------------------
# Pairs of loaded models


def _model_rows(model: Any) -> int | None:
    """Rows of the model's embedding (config.vocab_size as a fallback): can exceed the tokenizer."""
    try:
        return int(model.get_input_embeddings().weight.shape[0])
    except (AttributeError, TypeError, NotImplementedError):
        return getattr(getattr(model, "config", None), "vocab_size", None)


def _zoo_gguf(loaded: Loaded) -> Path | None:
    if loaded.name not in zoo.MODELS:
        return None
    try:
        return zoo.gguf_path(loaded.name)
    except DraftsmithError:  # not pulled as a GGUF: fall back to the HF tokenizer
        return None


def loaded_meta(loaded: Loaded) -> dict[str, Any]:
    """`tokenizer_meta` of a loaded model: its zoo GGUF when there is one, else its HF tokenizer padded
    to the model's rows; the token list always covers every row (missing rows count as padding)."""
    rows = _model_rows(loaded.model)
    gguf_file = _zoo_gguf(loaded)
    meta = tokenizer_meta(loaded.tokenizer, gguf_path=gguf_file, n_rows=rows)
    if rows is not None and len(meta["tokens"]) < rows:
        meta = {**meta, "tokens": meta["tokens"] + [""] * (rows - len(meta["tokens"]))}
    return meta


def check_pair(target: Loaded, draft: Loaded) -> Compat:
    """Same tokenizer family or not, and llama.cpp's verdict, for two loaded models."""
    t, d = loaded_meta(target), loaded_meta(draft)
    same, notes = same_tokenizer(t, d)
    unknown = [side for side, m in (("target", t), ("draft", d)) if m["vocab_type"] is None]
    if unknown:
        llama_ok, llama_notes = None, [f"vocab type of the {' and '.join(unknown)} tokenizer unknown"]
    else:
        llama_ok, llama_notes = llama_cpp_rule(t, d)
    return Compat(
        kind="same-tokenizer" if same else "cross-tokenizer",
        compatible=same,
        notes=notes,
        llama_cpp=llama_ok,
        llama_cpp_notes=llama_notes,
    )
