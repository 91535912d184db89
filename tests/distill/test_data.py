"""Distillation data: each source yields what its model decodes, a run resumes without losing or repeating a
row, "mixed" takes a seeded, exact fraction from the draft, and a finished folder is loaded, not regenerated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

import distill.data as data_mod
from decode.errors import DraftsmithError
from decode.loading import Loaded
from decode.model import make_runner
from decode.prompts import Prompt
from decode.sampling import SamplingParams
from decode.speculative import generate
from distill.data import draft_prompts, generate_data
from pairing.reference import prompt_seed

WORDS = [f"w{i}" for i in range(40)]
EOS = len(WORDS)  # <eos>; [UNK] (41) lies outside the models' rows


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)} | {"<eos>": EOS, "[UNK]": EOS + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]")


def tiny_loaded(seed: int, folder: Path, layers: int = 2, dtype: torch.dtype = torch.float32) -> Loaded:
    """A random Llama with its config saved in `folder` (as a real one has); peaky logits so text varies."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=EOS + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=EOS, pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = EOS
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    return Loaded(model=model, tokenizer=word_tokenizer(), path=folder, name=folder.name)


def make_prompts(n: int) -> list[Prompt]:
    return [Prompt(str(i), ("code", "chat")[i % 2], " ".join(WORDS[(7 * i) % 36 : (7 * i) % 36 + 1 + i % 4]))
            for i in range(n)]


PROMPTS = make_prompts(6)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Loaded, Loaded]:
    root = tmp_path_factory.mktemp("models")
    return tiny_loaded(0, root / "target", layers=2), tiny_loaded(1, root / "draft", layers=1)


class Interrupted(Exception):
    """Stands for Ctrl-C or a killed job in the middle of generation."""


class Calls:
    """Counts the decoder's calls (and which used a proposer); raises once `fail_after` have completed."""

    def __init__(self) -> None:
        self.n, self.fail_after, self.speculative = 0, None, 0

    def __call__(self, *args, **kwargs):
        if self.fail_after is not None and self.n >= self.fail_after:
            raise Interrupted
        self.n += 1
        self.speculative += kwargs.get("draft") is not None
        return generate(*args, **kwargs)

    def reset(self, fail_after: int | None = None) -> None:
        self.n, self.fail_after, self.speculative = 0, fail_after, 0


@pytest.fixture
def calls(monkeypatch) -> Calls:
    counter = Calls()
    monkeypatch.setattr(data_mod, "generate", counter)
    return counter


def _alone(loaded: Loaded, row: dict, temperature: float, seed: int, index: int, n: int = 8) -> list[int]:
    """What `loaded` decodes on its own for a row's prompt."""
    gen = torch.Generator().manual_seed(prompt_seed(seed, index)) if temperature > 0 else None
    return generate(make_runner(loaded.model, 64), row["prompt_ids"], max_new_tokens=n,
                    sampling=SamplingParams(temperature), eos_ids=[EOS], generator=gen).tokens


def test_each_source_decodes_with_its_model(pair, tmp_path, calls) -> None:
    target, draft = pair
    greedy = {s: generate_data(target, draft, PROMPTS, tmp_path / s, source=s, max_new_tokens=8, temperature=0.0,
                               progress=False) for s in ("target", "draft")}
    for source, ds in greedy.items():
        assert ds.column_names == ["id", "domain", "source", "prompt_ids", "continuation_ids"]
        assert [r["id"] for r in ds] == [p.id for p in PROMPTS] and set(ds["source"]) == {source}
        who = target if source == "target" else draft
        for i, (p, row) in enumerate(zip(PROMPTS, ds)):
            assert row["domain"] == p.domain and row["prompt_ids"] == target.tokenizer(p.prompt)["input_ids"]
            assert row["continuation_ids"] == _alone(who, row, 0.0, 0, i)  # speculative == target alone
    assert greedy["target"]["continuation_ids"] != greedy["draft"]["continuation_ids"]
    assert sum(len(c) for c in greedy["target"]["continuation_ids"]) > 2 * len(PROMPTS)  # not just EOS

    calls.reset()
    sampled = generate_data(target, draft, PROMPTS, tmp_path / "t1", source="target", max_new_tokens=8,
                            temperature=1.0, seed=3, progress=False)
    assert calls.speculative == len(PROMPTS)  # target text comes from the speculative decoder
    on_policy = generate_data(target, draft, PROMPTS, tmp_path / "d1", source="draft", max_new_tokens=8,
                              temperature=1.0, seed=3, progress=False)
    for i, row in enumerate(on_policy):  # the draft alone, full precision, one generator per prompt
        assert row["continuation_ids"] == _alone(draft, row, 1.0, 3, i)
    again = generate_data(target, draft, PROMPTS, tmp_path / "t2", source="target", max_new_tokens=8,
                          temperature=1.0, seed=3, progress=False)
    assert again.to_list() == sampled.to_list()
    assert all(1 <= len(c) <= 8 and max(c) <= EOS for c in sampled["continuation_ids"])


def test_resume_after_interruption_equals_uninterrupted_run(pair, tmp_path, calls) -> None:
    target, draft = pair
    kw = dict(source="mixed", mix=0.5, max_new_tokens=8, temperature=1.0, seed=5, progress=False)
    whole = generate_data(target, draft, PROMPTS, tmp_path / "a", **kw)
    calls.reset(fail_after=2)
    with pytest.raises(Interrupted):
        generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)
    part = tmp_path / "b" / data_mod.PARTIAL
    assert len(part.read_text().splitlines()) == 2 and not (tmp_path / "b" / "dataset").exists()
    with part.open("a") as f:
        f.write('{"index": 2, "id": "2", "dom')  # a row torn by the interruption
    calls.reset(fail_after=1)
    with pytest.raises(Interrupted):
        generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)
    assert len(part.read_text().splitlines()) == 3

    calls.reset()
    resumed = generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)
    assert calls.n == 3  # only the prompts not yet saved
    assert resumed.to_list() == whole.to_list()
    assert [r["id"] for r in resumed] == [p.id for p in PROMPTS]  # none lost, none twice
    assert not part.exists()

    calls.reset()
    loaded = generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)  # finished: loaded, not regenerated
    assert calls.n == 0 and loaded.to_list() == whole.to_list()
    with pytest.raises(DraftsmithError, match="other settings.*seed"):
        generate_data(target, draft, PROMPTS, tmp_path / "b", **{**kw, "seed": 6})


def test_mixed_takes_a_seeded_exact_fraction_from_the_draft(pair, tmp_path) -> None:
    target, draft = pair
    prompts = make_prompts(10)
    assert draft_prompts(10, "mixed", 0.3, 0) == draft_prompts(10, "mixed", 0.3, 0)
    assert len(draft_prompts(10, "mixed", 0.3, 0)) == 3
    assert draft_prompts(10, "mixed", 0.3, 0) != draft_prompts(10, "mixed", 0.3, 1)
    assert draft_prompts(10, "mixed", 0.0, 0) == set() and draft_prompts(10, "mixed", 1.0, 0) == set(range(10))
    ds = generate_data(target, draft, prompts, tmp_path / "m", source="mixed", mix=0.3, max_new_tokens=6,
                       temperature=0.0, seed=0, progress=False)
    chosen = draft_prompts(10, "mixed", 0.3, 0)
    assert [r["source"] for r in ds] == ["draft" if i in chosen else "target" for i in range(10)]
    for i, row in enumerate(ds):
        who = draft if row["source"] == "draft" else target
        assert row["continuation_ids"] == _alone(who, row, 0.0, 0, i, n=6)
    info = json.loads(ds.info.description)["draftsmith_distill_data"]
    assert info["source"] == "mixed" and info["mix"] == 0.3


def test_user_errors(pair, tmp_path) -> None:
    target, draft = pair
    for kw, match in (({"source": "teacher"}, "source"), ({"mix": 1.5}, "mix"), ({"max_new_tokens": 0}, "max_new"),
                      ({"temperature": -1.0}, "temperature"), ({"max_new_tokens": 300}, "positions")):
        with pytest.raises(DraftsmithError, match=match):
            generate_data(target, draft, PROMPTS, tmp_path / "e", progress=False, **kw)
    with pytest.raises(DraftsmithError, match="no prompts"):
        generate_data(target, draft, [], tmp_path / "e", progress=False)
