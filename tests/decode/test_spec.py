"""DraftSpec: one typed parse, check and write for every draft kind, and the only module that reads spec prefixes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.spec import DraftSpec, parse_layers, split_specs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text,kind,weights,quant", [
    ("qwen2.5-coder-0.5b-instruct", "model", "qwen2.5-coder-0.5b-instruct", None),
    ("runs/x/best", "model", "runs/x/best", None),
    ("m.gguf", "model", "m.gguf", None),
    ("derive:m:keep=4", "derive", "derive:m:keep=4", None),
    ("derive:m:layers=0-2,5", "derive", "derive:m:layers=0-2,5", None),
    ("int4:m", "int4", "m", "int4"),
    ("int4:derive:m:keep=4", "int4", "derive:m:keep=4", "int4"),
    ("int4:m:calib=c.json", "int4", "m", "int4"),
    ("prune:m:vocab=v.json", "prune", "m", None),
    ("prune:int4:m:calib=c.json:vocab=v.json", "prune", "m", "int4"),
    ("int4:m:lora=runs/x/best-adapter", "int4", "m", "int4"),
    ("int4:derive:m:keep=4:calib=c.json:lora=a", "int4", "derive:m:keep=4", "int4"),
    ("prune:int4:m:calib=c.json:lora=a:vocab=v.json", "prune", "m", "int4"),
    ("prune:derive:m:keep=4:vocab=/a/b.json", "prune", "derive:m:keep=4", None),
    ("head:runs/h/best", "head", None, None),
])
def test_every_kind_parses_to_what_it_loads(text: str, kind: str, weights: str | None, quant: str | None) -> None:
    d = DraftSpec.parse(text)
    assert (d.kind, d.weights, d.quant, str(d)) == (kind, weights, quant, text)
    assert d.decoder_only == (kind in ("int4", "prune")) and d.is_head == (kind == "head")


def test_the_parts_of_a_spec_are_typed() -> None:
    d = DraftSpec.parse("prune:int4:m:calib=c.json:vocab=v.json")
    assert (d.vocab, d.calibration, d.inner.kind, d.inner.calib) == (Path("v.json"), Path("c.json"), "int4",
                                                                       Path("c.json"))
    assert DraftSpec.parse("derive:m:layers=0-2,5").layers == (0, 1, 2, 5)
    assert DraftSpec.parse("derive:m:keep=4").keep == 4 and DraftSpec.parse("head:h").folder == Path("h")
    assert parse_layers("0-3,7") == [0, 1, 2, 3, 7]
    d = DraftSpec.parse("prune:int4:m:calib=c.json:lora=runs/a:vocab=v.json")
    assert (d.adapter, d.calibration, d.inner.lora, d.inner.calib) == (Path("runs/a"), Path("c.json"), Path("runs/a"),
                                                                       Path("c.json"))
    assert DraftSpec.parse("int4:m:calib=c.json").adapter is None and DraftSpec.parse("m").adapter is None


def test_specs_written_by_the_constructors_read_back() -> None:
    assert DraftSpec.int4("m").text == "int4:m" and DraftSpec.int4("m", "c.json").text == "int4:m:calib=c.json"
    spec = DraftSpec.pruned(DraftSpec.int4("m", "c.json"), "v.json")
    assert spec == DraftSpec.parse("prune:int4:m:calib=c.json:vocab=v.json")
    assert DraftSpec.head("runs/h").text == "head:runs/h"
    assert DraftSpec.int4("m", lora="a").text == "int4:m:lora=a"
    spec = DraftSpec.pruned(DraftSpec.int4("m", "c.json", "a"), "v.json")
    assert spec == DraftSpec.parse("prune:int4:m:calib=c.json:lora=a:vocab=v.json")


@pytest.mark.parametrize("text,message", [
    ("", "empty draft spec"),
    ("prune:m", "expected prune:MODEL:vocab=FILE"),
    ("prune:m:vocab=", "expected prune:MODEL:vocab=FILE"),
    ("prune::vocab=f.json", "expected prune:MODEL:vocab=FILE"),
    ("prune:head:h:vocab=f.json", "MODEL must be a standalone model"),
    ("prune:prune:m:vocab=a:vocab=b", "MODEL must be a standalone model"),
    ("m:calib=c.json", "int4:MODEL:calib=FILE"),
    ("prune:m:calib=c.json:vocab=v.json", "int4:MODEL:calib=FILE"),
    ("int4:head:h", "int4 applies to a whole model"),
    ("int4:prune:m:vocab=v", "int4 applies to a whole model"),
    ("derive:m", "expected derive:MODEL:keep=N"),
    ("derive:m:keep=2:layers=1", "not keep and layers"),
    ("derive:m:keep=x", "keep= needs a number"),
    ("derive:m:layers=3-1", "runs backwards"),
    ("derive:int4:m:keep=2", "derive slices a whole model"),
    ("head:", "expected head:FOLDER"),
    ("m:lora=a", "a LoRA adapter applies to an int4 draft"),
    ("int4:m:lora=", "a LoRA adapter applies to an int4 draft"),
    ("int4:m:lora=a:lora=b", "a LoRA adapter applies to an int4 draft, once"),
    ("derive:m:keep=2:lora=a", "a LoRA adapter applies to an int4 draft"),
    ("int4:m:lora=a:calib=c.json", ":lora=FOLDER comes after :calib=FILE"),
    ("prune:int4:m:vocab=v.json:lora=a", ":vocab=FILE comes last"),
])
def test_a_bad_spec_is_one_line_naming_the_form(text: str, message: str) -> None:
    with pytest.raises(DraftsmithError, match=re.escape(message)) as e:
        DraftSpec.parse(text)
    assert "\n" not in str(e.value)


def test_a_folder_that_holds_a_head_is_a_head(tmp_path: Path) -> None:
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.json").write_text(json.dumps({"architectures": ["Eagle3Head"]}))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert DraftSpec.parse(str(tmp_path / "h")).is_head and DraftSpec.parse(str(tmp_path / "m")).kind == "model"
    assert DraftSpec.parse(str(tmp_path / "h"), sniff=False).kind == "model"


def test_check_finds_each_missing_file_and_model(tmp_path: Path) -> None:
    zoo = {"tiny"}
    (tmp_path / "v.json").write_text("{}")
    DraftSpec.parse(f"prune:int4:tiny:vocab={tmp_path / 'v.json'}").check(zoo)
    for text, needle in [(f"prune:tiny:vocab={tmp_path / 'none.json'}", "no kept-vocabulary file"),
                         (f"int4:tiny:calib={tmp_path / 'none.json'}", "no such calibration file"),
                         (f"int4:tiny:lora={tmp_path}", "no LoRA adapter at"),
                         ("int4:derive:nope:keep=2", "unknown model 'nope'"),
                         (f"head:{tmp_path}", "no head at")]:
        with pytest.raises(DraftsmithError, match=needle):
            DraftSpec.parse(text).check(zoo)


def test_split_specs_keeps_derive_layer_lists() -> None:
    assert split_specs("a,derive:m:layers=0,1,2,b") == ["a", "derive:m:layers=0,1,2", "b"]
    assert split_specs("int4:m, prune:int4:m:vocab=v.json") == ["int4:m", "prune:int4:m:vocab=v.json"]


def test_spec_prefixes_are_read_in_one_module_only() -> None:
    """The issue's grep: a prefix test on a draft spec anywhere but decode/spec.py means a second parser."""
    out = subprocess.run(["git", "grep", "-lE", r"startswith\((['\"](int4|prune|head|derive):|[A-Z0-9_]*PREFIX)",
                          "--", "*.py", ":!tests"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert set(out) <= {"decode/spec.py"}, out
