"""Runtime settings: one object the runtime reads; the CLI maps the environment onto it, and only the CLI reads
the runtime's variables."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.settings import RuntimeSettings, configure, current, using
from draftsmith.recipes.cli import ENVIRONMENT, settings_from_env

ROOT = Path(__file__).resolve().parents[3]


def test_settings_round_trip_and_bad_values_are_one_line_errors() -> None:
    s = RuntimeSettings(linear="xw", native=False, q4_ahead=2048, rows=False, malloc="system", threads=2)
    assert RuntimeSettings.from_dict(s.to_dict()) == s
    for bad in ({"linear": "fast"}, {"malloc": "jemalloc"}, {"q4_ahead": -1}, {"q4_ahead": 1 << 21},
                {"threads": 0}):
        with pytest.raises(DraftsmithError):
            RuntimeSettings(**bad)
    with pytest.raises(DraftsmithError, match="unknown runtime setting 'speed'"):
        RuntimeSettings.from_dict({"speed": 2})


def test_using_restores_the_settings_it_replaced() -> None:
    before = current()
    with using(RuntimeSettings(native=False)):
        assert current().native is False
    assert current() == before
    old = configure(RuntimeSettings(rows=False))
    assert old == before and current().rows is False
    configure(old)


def test_the_environment_maps_onto_settings() -> None:
    assert settings_from_env({}) == RuntimeSettings()
    env = {"DRAFTSMITH_LINEAR": "dnn", "DRAFTSMITH_NATIVE": "off", "DRAFTSMITH_Q4_AHEAD": "4096",
           "DRAFTSMITH_ROWS": "off", "DRAFTSMITH_MALLOC": "system", "DRAFTSMITH_THREADS": "1", "CXX": "clang++"}
    assert settings_from_env(env) == RuntimeSettings(linear="dnn", native=False, q4_ahead=4096, rows=False,
                                                     malloc="system", threads=1, compiler="clang++")
    assert set(ENVIRONMENT) == set(env)
    for var, value, words in (("DRAFTSMITH_NATIVE", "maybe", "on, auto or off"),
                              ("DRAFTSMITH_Q4_AHEAD", "lots", "whole number"),
                              ("DRAFTSMITH_LINEAR", "fast", "DRAFTSMITH_LINEAR: linear layout")):
        with pytest.raises(DraftsmithError, match=words):
            settings_from_env({var: value})


def test_no_runtime_variable_is_read_outside_the_cli() -> None:
    """`git grep` of DRAFTSMITH_ in the packages' code finds the runtime's variables only in the CLI module; the
    cache's location (DRAFTSMITH_CACHE, like HF_HOME) and the test-only speculators venv are the exceptions."""
    found = subprocess.run(["git", "grep", "-n", "-E", r"environ.*DRAFTSMITH_|getenv\(.DRAFTSMITH_",
                            "--", "decode", "pairing", "distill", "recipes"],
                           cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    outside = [line for line in found if not line.startswith("recipes/cli.py:")
               and not re.search(r"DRAFTSMITH_(CACHE|SPECULATORS_ENV)", line)]
    assert not outside, outside
    assert any("DRAFTSMITH_CACHE" in line for line in found)  # the grep finds what is there: it can fail
