"""decode_text: one prompt in, text and statistics out; bad settings are one-line errors. Prompt ids go through
the chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.pair import Pair
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.textgen import decode_text, prompt_ids
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
