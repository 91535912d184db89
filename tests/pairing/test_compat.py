"""Pair compatibility: our same-tokenizer rule and llama.cpp's draft rule, on tiny hand-built tokenizers.

    .venv/bin/python -m pytest tests/pairing/test_compat.py -q
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.pairing.compat import check_pair, llama_cpp_rule, loaded_meta, same_tokenizer, tokenizer_meta
from tests import helpers

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<sep>"]  # ids 0..4: below llama.cpp's check start


def words(n: int = 100, prefix: str = "w") -> list[str]:
    return SPECIALS + [f"{prefix}{i}" for i in range(n - len(SPECIALS))]


def make_tokenizer(vocab: list[str], *, bos: str = "<s>", eos: str = "</s>", add_bos: bool = False):
    """A word-level BPE tokenizer (no merges) over `vocab`, optionally prepending BOS like Llama's."""
    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, ids[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="<unk>")


def loaded(tokenizer, rows: int | None = None, name: str = "tiny") -> Loaded:
    """A Loaded with a one-layer model whose embedding has `rows` rows (default: the tokenizer's size)."""
    model = helpers.tiny_llama(0, rows or len(tokenizer), layers=1, hidden=8, heads=2, kv_heads=1, head_scale=1.0)
    return Loaded(model=model, tokenizer=tokenizer, path=Path("."), name=name)


def meta(n: int = 100, **overrides) -> dict:
    tokens = words(n)
    return {"vocab_type": "gpt2", "n_vocab": n, "bos_id": 1, "eos_id": 2, "add_bos": False, "add_eos": False,
            "tokens": tokens, **overrides}  # fmt: skip


# --- tokenizer_meta -----------------------------------------------------------------------------


def test_hf_meta_reads_type_specials_and_add_flags():
    plain = tokenizer_meta(make_tokenizer(words()))
    assert plain["vocab_type"] == "gpt2" and plain["n_vocab"] == 100 and plain["tokens"] == words()
    assert (plain["bos_id"], plain["eos_id"], plain["add_bos"], plain["add_eos"]) == (1, 2, False, False)
    assert tokenizer_meta(make_tokenizer(words(), add_bos=True))["add_bos"] is True


def test_hf_meta_pads_model_rows_like_convert_hf_to_gguf():
    m = tokenizer_meta(make_tokenizer(words()), n_rows=103)
    assert m["n_vocab"] == 103 and m["tokens"][-3:] == ["[PAD100]", "[PAD101]", "[PAD102]"]


def write_gguf(path: Path, tokens: list[str], *, model: str = "gpt2", add_bos: bool | None = False) -> Path:
    """A metadata-only GGUF with a tokenizer, and fields around it that the reader must skip."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types([3] * 5 + [1] * (len(tokens) - 5))
    w.add_token_merges(["w 1", "w 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_meta(tmp_path: Path):
    tokens = words(50, prefix="g")
    m = tokenizer_meta(None, gguf_path=write_gguf(tmp_path / "a.gguf", tokens))
    assert m == {"vocab_type": "gpt2", "n_vocab": 50, "bos_id": 1, "eos_id": 2, "add_bos": False, "add_eos": False,
                 "tokens": tokens}  # fmt: skip
    # no add_bos key: llama.cpp's default for SPM vocabularies is to add BOS
    spm = tokenizer_meta(None, gguf_path=write_gguf(tmp_path / "b.gguf", tokens, model="llama", add_bos=None))
    assert spm["vocab_type"] == "llama" and spm["add_bos"] is True


def test_gguf_meta_bad_file_is_one_clear_error(tmp_path: Path):
    path = write_gguf(tmp_path / "a.gguf", words())
    path.write_bytes(path.read_bytes()[:200])  # cut inside the token list
    with pytest.raises(DraftsmithError, match="cannot read the GGUF tokenizer metadata"):
        tokenizer_meta(None, gguf_path=path)


# --- llama.cpp's rule (pure) --------------------------------------------------------------------


def test_llama_cpp_rule_passes_identical_and_padded_by_128():
    assert llama_cpp_rule(meta(), meta()) == (True, [])
    padded = meta(228, tokens=words() + [f"[PAD{i}]" for i in range(100, 228)])
    assert llama_cpp_rule(padded, meta()) == (True, [])


def _edit(tokens: list[str], i: int, text: str) -> list[str]:
    return tokens[:i] + [text] + tokens[i + 1 :]


@pytest.mark.parametrize(
    "draft,clause",
    [
        (meta(vocab_type="llama"), "vocab type"),
        (meta(bos_id=0), "BOS id"),
        (meta(eos_id=3), "EOS id"),
        (meta(add_bos=True), "add-BOS flag"),
        (meta(add_eos=True), "add-EOS flag"),
        (meta(229, tokens=words() + [f"[PAD{i}]" for i in range(100, 229)]), "n_vocab difference 129"),
        (meta(tokens=_edit(words(), 5, "other")), "token text differs at 1 of ids 5..99 (first at id 5"),
        (meta(tokens=_edit(words(), 99, "other")), "first at id 99"),
    ],
)
def test_llama_cpp_rule_names_each_failed_clause(draft, clause):
    ok, notes = llama_cpp_rule(meta(), draft)
    assert not ok and len(notes) == 1 and clause in notes[0]


def test_llama_cpp_rule_ignores_token_text_below_id_5():
    draft = meta(tokens=_edit(_edit(words(), 0, "<|endoftext|>"), 4, "<other>"))
    assert llama_cpp_rule(meta(), draft) == (True, [])


def test_llama_cpp_rule_lists_every_failure():
    ok, notes = llama_cpp_rule(meta(), meta(300, vocab_type="llama", eos_id=7, tokens=words(300, prefix="x")))
    assert not ok and [n.split(" ")[0] for n in notes] == ["vocab", "EOS", "n_vocab", "token"]


def test_rules_are_fast_on_150k_vocabularies():
    big = [f"t{i}" for i in range(151936)]
    a, b = meta(151936, tokens=big), meta(151936, tokens=big[:-1] + ["other"])
    start = time.perf_counter()
    assert not llama_cpp_rule(a, b)[0] and not same_tokenizer(a, b)[0]
    assert llama_cpp_rule(a, meta(151936, tokens=list(big)))[0]
    assert time.perf_counter() - start < 2.0


# --- same tokenizer or not ----------------------------------------------------------------------


def test_same_tokenizer_allows_padding_names_and_spm_spaces():
    a = meta(tokens=_edit(words(), 50, "<unused3>") + ["[PAD100]", "<pad_1>"])
    b = meta(tokens=_edit(words(), 50, "[PAD50]"))
    assert same_tokenizer(a, b) == (True, ["target vocab 102 vs draft 100: 2 padding rows"])
    spaces = meta(vocab_type="llama", tokens=_edit(words(), 20, "  "))
    assert same_tokenizer(spaces, meta(vocab_type="llama", tokens=_edit(words(), 20, "\u2581\u2581")))[0]
    assert not same_tokenizer(spaces, meta(tokens=_edit(words(), 20, "\u2581\u2581")))[0]  # BPE: a real difference


def test_check_pair_padded_vocab_is_same_tokenizer_and_passes_llama_cpp():
    tok = make_tokenizer(words())
    c = check_pair(loaded(tok, rows=228), loaded(make_tokenizer(words())))
    assert (c.kind, c.compatible, c.llama_cpp) == ("same-tokenizer", True, True)
    assert c.notes == ["target vocab 228 vs draft 100: 128 padding rows"] and c.llama_cpp_notes == []
    over = check_pair(loaded(tok, rows=229), loaded(tok))
    assert over.compatible and over.llama_cpp is False and "n_vocab difference 129" in over.llama_cpp_notes[0]
    assert c.to_dict()["kind"] == "same-tokenizer"


def test_check_pair_different_tokenizer_is_cross_with_reasons():
    target = loaded(make_tokenizer(words()))
    draft = loaded(make_tokenizer(words(80, prefix="v"), eos="<sep>"))
    c = check_pair(target, draft)
    assert (c.kind, c.compatible, c.llama_cpp) == ("cross-tokenizer", False, False)
    text = " | ".join(c.notes)
    assert "token text differs at 75 of 80 shared ids" in text
    assert "20 of the target's ids past 80 are real tokens" in text
    assert "target EOS 2 vs draft 4" in text
    assert any("EOS id" in n for n in c.llama_cpp_notes)


def test_check_pair_extra_real_tokens_is_cross():
    c = check_pair(loaded(make_tokenizer(words())), loaded(make_tokenizer(words() + ["new1", "new2"])))
    assert c.kind == "cross-tokenizer" and "2 of the draft's ids past 100 are real tokens" in c.notes[0]
    assert c.llama_cpp is True  # 2 extra ids are within llama.cpp's tolerance


def test_check_pair_unknown_vocab_type_leaves_llama_cpp_unevaluated(monkeypatch):
    import draftsmith.pairing.compat as compat

    monkeypatch.setattr(compat, "_hf_vocab_type", lambda tokenizer: None)
    tok = make_tokenizer(words())
    c = check_pair(loaded(tok), loaded(tok))
    assert c.compatible and c.llama_cpp is None and "unknown" in c.llama_cpp_notes[0]


def test_zoo_models_are_read_from_their_gguf(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    (tmp_path / "gguf").mkdir()
    tokens = words(100, prefix="g")
    write_gguf(tmp_path / "gguf" / "smollm2-135m-instruct.gguf", tokens)
    tok = make_tokenizer(words())
    assert loaded_meta(loaded(tok, name="smollm2-135m-instruct"))["tokens"] == tokens
    assert loaded_meta(loaded(tok, name="qwen2.5-coder-0.5b-instruct"))["tokens"] == words()  # not pulled: HF
