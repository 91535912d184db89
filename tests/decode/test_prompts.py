"""Built-in prompt suites and the loader: suite names, jsonl/json/csv/parquet files, save_to_disk folders."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.prompts import SUITES, Prompt, chat_messages, load_prompts, load_suite, suite_path


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _sample() -> list[Prompt]:
    """A few prompts from every suite: code blocks, quotes, commas, newlines and non-ASCII text."""
    return [p for name in SUITES for p in load_suite(name)[:3]]


def _rows(prompts: list[Prompt]) -> list[dict]:
    return [dataclasses.asdict(p) for p in prompts]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _error(source, **kwargs) -> str:
    with pytest.raises(DraftsmithError) as info:
        load_prompts(source, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message, f"error should be one line: {message!r}"
    return message


# ---- built-in suites ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SUITES)
def test_suite_is_well_formed(name: str) -> None:
    assert suite_path(name).is_file()
    prompts = load_suite(name)
    assert len(prompts) >= 30
    ids = [p.id for p in prompts]
    assert len(set(ids)) == len(ids)
    # the first test split (`NAME-test-NN`, spent) closes each dev file under its own ids
    assert all(re.fullmatch(rf"{name}-(\d{{3}}|test-\d{{2}})", i) for i in ids)
    assert {p.domain for p in prompts} == {name}
    assert all(isinstance(p.prompt, str) and p.prompt.strip() == p.prompt and p.prompt for p in prompts)
    texts = [_norm(p.prompt) for p in prompts]
    assert len(set(texts)) == len(texts), "duplicate prompt text"


def test_suites_do_not_share_prompts_or_ids() -> None:
    prompts = [p for name in SUITES for p in load_suite(name)]
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({_norm(p.prompt) for p in prompts}) == len(prompts)


def test_suite_files_are_plain_jsonl_with_three_keys() -> None:
    for name in SUITES:
        for line in suite_path(name).read_text(encoding="utf-8").splitlines():
            assert set(json.loads(line)) == {"id", "domain", "prompt"}


def test_default_benchmark_prompts_are_short_coding_tasks() -> None:
    first = load_suite("code")[:4]
    assert all(len(p.prompt) < 250 and p.prompt.startswith("Write") for p in first)


def test_prompt_is_frozen_and_chat_messages() -> None:
    p = load_suite("chat")[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.prompt = "changed"  # type: ignore[misc]
    assert chat_messages(p) == [{"role": "user", "content": p.prompt}]


# ---- suite names -------------------------------------------------------------------------------


def test_comma_separated_suites_keep_order() -> None:
    expected = load_suite("code") + load_suite("chat")
    assert load_prompts("code,chat") == expected
    assert load_prompts(" code , chat ,") == expected
    assert load_prompts("code,chat,code") == expected  # repeated names load once


def test_single_suite_name() -> None:
    assert load_prompts("summarize") == load_suite("summarize")


def test_suite_name_wins_over_same_named_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "code").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_prompts("code") == load_suite("code")


def test_limit_per_domain_keeps_first_n_in_order() -> None:
    got = load_prompts("code,json", limit_per_domain=2)
    assert got == load_suite("code")[:2] + load_suite("json")[:2]


def test_limit_per_domain_with_interleaved_domains(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "domain": d} for i, d in enumerate("abab" "ab")]
    got = load_prompts(_write_jsonl(tmp_path / "p.jsonl", rows), limit_per_domain=2)
    assert [p.prompt for p in got] == ["q0", "q1", "q2", "q3"]


# ---- files and folders -------------------------------------------------------------------------


def test_jsonl_file_round_trip(tmp_path: Path) -> None:
    expected = _sample()
    path = _write_jsonl(tmp_path / "prompts.jsonl", _rows(expected))
    assert load_prompts(path) == expected
    assert load_prompts(str(path)) == expected


@pytest.mark.parametrize("kind", ["csv", "parquet", "json", "disk", "dict-train", "dict-single"])
def test_datasets_sources_round_trip(tmp_path: Path, kind: str) -> None:
    import datasets
    expected = _sample()
    ds = datasets.Dataset.from_list(_rows(expected))
    if kind == "csv":
        source = tmp_path / "prompts.csv"
        ds.to_csv(str(source), index=False)
    elif kind == "parquet":
        source = tmp_path / "prompts.parquet"
        ds.to_parquet(str(source))
    elif kind == "json":
        source = tmp_path / "prompts.json"
        source.write_text(json.dumps(_rows(expected), ensure_ascii=False), encoding="utf-8")  # a JSON array
    elif kind == "disk":
        source = tmp_path / "saved"
        ds.save_to_disk(str(source))
    elif kind == "dict-train":
        source = tmp_path / "saved"
        other = datasets.Dataset.from_list([{"id": "x", "domain": "x", "prompt": "not me"}])
        datasets.DatasetDict({"validation": other, "train": ds}).save_to_disk(str(source))
    else:
        source = tmp_path / "saved"
        datasets.DatasetDict({"test": ds}).save_to_disk(str(source))
    assert load_prompts(source) == expected
    assert load_prompts(str(source), limit_per_domain=1) == [load_suite(n)[0] for n in SUITES]


def test_missing_domain_and_id_get_defaults(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_text('prompt\n"Hello, there"\nSecond one\n', encoding="utf-8")
    assert load_prompts(path) == [
        Prompt(id="user-0", domain="user", prompt="Hello, there"),
        Prompt(id="user-1", domain="user", prompt="Second one"),
    ]
    rows = [{"prompt": "a", "domain": "qa"}, {"prompt": "b", "domain": "qa", "id": 7}, {"prompt": "c"}]
    got = load_prompts(_write_jsonl(tmp_path / "p.jsonl", rows))
    assert [(p.id, p.domain) for p in got] == [("qa-0", "qa"), ("7", "qa"), ("user-2", "user")]


def test_blank_lines_in_jsonl_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n   \n{"prompt": "b"}\n', encoding="utf-8")
    assert [p.prompt for p in load_prompts(path)] == ["a", "b"]


# ---- errors ------------------------------------------------------------------------------------


def test_unknown_suite_lists_suites() -> None:
    for source in ("poetry", "code,poetry"):
        message = _error(source)
        assert "'poetry'" in message and all(name in message for name in SUITES)
    with pytest.raises(DraftsmithError, match="code, json, summarize, chat"):
        load_suite("poetry")
    with pytest.raises(DraftsmithError, match="poetry"):
        suite_path("poetry")


def test_empty_source() -> None:
    assert "no prompt source" in _error("")
    assert "no prompt source" in _error(" , ")


def test_missing_file_is_named(tmp_path: Path) -> None:
    for name in ("nope.jsonl", "nope.csv", "nope.parquet", "nope"):
        path = tmp_path / name
        message = _error(path)
        assert "not found" in message and str(path) in message
        assert str(path) in _error(str(path))


def test_no_prompt_column_lists_columns(tmp_path: Path) -> None:
    csv = tmp_path / "p.csv"
    csv.write_text("question,answer\nwhy?,because\n", encoding="utf-8")
    message = _error(csv)
    assert str(csv) in message and "'prompt'" in message and "question, answer" in message

    jsonl = _write_jsonl(tmp_path / "p.jsonl", [{"text": "hi", "label": 1}])
    message = _error(jsonl)
    assert str(jsonl) in message and "line 1" in message and "text, label" in message


def test_no_prompt_column_in_saved_dataset(tmp_path: Path) -> None:
    import datasets
    datasets.Dataset.from_list([{"text": "hi"}]).save_to_disk(str(tmp_path / "saved"))
    message = _error(tmp_path / "saved")
    assert "'prompt'" in message and "text" in message


def test_empty_prompt(tmp_path: Path) -> None:
    jsonl = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, {"prompt": "   "}])
    message = _error(jsonl)
    assert str(jsonl) in message and "line 2" in message and "empty prompt" in message

    csv = tmp_path / "p.csv"
    csv.write_text("prompt,domain\nfine,a\n,b\n", encoding="utf-8")
    message = _error(csv)
    assert str(csv) in message and "row 2" in message and "empty prompt" in message

    null = _write_jsonl(tmp_path / "null.jsonl", [{"prompt": None}])
    assert "empty prompt" in _error(null)


def test_non_text_prompt(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": 42}])
    assert "not text" in _error(path)


def test_malformed_json_line_gives_line_number(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": "broken"\n', encoding="utf-8")
    message = _error(path)
    assert str(path) in message and "line 3" in message and "malformed JSON" in message

    path.write_text('{"prompt": "ok"}\n["a list"]\n', encoding="utf-8")
    assert "line 2" in _error(path) and "JSON object" in _error(path)


def test_malformed_json_and_csv_via_datasets(tmp_path: Path) -> None:
    import datasets  # noqa: F401
    path = tmp_path / "p.json"
    path.write_text('[{"prompt": "a"}, {"prompt": ', encoding="utf-8")
    message = _error(path)
    assert str(path) in message and "cannot read" in message


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n", encoding="utf-8")
    assert "no prompts" in _error(path)


def test_duplicate_ids(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    message = _error(path)
    assert "duplicate id 'a'" in message and "line 2" in message


def test_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("hello\n", encoding="utf-8")
    message = _error(path)
    assert str(path) in message and ".txt" in message and ".jsonl" in message


def test_folder_that_is_not_a_dataset(tmp_path: Path) -> None:
    import datasets  # noqa: F401
    (tmp_path / "junk").mkdir()
    message = _error(tmp_path / "junk")
    assert str(tmp_path / "junk") in message and "save_to_disk" in message


def test_dataset_dict_without_train_split(tmp_path: Path) -> None:
    import datasets
    ds = datasets.Dataset.from_list([{"prompt": "x"}])
    datasets.DatasetDict({"test": ds, "validation": ds}).save_to_disk(str(tmp_path / "saved"))
    message = _error(tmp_path / "saved")
    assert "train" in message and "test" in message and "validation" in message


@pytest.mark.parametrize("limit", [0, -1])
def test_bad_limit(limit: int) -> None:
    assert "limit_per_domain" in _error("code", limit_per_domain=limit)


def test_built_in_suites_have_a_disjoint_test_split() -> None:
    from draftsmith.decode.prompts import SUITES, load_prompts, load_test_prompts, load_suite

    test = load_test_prompts(",".join(SUITES))
    sizes = {"code": 16, "chat": 16, "json": 8, "summarize": 8}  # the second split (t2), written 2026-12-06
    assert [p.domain for p in test] == [d for d in SUITES for _ in range(sizes[d])]
    assert len({p.id for p in test}) == len(test)
    for name in SUITES:
        suite = load_suite(name)
        assert not {p.id for p in suite} & {p.id for p in test}
        assert not {p.prompt for p in suite} & {p.prompt for p in test}  # never trained on, never chosen on
    assert load_test_prompts("code,chat") == [p for p in test if p.domain in ("code", "chat")]
    assert load_test_prompts(Path("some.jsonl")) == [] and load_test_prompts("prompts.jsonl") == []
    assert not {p.id for p in load_prompts(",".join(SUITES))} & {p.id for p in test}


def test_first_per_domain_after_skipping_some_of_each() -> None:
    from draftsmith.decode.prompts import first_per_domain

    ps = [Prompt(f"{d}-{i}", d, f"{d} {i}") for i in range(1, 6) for d in ("a", "b")]  # interleaved domains
    assert [p.id for p in first_per_domain(ps, 2)] == ["a-1", "b-1", "a-2", "b-2"]
    assert [p.id for p in first_per_domain(ps, 2, skip=3)] == ["a-4", "b-4", "a-5", "b-5"]
    assert first_per_domain(ps, 2, skip=5) == []
