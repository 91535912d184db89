"""Drafts for targets with no small sibling: keep a subset of the target's own decoder layers.

    .venv/bin/draftsmith derive --from qwen2.5-coder-1.5b-instruct --keep 8
    .venv/bin/draftsmith pair --candidates derive:qwen2.5-coder-1.5b-instruct:layers=0-3,27 ...

    from draftsmith.pairing.derive import derive
    derive("qwen2.5-coder-1.5b-instruct", keep=8)          # -> <cache>/derived/qwen2.5-coder-1.5b-instruct-layers0-7/

The draft shares the source's tokenizer, embeddings, final norm and LM head, so it is a same-tokenizer
draft by construction; its quality comes from distillation later. Output is a plain Hugging Face folder
(config.json, model.safetensors, tokenizer files, generation_config.json) plus `draftsmith_derived.json`
naming the source and the kept layers. The folder appears atomically (written beside, then renamed).
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from draftsmith.decode.runtime import zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_dir
from draftsmith.decode.spec import DraftSpec

_LAYER_KEYS = "model.layers."
_NOT_PER_LAYER = {"architectures"}  # config lists that could happen to be num_hidden_layers long
MARKER = "draftsmith_derived.json"


# ---------------------------------------------------------------------------------------------
# Specs




def _layers_key(layers: list[int]) -> str:
    """A short folder-name key: [0, 1, 2, 3, 7] -> 'layers0-3_7'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "layers" + "_".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _source_name(source: str) -> str:
    """Zoo names as they are; a folder or file by its name plus a hash of its absolute path."""
    if source in zoo.MODELS:
        return source
    path = Path(source).expanduser().resolve()
    return f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def default_out(source: str, layers: list[int]) -> Path:
    """Where derive() caches a draft when no `out` is given."""
    return zoo.cache_dir() / "derived" / f"{_source_name(source)}-{_layers_key(layers)}"


def _wanted_layers(layers: list[int] | None, keep: int | None) -> list[int]:
    """Validate what can be validated before looking at the source: one of the two, non-empty, no repeats."""
    if (layers is None) == (keep is None):
        raise DraftsmithError("derive: give exactly one of layers (indices to keep) or keep (first N layers)")
    if keep is not None:
        if keep < 1:
            raise DraftsmithError(f"derive: keep={keep}: keep at least one layer")
        return list(range(keep))
    layers = list(layers or [])
    if not layers:
        raise DraftsmithError("derive: layers is empty: keep at least one layer")
    repeated = sorted({i for i in layers if layers.count(i) > 1})
    if repeated:
        raise DraftsmithError(f"derive: layers {repeated} given more than once")
    return layers


def resolve_candidate(spec: str) -> str:
    """A derive spec -> the path of its derived HF folder (made once, cached); any other spec unchanged. A
    vocabulary-pruned spec is refused: it is no model folder (`pairing.drafts.load_draft` opens it)."""
    d = DraftSpec.parse(spec, sniff=False)
    if d.kind == "prune":
        raise DraftsmithError(f"{spec}: a vocabulary-pruned draft runs in draftsmith's decoder only (pair, validate, "
                              "grid, decode --draft); here name a whole model (its MODEL part)")
    if d.kind == "int4":
        raise DraftsmithError(f"{spec}: an int4 draft runs in draftsmith's decoder only (pair, validate, grid, "
                              "decode --draft); here name the whole model (drop int4:)")
    if d.kind != "derive":
        return spec
    return str(derive(d.inner.text, layers=None if d.layers is None else list(d.layers), keep=d.keep))


# ---------------------------------------------------------------------------------------------
# Building the draft


def _sliced_config(config: Any, layers: list[int]) -> Any:
    """A copy of `config` for the kept layers: num_hidden_layers, and every per-layer list re-indexed."""
    if getattr(config, "is_heterogeneous", False):
        raise DraftsmithError("derive: models with a per-layer config (per_layer_config) are not supported")
    n_source = config.num_hidden_layers
    new = copy.deepcopy(config)
    for key, value in config.to_dict().items():
        if key not in _NOT_PER_LAYER and isinstance(value, (list, tuple)) and len(value) == n_source:
            setattr(new, key, type(value)(value[i] for i in layers))  # e.g. layer_types
    new.num_hidden_layers = len(layers)
    return new


def _sliced_state_dict(state: dict[str, Any], layers: list[int]) -> dict[str, Any]:
    """The source's weights with `model.layers.{src}.` renamed to `model.layers.{dst}.`, other layers dropped."""
    new_index = {src: dst for dst, src in enumerate(layers)}
    out = {}
    for key, tensor in state.items():
        if key.startswith(_LAYER_KEYS):
            index, rest = key[len(_LAYER_KEYS) :].split(".", 1)
            if int(index) in new_index:
                out[f"{_LAYER_KEYS}{new_index[int(index)]}.{rest}"] = tensor
        else:
            out[key] = tensor
    return out


def slice_model(model: Any, layers: list[int]) -> Any:
    """A new model of `model`'s class made of its decoder layers `layers` (in that order), in eval mode."""
    import torch

    config = _sliced_config(model.config, layers)
    dtype = next(model.parameters()).dtype
    draft = type(model)(config).to(dtype)
    with torch.no_grad():
        draft.load_state_dict(_sliced_state_dict(model.state_dict(), layers), strict=True)
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()


def derive(
    source: str, out: Path | None = None, *, layers: list[int] | None = None, keep: int | None = None,
    progress: bool = True,
) -> Path:
    """Write a draft made of `source`'s decoder `layers` (or its first `keep`) as an HF folder; return it.

    `source` is a zoo name, HF folder or .gguf file. Without `out` the draft goes to the cache
    (`default_out`) and an existing one is reused; an explicit `out` must not exist yet.
    """
    from transformers import AutoConfig

    from draftsmith.decode.runtime.loading import load, resolve

    wanted = _wanted_layers(layers, keep)
    final = Path(out).expanduser() if out is not None else default_out(source, wanted)
    if (final / "config.json").is_file() and out is None:
        return final
    if final.exists():
        raise DraftsmithError(f"{final} already exists: remove it or choose another --out")

    source_path = resolve(source)  # an unknown source fails here, before anything is loaded
    n_source = AutoConfig.from_pretrained(source_path).num_hidden_layers
    outside = [i for i in wanted if not 0 <= i < n_source]
    if outside:
        raise DraftsmithError(
            f"derive: layer(s) {outside} out of range: {source} has {n_source} layers (0..{n_source - 1})"
        )
    if progress:
        print(f"draftsmith: deriving a {len(wanted)}-layer draft from {source} ({n_source} layers) -> {final}",
              file=sys.stderr, flush=True)  # fmt: skip

    loaded = load(source)
    if not hasattr(getattr(loaded.model, "model", None), "layers"):
        raise DraftsmithError(f"derive: {source}: no decoder layers at model.layers ({type(loaded.model).__name__})")
    draft = slice_model(loaded.model, wanted)

    with atomic_dir(final, keep_existing=True) as tmp:  # another process may cache the same draft first
        draft.save_pretrained(tmp, safe_serialization=True)
        loaded.tokenizer.save_pretrained(tmp)
        marker = {"source": source, "source_path": str(source_path), "source_layers": n_source, "layers": wanted}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return final
