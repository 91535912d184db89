"""check_vocab: token-level speculation needs one tokenizer; another is refused by name, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.pair import check_vocab
from tests import helpers
from tests.decode.test_textgen import WORDS


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
