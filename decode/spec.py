"""Draft specs: the one place a draft's text form is read, checked and written.

    spec = DraftSpec.parse("prune:int4:qwen2.5-coder-0.5b-instruct:calib=c.json:vocab=kept.json")
    spec.kind, spec.inner.kind    # "prune", "int4"
    spec.weights                  # "qwen2.5-coder-0.5b-instruct": the model whose weights are loaded
    spec.quant, spec.calib, spec.vocab   # "int4", Path("c.json"), Path("kept.json")
    DraftSpec.parse("int4:m:lora=runs/x/distill/best-adapter").adapter  # Path(...): a LoRA adapter, unmerged
    str(spec)                     # the text as given
    DraftSpec.pruned(DraftSpec.int4("m"), "kept.json").text   # "prune:int4:m:vocab=kept.json"

The kinds, and what each names:
- `model`: a zoo name, a Hugging Face folder (config.json) or a `.gguf` file;
- `derive`: `derive:MODEL:keep=N` (MODEL's first N layers) or `derive:MODEL:layers=0-3,7`;
- `int4`: `int4:MODEL[:calib=FILE][:lora=FOLDER]`, MODEL a model or derive spec, in int4 on draftsmith's CPU kernel
  (GPTQ-rounded on FILE's tokens with `:calib=`; with `:lora=`, a LoRA adapter as peft saves it, added unmerged in
  float: `decode.runtime.lora`, the adapter `distill.train` trains over that very int4 base with `base_quant`);
- `prune`: `prune:MODEL:vocab=FILE`, MODEL any of the above, proposing only the target ids in FILE;
- `head`: `head:FOLDER`, or a folder whose config.json names `Eagle3Head` (an EAGLE-3 head).
Parsing reads no weights: a malformed spec is one DraftsmithError line naming the form it expected; `check` also
looks for the files and zoo names it refers to. Opening a spec is `pairing.drafts`' job; the kinds
steer it through `kind`, never through the text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from draftsmith.decode.runtime.errors import DraftsmithError

KINDS = ("model", "derive", "int4", "prune", "head")
_PREFIXES = {"derive": "derive:", "int4": "int4:", "prune": "prune:", "head": "head:"}
_CALIB, _VOCAB, _LORA = ":calib=", ":vocab=", ":lora="
_DERIVE = re.compile(r"derive:(?P<source>.+?)((?::(?:keep|layers)=[^:]*)+)")
FORMS = ("MODEL (zoo name, HF folder, .gguf), derive:MODEL:keep=N, derive:MODEL:layers=0,1,2, "
         "int4:MODEL[:calib=FILE][:lora=FOLDER], prune:MODEL:vocab=FILE or head:FOLDER")


def parse_layers(text: str) -> list[int]:
    """'0,1,2,3', '0-3' or '0-3,7' -> [0, 1, 2, 3(, 7)]."""
    layers: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise DraftsmithError(f"layers={text!r}: expected indices like 0,1,2,3 or ranges like 0-3")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise DraftsmithError(f"layers={text!r}: range {part} runs backwards")
        layers.extend(range(lo, hi + 1))
    return layers


@dataclass(frozen=True)
class DraftSpec:
    """A parsed draft spec (see the module docstring). `text` is the spec as given; `inner` the draft an `int4` or
    `prune` spec wraps, or a `derive` spec's source model."""

    kind: str
    text: str
    inner: DraftSpec | None = None
    keep: int | None = None  # derive: the first N layers
    layers: tuple[int, ...] | None = None  # derive: these layers
    calib: Path | None = None  # int4: the calibration file (on the spec itself; `calibration` looks inside)
    vocab: Path | None = None  # prune: the kept-ids file
    lora: Path | None = None  # int4: a LoRA adapter's folder, added unmerged (`adapter` looks inside a prune spec)
    folder: Path | None = None  # head: the head's folder

    def __str__(self) -> str:
        return self.text

    # --- reading ------------------------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str, *, sniff: bool = True) -> DraftSpec:
        """The spec `text` names. `sniff`: a plain folder whose config.json names `Eagle3Head` is a head."""
        if not isinstance(text, str) or not text.strip():
            raise DraftsmithError(f"empty draft spec; expected {FORMS}")
        text = text.strip()
        if text.startswith(_PREFIXES["head"]):
            folder = text[len(_PREFIXES["head"]):]
            if not folder:
                raise DraftsmithError(f"{text!r}: expected head:FOLDER (a folder with config.json and "
                                      "model.safetensors, e.g. RUN/distill/head/best)")
            return cls("head", text, folder=Path(folder).expanduser())
        if text.startswith(_PREFIXES["prune"]):
            model, key, file = text[len(_PREFIXES["prune"]):].rpartition(_VOCAB)
            if not key or not model or not file:
                raise DraftsmithError(f"{text!r}: expected prune:MODEL:vocab=FILE (FILE from `draftsmith vocab`)")
            if _LORA in file or _CALIB in file:
                raise DraftsmithError(f"{text!r}: :vocab=FILE comes last: prune:int4:MODEL[:calib=FILE]"
                                      "[:lora=FOLDER]:vocab=FILE")
            inner = cls.parse(model, sniff=False)
            if inner.kind in ("prune", "head"):
                raise DraftsmithError(f"{text!r}: MODEL must be a standalone model (zoo name, HF folder, .gguf, "
                                      "derive:..., int4:...)")
            return cls("prune", text, inner=inner, vocab=Path(file).expanduser())
        if _LORA in text:
            model, _, folder = text.rpartition(_LORA)
            if _CALIB in folder or _VOCAB in folder:
                raise DraftsmithError(f"{text!r}: :lora=FOLDER comes after :calib=FILE and before :vocab=FILE: "
                                      "[prune:]int4:MODEL[:calib=FILE]:lora=FOLDER[:vocab=FILE]")
            inner = cls.parse(model, sniff=False) if model.startswith(_PREFIXES["int4"]) and folder else None
            if inner is None or inner.kind != "int4" or inner.lora is not None:
                raise DraftsmithError(f"{text!r}: a LoRA adapter applies to an int4 draft, once: "
                                      "int4:MODEL[:calib=FILE]:lora=FOLDER")
            return replace(inner, text=text, lora=Path(folder).expanduser())
        if _CALIB in text:
            model, _, file = text.rpartition(_CALIB)
            if not model.startswith(_PREFIXES["int4"]) or not file or len(model) <= len(_PREFIXES["int4"]):
                raise DraftsmithError(f"{text!r}: a calibration applies to an int4 draft: int4:MODEL:calib=FILE")
            return replace(cls.parse(model, sniff=False), text=text, calib=Path(file).expanduser())
        if text.startswith(_PREFIXES["int4"]):
            inner = cls.parse(text[len(_PREFIXES["int4"]):], sniff=False)
            if inner.kind not in ("model", "derive"):
                raise DraftsmithError(f"{text!r}: int4 applies to a whole model: int4:MODEL (zoo name, HF folder, "
                                      ".gguf or derive:...)")
            return cls("int4", text, inner=inner)
        if text.startswith(_PREFIXES["derive"]):
            return cls._derive(text)
        if sniff and _is_head_folder(Path(text).expanduser()):
            return cls("head", text, folder=Path(text).expanduser())
        return cls("model", text)

    @classmethod
    def _derive(cls, text: str) -> DraftSpec:
        m = _DERIVE.fullmatch(text)
        if not m:
            raise DraftsmithError(f"{text!r}: expected derive:MODEL:keep=N or derive:MODEL:layers=0,1,2 (or 0-3)")
        options = m[2].split(":")[1:]
        if len(options) != 1:
            keys = [o.split("=", 1)[0] for o in options]
            raise DraftsmithError(f"{text!r}: give one of keep=N or layers=..., not {' and '.join(keys)}")
        key, value = options[0].split("=", 1)
        source = cls.parse(m["source"], sniff=False)
        if source.kind != "model":
            raise DraftsmithError(f"{text!r}: derive slices a whole model: derive:MODEL:keep=N (MODEL a zoo name, "
                                  "HF folder or .gguf)")
        if key == "layers":
            return cls("derive", text, inner=source, layers=tuple(parse_layers(value)))
        if not value.isdigit():
            raise DraftsmithError(f"{text!r}: keep= needs a number of layers")
        return cls("derive", text, inner=source, keep=int(value))

    # --- what it asks for ---------------------------------------------------------------------------------

    @property
    def is_head(self) -> bool:
        return self.kind == "head"

    @property
    def weights(self) -> str | None:
        """The model or derive spec whose weights a standalone draft loads (int4 and prune wrap one); None for a
        head (it loads a folder of its own, `folder`)."""
        if self.kind in ("model", "derive"):
            return self.text
        return self.inner.weights if self.inner is not None else None

    @property
    def quant(self) -> str | None:
        """The quantisation the spec asks for itself: "int4" for int4:... and prune:int4:..., else None."""
        if self.kind == "int4":
            return "int4"
        return self.inner.quant if self.kind == "prune" else None

    @property
    def calibration(self) -> Path | None:
        """The int4 calibration file the spec names, pruned or not."""
        if self.kind == "int4":
            return self.calib
        return self.inner.calibration if self.kind == "prune" else None

    @property
    def adapter(self) -> Path | None:
        """The LoRA adapter folder the spec names (`int4:MODEL:lora=FOLDER`, pruned or not)."""
        if self.kind == "int4":
            return self.lora
        return self.inner.adapter if self.kind == "prune" else None

    @property
    def decoder_only(self) -> bool:
        """Whether only draftsmith's decoder runs it (int4 weights, a pruned vocabulary): no engine, no plain
        `transformers` load."""
        return self.kind in ("int4", "prune")

    # --- writing ------------------------------------------------------------------------------------------

    @classmethod
    def int4(cls, model: str | DraftSpec, calib: str | Path | None = None,
             lora: str | Path | None = None) -> DraftSpec:
        """`int4:MODEL[:calib=FILE][:lora=FOLDER]`."""
        return cls.parse(f"{_PREFIXES['int4']}{model}" + (f"{_CALIB}{calib}" if calib else "")
                         + (f"{_LORA}{lora}" if lora else ""))

    @classmethod
    def pruned(cls, model: str | DraftSpec, vocab: str | Path) -> DraftSpec:
        """`prune:MODEL:vocab=FILE`."""
        return cls.parse(f"{_PREFIXES['prune']}{model}{_VOCAB}{vocab}")

    @classmethod
    def head(cls, folder: str | Path) -> DraftSpec:
        """`head:FOLDER`."""
        return cls.parse(f"{_PREFIXES['head']}{folder}")

    # --- checking (no weights read) ---------------------------------------------------------------------------

    def check(self, known_models: set[str] | None = None) -> None:
        """The files and models the spec refers to exist: the kept-ids file, the calibration file, the adapter's
        folder (its two files), the head's folder, and each model a zoo name (`known_models`; None: not checked)
        or an HF folder / .gguf file."""
        if self.kind == "head":
            if not (self.folder / "config.json").is_file() or not (self.folder / "model.safetensors").is_file():
                raise DraftsmithError(f"{self.text}: no head at {self.folder} (a folder with config.json and "
                                      "model.safetensors, e.g. RUN/distill/head/best)")
            return
        if self.vocab is not None and not self.vocab.is_file():
            raise DraftsmithError(f"{self.text!r}: no kept-vocabulary file {self.vocab} (draftsmith vocab writes one)")
        if self.calib is not None and not self.calib.is_file():
            raise DraftsmithError(f"{self.text!r}: no such calibration file {self.calib}")
        if self.lora is not None and not all((self.lora / f).is_file() for f in _ADAPTER_FILES):
            raise DraftsmithError(f"{self.text!r}: no LoRA adapter at {self.lora} (a folder with "
                                  f"{' and '.join(_ADAPTER_FILES)}, e.g. RUN/distill/best-adapter)")
        if self.inner is not None:
            self.inner.check(known_models)
            return
        if known_models is None or self.text in known_models:
            return
        path = Path(self.text).expanduser()
        if (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf"):
            return
        raise DraftsmithError(f"unknown model {self.text!r}: expected a zoo name ({', '.join(sorted(known_models))}), "
                              "an HF folder with config.json or a .gguf file")


_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # as peft saves them (`decode.runtime.lora`)


def _is_head_folder(path: Path) -> bool:
    """A folder `decode.head.save_head` wrote: its config.json names Eagle3Head."""
    config = path / "config.json"
    try:
        return config.is_file() and json.loads(config.read_text()).get("architectures") == ["Eagle3Head"]
    except (OSError, ValueError, AttributeError):
        return False  # not a head's; loading it as a model says what is wrong


def split_specs(text: str) -> list[str]:
    """Split 'a,b,derive:m:layers=0,1,2,c' on commas, keeping the layer list of a derive spec together."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if out and out[-1].startswith(_PREFIXES["derive"]) and "layers=" in out[-1] and part.replace("-", "").isdigit():
            out[-1] += "," + part
        else:
            out.append(part)
    return out


__all__ = ["FORMS", "KINDS", "DraftSpec", "parse_layers", "split_specs"]
