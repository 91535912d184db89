"""decode_text: one prompt in, text and statistics out; bad settings are one-line errors. And what it shares with
the benchmark: prompt ids through the chat template, every EOS id, the one-tokenizer check, machine and versions."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

from decode.allocator import allocator_setting
from decode.errors import DraftsmithError
from decode.model import make_runner
from decode.textgen import Pair, check_vocab, decode_text, eos_ids, machine_info, prompt_ids, versions
from tests import helpers


def test_no_new_tokens_is_a_one_line_error(tmp_path: Path) -> None:
    tok = helpers.word_tokenizer(["a", "b", "c", "<eos>", "[UNK]"], eos="<eos>")
    target = helpers.tiny_loaded(0, tmp_path / "target", tok, eos_id=3)
    pair = Pair(target, None, make_runner(target.model, 32), None)
    assert decode_text(pair, "a b", max_new_tokens=2)["prompt_tokens"] == 2
    for n in (0, -1):
        with pytest.raises(DraftsmithError, match=f"max_new_tokens must be >= 1, got {n}") as e:
            decode_text(pair, "a b", max_new_tokens=n)
        assert "\n" not in str(e.value)


WORDS = ["<u>", "</u>", "<a>", "a", "b", "c", "<eos>", "[UNK]"]
TEMPLATE = ("{% for m in messages %}<u> {{ m['content'] }} </u>{% endfor %}"
            "{% if add_generation_prompt %} <a>{% endif %}")


def test_prompt_ids_go_through_the_chat_template_when_there_is_one() -> None:
    tok = helpers.word_tokenizer(WORDS, eos="<eos>")
    assert prompt_ids(tok, "a b c") == [3, 4, 5]  # no template: the text alone
    tok.chat_template = TEMPLATE
    assert prompt_ids(tok, "a b") == [0, 3, 4, 1, 2]  # <u> a b </u> <a>: user turn, then the reply's start
    assert prompt_ids(tok, "a b", chat=False) == [3, 4]


def test_eos_ids_join_the_tokenizer_and_the_generation_config(tmp_path: Path) -> None:
    tok = helpers.word_tokenizer(WORDS, eos="<eos>")
    loaded = helpers.tiny_loaded(0, tmp_path / "m", tok, eos_id=6)
    assert eos_ids(loaded) == [6]
    loaded.model.generation_config.eos_token_id = [2, 6]  # a chat model's end-of-turn besides the EOS
    assert eos_ids(loaded) == [2, 6]
    loaded.model.generation_config.eos_token_id = None
    assert eos_ids(loaded) == [6]


def test_check_vocab_refuses_another_tokenizer_by_name(tmp_path: Path) -> None:
    tok = helpers.word_tokenizer(WORDS, eos="<eos>")
    target = helpers.tiny_loaded(0, tmp_path / "target", tok, eos_id=6)
    twin = helpers.tiny_loaded(1, tmp_path / "twin", helpers.word_tokenizer(WORDS, eos="<eos>"), eos_id=6, layers=1)
    assert check_vocab(target, twin) is None
    other = helpers.tiny_loaded(2, tmp_path / "other", helpers.word_tokenizer(["<u>", "</u>", "<a>", "a", "b", "d",
                                                                              "<eos>", "[UNK]"], eos="<eos>"), eos_id=6)
    with pytest.raises(DraftsmithError, match="different tokenizers") as e:
        check_vocab(target, other)
    message = str(e.value)
    assert "'other'" in message and "'target'" in message and "8 vs 8 tokens, 7 shared" in message
    assert "\n" not in message


def test_machine_info_and_versions_say_where_a_number_was_measured() -> None:
    info = machine_info()
    assert set(info) == {"platform", "cpu", "cpu_count", "torch_threads", "cuda", "allocator"}
    assert info["allocator"] == allocator_setting()
    assert info["cpu_count"] == os.cpu_count() and info["torch_threads"] == torch.get_num_threads()
    assert isinstance(info["cpu"], str) and (info["cuda"] is None) == (not torch.cuda.is_available())
    v = versions()
    assert set(v) == {"python", "torch", "transformers", "draftsmith"}
    assert v["python"] == sys.version.split()[0] and v["torch"] == torch.__version__
    assert v["transformers"] == transformers.__version__ and v["draftsmith"]
