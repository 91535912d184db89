"""Distillation data: each source yields what its model decodes (batched or alone, the same tokens; on-policy rows
in the draft's int4 copy are that copy's), a run resumes without losing or repeating a row, "mixed" takes a seeded,
exact fraction from the draft, a folder is refused to another writer, and a finished folder is loaded, not
regenerated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import draftsmith.distill.data as data_mod
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.decode.prompts import Prompt
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.speculative import generate
from draftsmith.distill.data import draft_prompts, generate_batch, generate_data
from draftsmith.pairing.reference import prompt_seed
from tests import helpers

WORDS = [f"w{i}" for i in range(40)]
EOS = len(WORDS)  # <eos>; [UNK] (41) lies outside the models' rows


def tiny_loaded(seed: int, folder: Path, layers: int = 2, dtype: torch.dtype = torch.float32) -> Loaded:
    """A random Llama over WORDS + <eos> with its config saved in `folder`; peaky logits so text varies."""
    return helpers.tiny_loaded(seed, folder, helpers.word_tokenizer([*WORDS, "<eos>", "[UNK]"], eos="<eos>"),
                               eos_id=EOS, layers=layers, dtype=dtype)


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
    """Counts the rows the decoders produce (one at a time, speculative or not, and in batches); raises
    instead of decoding once `fail_after` rows are done."""

    def __init__(self) -> None:
        self.reset()

    def one(self, *args, **kwargs):
        self._count(1)
        self.speculative += kwargs.get("draft") is not None
        return generate(*args, **kwargs)

    def batch(self, model, prompts, **kwargs):
        self._count(len(prompts))
        self.batches += 1
        return generate_batch(model, prompts, **kwargs)

    def _count(self, rows: int) -> None:
        if self.fail_after is not None and self.n + rows > self.fail_after:
            raise Interrupted
        self.n += rows

    def reset(self, fail_after: int | None = None) -> None:
        self.n, self.fail_after, self.speculative, self.batches = 0, fail_after, 0, 0


@pytest.fixture
def calls(monkeypatch) -> Calls:
    counter = Calls()
    monkeypatch.setattr(data_mod, "generate", counter.one)
    monkeypatch.setattr(data_mod, "generate_batch", counter.batch)
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
            assert row["continuation_ids"] == _alone(who, row, 0.0, 0, i)  # speculative / batched == alone
    assert greedy["target"]["continuation_ids"] != greedy["draft"]["continuation_ids"]
    assert sum(len(c) for c in greedy["target"]["continuation_ids"]) > 2 * len(PROMPTS)  # not just EOS

    calls.reset()
    sampled = generate_data(target, draft, PROMPTS, tmp_path / "t1", source="target", max_new_tokens=8,
                            temperature=1.0, seed=3, speculative=True, progress=False)
    assert calls.speculative == len(PROMPTS)  # target text comes from the speculative decoder
    on_policy = generate_data(target, draft, PROMPTS, tmp_path / "d1", source="draft", max_new_tokens=8,
                              temperature=1.0, seed=3, progress=False)
    for i, row in enumerate(on_policy):  # the draft alone, full precision, one generator per prompt
        assert row["continuation_ids"] == _alone(draft, row, 1.0, 3, i)
    again = generate_data(target, draft, PROMPTS, tmp_path / "t2", source="target", max_new_tokens=8,
                          temperature=1.0, seed=3, speculative=True, progress=False)
    assert again.to_list() == sampled.to_list()
    assert all(1 <= len(c) <= 8 and max(c) <= EOS for c in sampled["continuation_ids"])


@pytest.mark.parametrize("batch_size", [1, 4])
def test_resume_after_interruption_equals_uninterrupted_run(pair, tmp_path, calls, batch_size) -> None:
    target, draft = pair
    kw = dict(source="mixed", mix=0.5, max_new_tokens=8, temperature=1.0, seed=5, progress=False,
              batch_size=batch_size)
    whole = generate_data(target, draft, PROMPTS, tmp_path / "a", **kw)
    calls.reset(fail_after=2)
    with pytest.raises(Interrupted):
        generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)
    part = tmp_path / "b" / data_mod.PARTIAL
    saved = 2 // batch_size * batch_size  # rows are saved a whole batch at a time
    assert len(part.read_text().splitlines()) == saved and not (tmp_path / "b" / "dataset").exists()
    with part.open("a") as f:
        f.write(f'{{"index": {saved}, "id": "{saved}", "dom')  # a row torn by the interruption
    calls.reset(fail_after=batch_size)
    with pytest.raises(Interrupted):
        generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)
    saved += batch_size
    assert len(part.read_text().splitlines()) == saved

    calls.reset()
    resumed = generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)
    assert calls.n == len(PROMPTS) - saved  # only the prompts not yet saved
    assert resumed.to_list() == whole.to_list()
    assert [r["id"] for r in resumed] == [p.id for p in PROMPTS]  # none lost, none twice
    assert not part.exists()

    calls.reset()
    loaded = generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)  # finished: loaded, not regenerated
    assert calls.n == 0 and loaded.to_list() == whole.to_list()
    with pytest.raises(DraftsmithError, match="other settings.*seed"):
        generate_data(target, draft, PROMPTS, tmp_path / "b", **{**kw, "seed": 6})
    other_batch = generate_data(target, draft, PROMPTS, tmp_path / "c", **{**kw, "batch_size": 3})
    assert other_batch.to_list() == whole.to_list()  # the batch size never changes a row


def test_batched_rows_equal_rows_decoded_alone(pair, tmp_path, calls) -> None:
    """Left padding, per-row generators and finished rows leaving the batch change no token."""
    target, draft = pair
    prompts = make_prompts(10)  # 1 to 4 tokens: every batch is padded
    for source, temperature in (("target", 0.0), ("target", 1.5), ("draft", 0.0), ("draft", 1.5)):
        kw = dict(source=source, max_new_tokens=24, temperature=temperature, seed=2, speculative=False,
                  progress=False)
        calls.reset()
        alone = generate_data(target, draft, prompts, tmp_path / f"{source}{temperature}-1", batch_size=1, **kw)
        assert calls.batches == 0 and calls.speculative == 0 and calls.n == 10
        calls.reset()
        batched = generate_data(target, draft, prompts, tmp_path / f"{source}{temperature}-4", batch_size=4, **kw)
        assert calls.batches == 3 and calls.speculative == 0 and calls.n == 10
        assert batched.to_list() == alone.to_list(), (source, temperature)
        if temperature > 0:  # some rows stopped at EOS while others went on
            lengths = [len(c) for c in batched["continuation_ids"]]
            assert min(lengths) < 24 == max(lengths)
    with pytest.raises(DraftsmithError, match="batch_size"):
        generate_data(target, draft, prompts, tmp_path / "e", batch_size=0, progress=False)


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


def test_plain_and_speculative_sampled_folders_are_not_mixed(pair, tmp_path) -> None:
    """At temperature > 0 a seed gives other target text through the speculative decoder than plainly, so a
    folder records which; a folder from before the key existed is still accepted."""
    target, draft = pair
    kw = dict(source="target", max_new_tokens=6, temperature=1.0, seed=1, progress=False)
    spec = generate_data(target, draft, PROMPTS, tmp_path / "s", speculative=True, **kw)
    with pytest.raises(DraftsmithError, match="other settings.*speculative"):
        generate_data(target, draft, PROMPTS, tmp_path / "s", speculative=False, **kw)
    settings = json.loads((tmp_path / "s" / data_mod.SETTINGS).read_text())
    assert settings["speculative"] is True
    del settings["speculative"]  # as an older draftsmith wrote it
    (tmp_path / "s" / data_mod.SETTINGS).write_text(json.dumps(settings))
    assert generate_data(target, draft, PROMPTS, tmp_path / "s", speculative=True, **kw).to_list() == spec.to_list()
    settings["unknown_key"] = 1  # a key this draftsmith does not write: made by something else, refused
    (tmp_path / "s" / data_mod.SETTINGS).write_text(json.dumps(settings))
    with pytest.raises(DraftsmithError, match="unknown_key"):
        generate_data(target, draft, PROMPTS, tmp_path / "s", speculative=True, **kw)
    greedy = generate_data(target, draft, PROMPTS, tmp_path / "g", **{**kw, "temperature": 0.0})
    assert json.loads((tmp_path / "g" / data_mod.SETTINGS).read_text())["speculative"] is None  # same text
    assert generate_data(target, draft, PROMPTS, tmp_path / "g", speculative=False,
                         **{**kw, "temperature": 0.0}).to_list() == greedy.to_list()


def test_a_data_folder_is_read_back_for_its_target_only(pair, tmp_path) -> None:
    import datasets

    from draftsmith.distill.data import load_data_folder, training_rows

    target, draft = pair
    ds = generate_data(target, draft, PROMPTS, tmp_path / "d", max_new_tokens=4, temperature=0.0, progress=False)
    got = load_data_folder(tmp_path / "d", target)
    assert got.to_list() == ds.to_list() and training_rows(got) == training_rows(ds)
    assert load_data_folder(tmp_path / "d" / "dataset", target).to_list() == ds.to_list()  # the dataset itself
    with pytest.raises(DraftsmithError, match="another target"):
        load_data_folder(tmp_path / "d", draft)
    with pytest.raises(DraftsmithError, match="cannot read training data"):
        load_data_folder(tmp_path / "nowhere", target)
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(DraftsmithError, match="lacks column"):
        load_data_folder(tmp_path / "plain", target)


def test_engine_vllm_is_a_one_line_error_where_vllm_is_absent(pair, tmp_path, monkeypatch) -> None:
    import sys

    target, draft = pair
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(DraftsmithError, match="vllm is not installed here"):
        generate_data(target, draft, PROMPTS, tmp_path / "v", source="target", engine="vllm", progress=False)
    with pytest.raises(DraftsmithError, match="drop speculative"):
        generate_data(target, draft, PROMPTS, tmp_path / "v", engine="vllm", speculative=True, progress=False)


def test_engine_vllm_rows_and_top_k_land_where_hf_rows_do(pair, tmp_path, monkeypatch) -> None:
    """vLLM's API stood in by a fake module (vLLM itself does not install here; the next test runs it where it
    does): one request per target row with that row's seed and the EOS ids, the tokens become the rows, the top-k
    of each position lands in the teacher cache's input sorted by log-prob, and on-policy rows stay the draft's."""
    import sys
    import types

    seen = []

    class Logprob:
        def __init__(self, logprob: float) -> None:
            self.logprob = logprob

    class LLM:
        def __init__(self, model: str, tokenizer: str, seed: int) -> None:
            assert model == str(pair[0].path)

        def generate(self, prompts, params, use_tqdm=False):
            out = []
            for p, sp in zip(prompts, params):
                seen.append((p["prompt_token_ids"], sp.seed, sp.stop_token_ids, sp.logprobs, sp.max_tokens))
                toks = [3 + sp.seed % 5, 4, EOS]
                lps = [{t: Logprob(-0.1), 1: Logprob(-3.0), 2: Logprob(-2.0)} for t in toks]
                out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=toks, logprobs=lps)]))
            return out

    def sampling(**kw):
        return types.SimpleNamespace(**kw)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=sampling))
    target, draft = pair
    ds = generate_data(target, draft, PROMPTS, tmp_path / "v", source="mixed", mix=0.5, temperature=1.0, seed=3,
                       engine="vllm", batch_size=4, topk=2, progress=False)
    on_policy = draft_prompts(len(PROMPTS), "mixed", 0.5, 3)
    for i, row in enumerate(ds):
        if i in on_policy:
            assert row["source"] == "draft"
        else:
            assert row["source"] == "target" and row["continuation_ids"] == [3 + prompt_seed(3, i) % 5, 4, EOS]
    assert sorted(s for _, s, _, _, _ in seen) == sorted(prompt_seed(3, i) for i in range(len(PROMPTS))
                                                         if i not in on_policy)
    assert all(stop == [EOS] and k == 2 and n == 64 for _, _, stop, k, n in seen)
    assert json.loads((tmp_path / "v" / "settings.json").read_text())["engine"] == "vllm"
    ds = generate_data(target, draft, PROMPTS, tmp_path / "t", source="target", temperature=1.0, seed=3,
                       engine="vllm", batch_size=4, topk=2, progress=False)
    values, indices = data_mod.captured_topk(tmp_path / "t", len(ds))
    for row, v, ix in zip(ds, values, indices):
        assert v.tolist() == [[pytest.approx(-0.1), pytest.approx(-2.0)]] * 3
        assert ix.tolist() == [[t, 2] for t in row["continuation_ids"]]


def test_engine_vllm_for_real(pair, tmp_path) -> None:
    """Where vLLM imports (a CUDA machine): the tiny target's rows come from vLLM, EOS-terminated or full length."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a GPU")
    target, draft = pair
    ds = generate_data(target, draft, PROMPTS, tmp_path / "real", source="target", engine="vllm", progress=False)
    assert len(ds) == len(PROMPTS) and all(1 <= len(c) <= 8 for c in ds["continuation_ids"])


def _needs_int4() -> None:
    from draftsmith.decode.runtime import native
    from draftsmith.decode.runtime.quant import int4_ok

    if not int4_ok():
        pytest.skip(f"no draftsmith int4 kernel here: {native.why_not()}")


def _alone_int4(draft: Loaded, row: dict, seed: int, index: int, n: int) -> list[int]:
    """What the draft's int4 copy (the decoder's `quantize="int4"` runner) decodes alone for a row's prompt."""
    gen = torch.Generator().manual_seed(prompt_seed(seed, index))
    return generate(make_runner(draft.model, 64, quantize="int4"), row["prompt_ids"], max_new_tokens=n,
                    sampling=SamplingParams(1.0), eos_ids=[EOS], generator=gen).tokens


def test_on_policy_rows_from_the_int4_copy_are_its_own_at_every_batch_size(pair, tmp_path, calls) -> None:
    """draft_quant="int4": every on-policy row is what the draft's int4 copy samples for it alone (batched or one at a
    time: the same rows), the target's rows of a mixed folder are untouched, and settings.json names the writer."""
    _needs_int4()
    target, draft = pair
    prompts = make_prompts(10)
    kw = dict(source="draft", max_new_tokens=12, temperature=1.0, seed=4, progress=False, draft_quant="int4")
    batched = generate_data(target, draft, prompts, tmp_path / "b4", batch_size=4, **kw)
    assert calls.batches == 3 and calls.speculative == 0
    for i, row in enumerate(batched):
        assert row["source"] == "draft" and row["continuation_ids"] == _alone_int4(draft, row, 4, i, 12)
    lengths = [len(c) for c in batched["continuation_ids"]]
    assert min(lengths) < 12 == max(lengths)  # rows left the batch at different steps
    assert generate_data(target, draft, prompts, tmp_path / "b1", batch_size=1, **kw).to_list() == batched.to_list()
    assert json.loads((tmp_path / "b4" / data_mod.SETTINGS).read_text())["draft_quant"] == "int4"
    float_rows = generate_data(target, draft, prompts, tmp_path / "f", batch_size=4, **{**kw, "draft_quant": None})
    assert "draft_quant" not in json.loads((tmp_path / "f" / data_mod.SETTINGS).read_text())  # as before the key
    assert float_rows["continuation_ids"] != batched["continuation_ids"]  # the int4 copy wrote, not the draft
    mixed = generate_data(target, draft, prompts, tmp_path / "m", source="mixed", mix=0.5, max_new_tokens=12,
                          temperature=1.0, seed=4, batch_size=4, progress=False, draft_quant="int4")
    for i, row in enumerate(mixed):
        if row["source"] == "draft":
            assert row["continuation_ids"] == batched[i]["continuation_ids"]
        else:
            assert row["continuation_ids"] == _alone(target, row, 1.0, 4, i, n=12)
    target_only = generate_data(target, draft, prompts, tmp_path / "t", source="target", max_new_tokens=4,
                                temperature=1.0, seed=4, progress=False, draft_quant="int4")
    assert "draft_quant" not in json.loads((tmp_path / "t" / data_mod.SETTINGS).read_text())  # no on-policy rows
    assert len(target_only) == 10


def test_an_int4_writers_run_resumes_to_the_same_rows(pair, tmp_path, calls) -> None:
    _needs_int4()
    target, draft = pair
    kw = dict(source="draft", max_new_tokens=10, temperature=1.0, seed=6, progress=False, batch_size=2,
              draft_quant="int4")
    whole = generate_data(target, draft, PROMPTS, tmp_path / "a", **kw)
    calls.reset(fail_after=3)
    with pytest.raises(Interrupted):
        generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)
    assert len((tmp_path / "b" / data_mod.PARTIAL).read_text().splitlines()) == 2
    calls.reset()
    resumed = generate_data(target, draft, PROMPTS, tmp_path / "b", **kw)
    assert calls.n == len(PROMPTS) - 2 and resumed.to_list() == whole.to_list()


def test_a_folder_is_refused_to_another_writer(pair, tmp_path, calls) -> None:
    """A folder written by one copy of the draft is refused to another (float, int8, int4, another calibration),
    including a folder from before the key existed (its on-policy rows came from the draft as loaded); one line."""
    from draftsmith.decode.runtime.quant import write_calib

    _needs_int4()
    target, draft = pair
    kw = dict(source="draft", max_new_tokens=4, temperature=1.0, seed=1, progress=False)
    calls.reset(fail_after=0)  # nothing is generated: the settings alone decide
    for made, rerun in ((None, "int4"), ("int4", None), ("int4", "int8"), ("int8", "int4")):
        folder = tmp_path / f"{made}-{rerun}"
        folder.mkdir()
        settings = data_mod._settings(target, draft, PROMPTS, "draft", 0.5, 4, 1.0, 1, True, False)
        (folder / data_mod.SETTINGS).write_text(json.dumps({**settings, **({"draft_quant": made} if made else {})}))
        with pytest.raises(DraftsmithError, match="other settings.*draft_quant") as e:
            generate_data(target, draft, PROMPTS, folder, draft_quant=rerun, **kw)
        assert "\n" not in str(e.value)
    calib = write_calib(tmp_path / "calib.json", [[1, 2, 3, 4, 5, 6]])
    (tmp_path / "c").mkdir()
    settings = data_mod._settings(target, draft, PROMPTS, "draft", 0.5, 4, 1.0, 1, True, False)
    (tmp_path / "c" / data_mod.SETTINGS).write_text(json.dumps({**settings, "draft_quant": "int4"}))
    with pytest.raises(DraftsmithError, match="other settings.*draft_calib"):
        generate_data(target, draft, PROMPTS, tmp_path / "c", draft_quant="int4", draft_calib=calib, **kw)
    for bad, match in (({"draft_quant": "int3"}, "draft_quant"), ({"draft_calib": calib}, "calibration")):
        with pytest.raises(DraftsmithError, match=match):
            generate_data(target, draft, PROMPTS, tmp_path / "x", **{**kw, **bad})


def test_a_calibrated_int4_writer_is_the_gptq_copy(pair, tmp_path, monkeypatch) -> None:
    """draft_calib: the on-policy rows come from the int4 copy GPTQ-rounded on that file, as `int4:MODEL:calib=FILE`
    would run it; the calibration is part of the settings."""
    from draftsmith.decode.runtime.quant import read_calib, write_calib

    _needs_int4()
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    target, draft = pair
    calib = write_calib(tmp_path / "calib.json", [[(3 * i) % EOS for i in range(40)]])
    ds = generate_data(target, draft, PROMPTS, tmp_path / "d", source="draft", max_new_tokens=8, temperature=1.0,
                       seed=2, progress=False, batch_size=3, draft_quant="int4", draft_calib=calib)
    runner = make_runner(draft.model, 64, quantize="int4", calib=read_calib(calib))
    for i, row in enumerate(ds):
        gen = torch.Generator().manual_seed(prompt_seed(2, i))
        assert row["continuation_ids"] == generate(runner, row["prompt_ids"], max_new_tokens=8,
                                                   sampling=SamplingParams(1.0), eos_ids=[EOS], generator=gen).tokens
    assert json.loads((tmp_path / "d" / data_mod.SETTINGS).read_text())["draft_calib"] == read_calib(calib).key


def test_the_writers_bar_shows_tokens_per_second(pair, tmp_path, capsys) -> None:
    target, draft = pair
    generate_data(target, draft, PROMPTS, tmp_path / "p", source="draft", max_new_tokens=4, temperature=0.0,
                  batch_size=3)
    assert "tokens/s" in capsys.readouterr().err
    stats = data_mod.data_stats(tmp_path / "p")
    assert stats["new_tokens"] > 0 and stats["seconds"] > 0 and stats["setup_seconds"] >= 0
