"""Derived drafts: spec parsing, exactness against the source run with only the kept layers, errors.

    .venv/bin/python -m pytest tests/pairing/test_derive.py -q
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import load
from draftsmith.pairing import derive as derive_mod
from draftsmith.decode.spec import DraftSpec
from draftsmith.pairing.derive import derive, resolve_candidate
from tests import helpers

VOCAB = 100
N_LAYERS = 4


def save_source(folder: Path, arch: str = "llama", tied: bool = False, sliding: bool = False) -> Path:
    """A tiny random-init model and a word-level tokenizer, saved as an HF folder."""
    # sliding (qwen2): layers 2 and 3 see a 4-token window, so layer order matters for the masks
    extra = dict(use_sliding_window=True, sliding_window=4, max_window_layers=2) if sliding else {}
    tok = helpers.word_tokenizer(["<s>", "</s>", *(f"w{i}" for i in range(2, VOCAB))], unk="</s>", bos="<s>",
                                 eos="</s>")
    return helpers.save_tiny(folder, tok, 0, layers=N_LAYERS, max_positions=128, head_scale=1.0, tied=tied,
                             arch=arch, **extra)


def reference_logits(model, layers: list[int], ids: torch.Tensor) -> torch.Tensor:
    """The source run with only `layers` (in that order): its own modules, sliced on a deep copy."""
    ref = copy.deepcopy(model)
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in layers])
    ref.config.num_hidden_layers = len(layers)
    if getattr(ref.config, "layer_types", None) is not None:
        ref.config.layer_types = [model.config.layer_types[i] for i in layers]
    with torch.no_grad():
        return ref(ids, use_cache=False).logits


# --- specs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("derive:qwen2.5-coder-1.5b-instruct:keep=8", ("qwen2.5-coder-1.5b-instruct", None, 8)),
        ("derive:m:layers=0,1,2,3", ("m", [0, 1, 2, 3], None)),
        ("derive:m:layers=0-3,7", ("m", [0, 1, 2, 3, 7], None)),
        ("derive:m:layers=5,0", ("m", [5, 0], None)),
        ("derive:/a/b:c:keep=2", ("/a/b:c", None, 2)),
        ("qwen2.5-coder-0.5b-instruct", None),
        ("some/folder", None),
    ],
)
def test_parse_derive_spec(spec, expected):
    d = DraftSpec.parse(spec, sniff=False)
    got = (d.inner.text, None if d.layers is None else list(d.layers), d.keep) if d.kind == "derive" else None
    assert got == expected


@pytest.mark.parametrize(
    "spec,message",
    [
        ("derive:m", "expected derive:MODEL:keep=N"),
        ("derive:m:keep=2:layers=1", "not keep and layers"),
        ("derive:m:keep=x", "keep= needs a number"),
        ("derive:m:layers=", "expected indices"),
        ("derive:m:layers=3-1", "runs backwards"),
        ("derive:m:layers=a,b", "expected indices"),
    ],
)
def test_parse_derive_spec_errors(spec, message):
    with pytest.raises(DraftsmithError, match=message):
        DraftSpec.parse(spec, sniff=False)


def test_resolve_candidate_passes_other_specs_through():
    assert resolve_candidate("smollm2-135m-instruct") == "smollm2-135m-instruct"


# --- exactness --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,tied,sliding,layers",
    [
        ("llama", False, False, [0, 2]),
        ("qwen2", True, False, [3, 1, 0]),
        ("qwen2", False, True, [3, 0]),
    ],
)
def test_derived_logits_equal_the_sliced_source(tmp_path: Path, arch, tied, sliding, layers):
    src = save_source(tmp_path / "src", arch, tied, sliding)
    out = derive(str(src), tmp_path / "draft", layers=layers, progress=False)
    assert out == tmp_path / "draft"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    marker = json.loads((out / "draftsmith_derived.json").read_text())
    assert marker["source"] == str(src) and marker["layers"] == layers and marker["source_layers"] == N_LAYERS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "src"]  # no temporary left behind

    source, draft = load(src), load(out)
    assert draft.model.config.num_hidden_layers == len(layers)
    if arch == "qwen2":  # per-layer lists follow their layers
        assert draft.model.config.layer_types == [source.model.config.layer_types[i] for i in layers]
    assert draft.tokenizer.get_vocab() == source.tokenizer.get_vocab()
    if tied:
        assert draft.model.lm_head.weight.data_ptr() == draft.model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = draft.model(ids, use_cache=False).logits
    assert torch.equal(got, reference_logits(source.model, layers, ids))


def test_keep_takes_the_first_layers_and_resolve_candidate_caches(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    src = save_source(tmp_path / "src")
    path = Path(resolve_candidate(f"derive:{src}:keep=2"))
    assert path.parent == tmp_path / "cache" / "derived" and path.name.endswith("-layers0-1")
    assert json.loads((path / "draftsmith_derived.json").read_text())["layers"] == [0, 1]
    # the same layers named another way hit the same cached folder, without loading anything
    monkeypatch.setattr("draftsmith.decode.runtime.loading.load", lambda *a, **k: pytest.fail("derived again"))
    assert resolve_candidate(f"derive:{src}:layers=0-1") == str(path)


# --- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(layers=[0, 4]), r"layer\(s\) \[4\] out of range: .* has 4 layers"),
        (dict(keep=5), r"out of range: .* has 4 layers"),
        (dict(layers=[]), "layers is empty"),
        (dict(layers=[1, 0, 1]), r"layers \[1\] given more than once"),
        (dict(layers=[0], keep=1), "exactly one of layers"),
        (dict(), "exactly one of layers"),
        (dict(keep=0), "keep at least one layer"),
    ],
)
def test_derive_errors(tmp_path: Path, kwargs, message):
    src = save_source(tmp_path / "src")
    with pytest.raises(DraftsmithError, match=message):
        derive(str(src), tmp_path / "draft", progress=False, **kwargs)
    assert not (tmp_path / "draft").exists()


def test_derive_unknown_source_and_existing_out(tmp_path: Path):
    with pytest.raises(DraftsmithError, match="no such zoo model, folder or file"):
        derive(str(tmp_path / "nothing"), tmp_path / "draft", keep=1, progress=False)
    src = save_source(tmp_path / "src")
    with pytest.raises(DraftsmithError, match="already exists"):
        derive(str(src), src, keep=1, progress=False)


def test_layers_key():
    assert derive_mod._layers_key([0, 1, 2, 3, 7, 5, 6]) == "layers0-3_7_5-6"
