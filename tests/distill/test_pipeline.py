"""The distillation run's held-out split: evaluation never sees a training prompt."""

import pytest

from decode.errors import DraftsmithError
from decode.prompts import Prompt, load_prompts
from distill.pipeline import split_prompts


def test_split_holds_out_the_first_n_of_every_domain() -> None:
    prompts = load_prompts("code,chat")
    train, held = split_prompts(prompts, 3)
    assert [p.id for p in held] == [p.id for p in prompts if p.domain == "code"][:3] + \
        [p.id for p in prompts if p.domain == "chat"][:3]
    assert not {p.id for p in train} & {p.id for p in held}
    assert len(train) + len(held) == len(prompts)


def test_split_needs_both_sides() -> None:
    with pytest.raises(DraftsmithError):
        split_prompts([Prompt("a", "x", "hi")], 1)
