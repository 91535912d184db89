"""Reference continuations: generated once, loaded from the cache after, resumed without duplicates,
the same with or without a draft at temperature 0, and sampled from one generator per prompt."""

import json
from pathlib import Path

import pytest
import torch

import draftsmith.pairing.reference as reference
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.decode.prompts import Prompt
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.speculative import generate
from draftsmith.pairing.reference import prompt_seed, reference_continuations, reference_key
from tests import helpers

WORDS = [f"w{i}" for i in range(48)]
EOS = len(WORDS)  # <eos>; [UNK] (49) lies outside the models' rows


def word_tokenizer():
    return helpers.word_tokenizer([*WORDS, "<eos>", "[UNK]"], eos="<eos>")


def tiny_loaded(seed: int, folder: Path, layers: int = 2) -> Loaded:
    """A random float32 Llama (int8 drafts need float32) with its config saved in `folder`, as a real one has."""
    return helpers.tiny_loaded(seed, folder, word_tokenizer(), eos_id=EOS, layers=layers)


PROMPTS = [
    Prompt(str(i), ("code", "chat")[i % 2], " ".join(WORDS[(5 * i) % 40 : (5 * i) % 40 + 1 + i % 4])) for i in range(6)
]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Loaded:
    return tiny_loaded(0, tmp_path_factory.mktemp("models") / "target")


class Interrupted(Exception):
    """Stands for Ctrl-C or a killed job in the middle of generation."""


class Calls:
    """Counts the decoder's calls; with `fail_after` set, raises once that many have completed."""

    def __init__(self) -> None:
        self.n, self.fail_after, self.drafted = 0, None, False

    def __call__(self, *args, **kwargs):
        if self.fail_after is not None and self.n >= self.fail_after:
            raise Interrupted
        self.n += 1
        self.drafted = self.drafted or kwargs.get("draft") is not None
        return generate(*args, **kwargs)

    def reset(self, fail_after: int | None = None) -> None:
        self.n, self.fail_after = 0, fail_after


@pytest.fixture
def calls(monkeypatch) -> Calls:
    counter = Calls()
    monkeypatch.setattr(reference, "generate", counter)
    return counter


def test_rows_then_cache_hit_without_generating(target, tmp_path, calls) -> None:
    first = reference_continuations(target, PROMPTS, max_new_tokens=8, cache_root=tmp_path, progress=False)
    assert calls.n == len(PROMPTS)
    assert first.column_names == ["id", "domain", "prompt", "prompt_ids", "continuation_ids", "text"]
    for p, row in zip(PROMPTS, first):
        assert (row["id"], row["domain"], row["prompt"]) == (p.id, p.domain, p.prompt)
        assert row["prompt_ids"] == target.tokenizer(p.prompt)["input_ids"]
        assert 1 <= len(row["continuation_ids"]) <= 8
        assert row["text"] == target.tokenizer.decode(row["continuation_ids"], skip_special_tokens=True)
    assert sorted(x.name for x in tmp_path.iterdir()) == [reference_key(
        target.path, PROMPTS, max_new_tokens=8, temperature=0.0, seed=0, chat=True
    )]  # no partial or temporary folder left behind
    assert json.loads(first.info.description)["draftsmith_reference"]["chat"] is True

    again = reference_continuations(target, PROMPTS, max_new_tokens=8, cache_root=tmp_path, progress=False)
    assert calls.n == len(PROMPTS)  # nothing generated the second time
    assert again.to_list() == first.to_list()


def test_resume_after_interruption_equals_uninterrupted_run(target, tmp_path, calls) -> None:
    whole = reference_continuations(target, PROMPTS, max_new_tokens=8, cache_root=tmp_path / "a", progress=False)
    calls.reset(fail_after=2)
    with pytest.raises(Interrupted):
        reference_continuations(target, PROMPTS, max_new_tokens=8, cache_root=tmp_path / "b", progress=False)
    [partial] = (tmp_path / "b").iterdir()
    assert partial.name.endswith(".partial")
    part = partial / "rows.jsonl"
    assert len(part.read_text().splitlines()) == 2
    with part.open("a") as f:
        f.write('{"index": 2, "id": "2", "dom')  # a row torn by the interruption

    calls.reset(fail_after=2)  # interrupted again, two prompts further on
    with pytest.raises(Interrupted):
        reference_continuations(target, PROMPTS, max_new_tokens=8, cache_root=tmp_path / "b", progress=False)
    assert len(part.read_text().splitlines()) == 4

    calls.reset()
    resumed = reference_continuations(target, PROMPTS, max_new_tokens=8, cache_root=tmp_path / "b", progress=False)
    assert calls.n == 2  # only the last two prompts
    assert resumed.to_list() == whole.to_list()
    assert [r["id"] for r in resumed] == [p.id for p in PROMPTS]


def test_speculative_reference_equals_target_alone(target, tmp_path, calls) -> None:
    draft = tiny_loaded(1, tmp_path / "draft", layers=1)
    alone = reference_continuations(target, PROMPTS, max_new_tokens=12, cache_root=tmp_path / "a", progress=False)
    fast = reference_continuations(
        target, PROMPTS, max_new_tokens=12, draft=draft, cache_root=tmp_path / "b", progress=False
    )
    assert calls.drafted  # the second run did decode speculatively (int8 draft)
    assert fast.to_list() == alone.to_list()
    assert sum(len(r["continuation_ids"]) for r in alone) > 2 * len(PROMPTS)  # not just immediate EOS


def test_draft_with_another_tokenizer_is_refused(target, tmp_path) -> None:
    draft = tiny_loaded(1, tmp_path / "draft", layers=1)
    draft.tokenizer = helpers.word_tokenizer(["a", "[UNK]"], eos=None)
    with pytest.raises(DraftsmithError, match="different tokenizers"):
        reference_continuations(target, PROMPTS, max_new_tokens=4, draft=draft, cache_root=tmp_path, progress=False)


def test_sampled_rows_come_from_a_per_prompt_generator(target, tmp_path, calls) -> None:
    kw = dict(max_new_tokens=10, temperature=1.5, progress=False)
    first = reference_continuations(target, PROMPTS, seed=7, cache_root=tmp_path / "a", **kw)
    other = reference_continuations(target, PROMPTS, seed=8, cache_root=tmp_path / "b", **kw)
    assert other.to_list() != first.to_list()
    # prompt i draws from its own generator, seeded from (seed, i): a resumed run samples the same rows
    calls.reset(fail_after=3)
    with pytest.raises(Interrupted):
        reference_continuations(target, PROMPTS, seed=7, cache_root=tmp_path / "c", **kw)
    calls.reset()
    resumed = reference_continuations(target, PROMPTS, seed=7, cache_root=tmp_path / "c", **kw)
    assert resumed.to_list() == first.to_list()
    runner = make_runner(target.model, 64)
    for i, row in enumerate(first):
        gen = torch.Generator().manual_seed(prompt_seed(7, i))
        out = generate(runner, row["prompt_ids"], max_new_tokens=10, sampling=SamplingParams(1.5), eos_ids=[EOS],
                       generator=gen)
        assert out.tokens == row["continuation_ids"]


def test_key_covers_settings_but_not_the_seed_when_greedy(target) -> None:
    base = dict(max_new_tokens=8, temperature=0.0, seed=0, chat=True)
    key = reference_key(target.path, PROMPTS, **base)
    assert reference_key(target.path, PROMPTS, **{**base, "seed": 5}) == key
    for change in ({"max_new_tokens": 9}, {"temperature": 0.5}, {"chat": False}):
        assert reference_key(target.path, PROMPTS, **{**base, **change}) != key
    assert reference_key(target.path, PROMPTS[:-1], **base) != key
    edited = [Prompt(p.id, p.domain, p.prompt + " w1") if i == 0 else p for i, p in enumerate(PROMPTS)]
    assert reference_key(target.path, edited, **base) != key


def test_user_errors(target, tmp_path) -> None:
    with pytest.raises(DraftsmithError, match="no prompts"):
        reference_continuations(target, [], cache_root=tmp_path, progress=False)
    with pytest.raises(DraftsmithError, match="max_new_tokens"):
        reference_continuations(target, PROMPTS, max_new_tokens=0, cache_root=tmp_path, progress=False)
    with pytest.raises(DraftsmithError, match="positions"):
        reference_continuations(target, PROMPTS, max_new_tokens=300, cache_root=tmp_path, progress=False)
