"""The export stage's result, typed: export/export.json read back (and, for a head, written) through one type.

    from draftsmith.distill.export.results import read_export
    exported = read_export(read_json(run / "export" / "export.json"), "export/export.json")  # HeadExport | DraftExport

- `DraftExport`: a standalone draft (`distill.export.export`): the HF folder and GGUF files with the checks that
  loaded each back, llama-server's runs with each GGUF draft (and the un-distilled one) beside the target alone,
  the prediction of its speedup there, the serving lines, warnings;
- `HeadExport`: an EAGLE-3 head (`distill.export.heads.export_head`): the vLLM (speculators) and SGLang folders,
  optionally the GGUF llama.cpp's converter made and llama-server's runs with it at each K, the serving lines,
  and `checks`: what was checked of each folder (`checked` says it in words).
Both answer what the verdict reads (`pairing.validate.EngineCheck`): the prediction, the runs, the serving lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from draftsmith.decode.runtime.records import Part, Record


@dataclass
class LlamaServerRun(Part):
    """llama-server serving the target with one draft (distill.export.llama_cpp.check_with_llama_cpp): accepted /
    drafted, tokens/s and its ratio to the target alone, K (`draft_max`), greedy text equal on how many prompts."""

    speedup_vs_target_only: float | None = None
    draft_max: int | None = None
    accepted: int | None = None
    drafted: int | None = None
    tokens_per_s: float | None = None
    prompts: int | None = None
    greedy_equal: dict | None = None  # {"prompts", "equal"}
    draft: str | None = None  # which draft (the un-distilled one's run names it)


@dataclass
class HeadLlamaCpp(Part):
    """export.json's `llama_cpp` for a head (`check_head_with_llama_cpp`): the target alone's runs and one run
    with the head at each K."""

    NESTED = {"runs": ("map", LlamaServerRun)}

    target_alone_mean_tokens_per_s: float
    target_alone_tokens_per_s: list[float]
    runs: dict[str, LlamaServerRun] = field(default_factory=dict)


@dataclass
class HeadGguf(Part):
    """The head as a GGUF, converted by llama.cpp's own converter from `converter_input`."""

    path: str
    bytes: int | None = None
    converter_input: str | None = None


# What export_head checks of each folder it writes (each passes before it lands: `heads.check_*_contract`; the GGUF
# is then made by llama.cpp's own converter), and how the report says it. Nothing in the export stage loads the
# vLLM or SGLang folder in an engine; a load by an engine's own library would be recorded as "loaded:<library>".
HEAD_CHECKS = {"vllm": ["contract"], "sglang": ["contract"], "gguf": ["contract", "converted"]}
_CONTRACTS = {"vllm": "config and weights, field by field, against the speculators format vLLM reads",
              "sglang": "config and weights, field by field, against SGLang's LlamaForCausalLMEagle3",
              "gguf": "converter input checked field by field"}
_ENGINES = {"vllm": "vLLM or speculators", "sglang": "SGLang"}


@dataclass
class HeadExport(Record):
    """export/export.json of a head: the vLLM (speculators) and SGLang folders, each checked by its contract
    (`checks`; a record from before it was written had the same checks), the serving lines at K, and with a GGUF
    (`gguf`) llama-server's runs (`llama_cpp`) and their prediction (`llama_cpp_prediction`)."""

    NESTED = {"gguf": ("one", HeadGguf), "llama_cpp": ("one", HeadLlamaCpp)}
    OMIT_NONE = frozenset({"gguf", "llama_cpp", "llama_cpp_prediction", "warnings"})

    vllm: str
    sglang: str
    head: str | None = None
    target: str | None = None
    k: int | None = None
    serving: dict[str, str] = field(default_factory=dict)
    checks: dict[str, list[str]] = field(default_factory=dict)
    gguf: HeadGguf | None = None
    llama_cpp: HeadLlamaCpp | None = None
    warnings: list[str] | None = None
    llama_cpp_prediction: dict | None = None

    def checked(self, folder: str) -> str:
        """What was checked of `folder` (vllm | sglang | gguf), in words: its contract, and an engine's load only
        where one was recorded (`checks`; a record from before `checks` was written had HEAD_CHECKS)."""
        done = self.checks.get(folder) or HEAD_CHECKS[folder]
        words = [_CONTRACTS[folder] if c == "contract" else "converted by llama.cpp's converter" if c == "converted"
                 else f"loaded by {c.removeprefix('loaded:')}" if c.startswith("loaded:") else c for c in done]
        if folder == "gguf" and self.llama_cpp:
            words.append("served by llama-server (below)")
        elif folder in _ENGINES and not any(c.startswith("loaded:") for c in done):
            words.append(f"not loaded by {_ENGINES[folder]} in this run")
        return "; ".join(words)

    def served(self) -> bool:
        """Whether llama-server served the head (the export's llama.cpp check ran)."""
        return bool(self.llama_cpp)

    def measured_runs(self) -> list[LlamaServerRun]:
        """llama-server's runs with the head that measured a speedup."""
        runs = self.llama_cpp.runs.values() if self.llama_cpp is not None else []
        return [r for r in runs if r is not None and r.speedup_vs_target_only]


@dataclass
class HfExport(Part):
    """The HF folder and its checks (distill.export.hf: reload max |diff|, HF assisted generation greedy-equal)."""

    path: str
    checks: dict


@dataclass
class GgufExport(Part):
    """One GGUF file and its checks (distill.export.gguf: logits through transformers' GGUF loader)."""

    path: str
    gguf_type: str
    checks: dict


@dataclass
class DraftExport(Record):
    """export/export.json of a standalone draft (`distill.export.export`)."""

    NESTED = {"hf": ("one", HfExport), "gguf": ("list", GgufExport), "llama_cpp": ("map", LlamaServerRun),
              "llama_cpp_before": ("one", LlamaServerRun)}

    draft: str | None = None
    target: str | None = None
    best_k: int | None = None
    best_k_source: str | None = None
    serving: dict[str, str] = field(default_factory=dict)
    hf: HfExport | None = None
    gguf: list[GgufExport] = field(default_factory=list)
    llama_cpp: dict[str, LlamaServerRun] = field(default_factory=dict)  # GGUF type -> llama-server's run
    llama_cpp_before: LlamaServerRun | None = None  # the un-distilled draft, served the same way
    llama_cpp_target_only: dict | None = None
    llama_cpp_prediction: dict | None = None
    warnings: list[str] = field(default_factory=list)

    def served(self) -> bool:
        """Whether llama-server served the draft (or the un-distilled one)."""
        return bool(self.llama_cpp or self.llama_cpp_before)

    def measured_runs(self) -> list[LlamaServerRun]:
        """llama-server's runs with the distilled draft that measured a speedup."""
        return [r for r in self.llama_cpp.values() if r is not None and r.speedup_vs_target_only]


def read_export(d: Any, what: str = "export result") -> HeadExport | DraftExport:
    """export.json as the type of whichever export wrote it: a head's (vLLM and SGLang folders) or a draft's."""
    if isinstance(d, dict) and "vllm" in d and "sglang" in d:
        return HeadExport.from_dict(d, what)
    return DraftExport.from_dict(d, what)


__all__ = ["DraftExport", "GgufExport", "HEAD_CHECKS", "HeadExport", "HeadGguf", "HeadLlamaCpp", "HfExport",
           "LlamaServerRun", "read_export"]
