"""Write a Hugging Face draft as a GGUF file llama.cpp takes as `-md`, its tokenizer copied from the target's GGUF.

    .venv/bin/draftsmith export --draft runs/distill-smollm2/best --target smollm2-135m-instruct --format gguf --out x

    from draftsmith.distill.export.gguf import write_gguf, verify_gguf
    summary = write_gguf(model, tokenizer, Path("x/draft-f16.gguf"), target_gguf=zoo.gguf_path("smollm2-135m-instruct"))
    check = verify_gguf(Path("x/draft-f16.gguf"), model, [ids])

Architectures: llama (SmolLM2, Llama) and qwen2 (Qwen2 / Qwen2.5). Types: f32, f16, q8_0. As llama.cpp's own
converter does, 1-D tensors (norms, biases) stay F32, and a 2-D tensor whose rows do not split into 32-value
Q8_0 blocks falls back to F16. llama-arch attention uses GGML's interleaved RoPE, so the rows of q_proj /
k_proj are permuted from HF's half-split order (qwen2 uses the NeoX RoPE: no permutation).

Every `tokenizer.*` key comes from the target's GGUF, so the draft speaks exactly the target's vocabulary;
llama.cpp's draft rule (pairing.compat.llama_cpp_rule) is evaluated first, against both the draft's own
tokenizer and the metadata about to be written, and a failing clause refuses the export by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.io import atomic_path
from draftsmith.pairing.compat import llama_cpp_rule, tokenizer_meta

GGUF_TYPES = ("f32", "f16", "q8_0")  # the one list: recipes.config checks export.gguf_type against it
# Max |logit diff| relative to the largest |logit|, and minimum argmax agreement, per GGUF type. Measured
# (relative diff / top-1): distilled SmolLM2 draft, 326 positions: f32 0 / 100 %, f16 6.8e-4 / 99.7 %,
# q8_0 1.1e-2 / 98.2 %; tiny random Llama and Qwen2 (flat logits, the hard case): f16 1.1e-3 / 98.8 %,
# q8_0 3.5e-2 / 96.3 %. A missing q/k permutation measures 0.72 / 41 %, far outside every bound.
GGUF_TOL = {"f32": (1e-5, 1.0), "f16": (5e-3, 0.97), "q8_0": (6e-2, 0.90)}
_ARCHS = {"llama": "LLAMA", "qwen2": "QWEN2"}  # HF model_type -> gguf.MODEL_ARCH member
_TOKEN_UNUSED = 5  # llama.cpp token type of padding rows (convert_hf_to_gguf's [PAD{i}])


# ---------------------------------------------------------------------------------------------
# Pure pieces


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> GGML interleaved order, per head: rows (x0..x_{d/2-1}, y0..) -> (x0, y0, x1, y1..).

    w: (n_head * head_dim, ...) weight or bias of q_proj (n_head = heads) or k_proj (n_head = KV heads).
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_qk` (what transformers' GGUF loader applies)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_type(name: str, shape: tuple[int, ...], gguf_type: str) -> str:
    """GGML type name of one tensor under `gguf_type`: 1-D stays F32; Q8_0 needs rows divisible by 32."""
    if gguf_type not in GGUF_TYPES:
        raise DraftsmithError(f"GGUF type {gguf_type!r}: expected one of {', '.join(GGUF_TYPES)}")
    if len(shape) < 2 or gguf_type == "f32":
        return "F32"
    if gguf_type == "q8_0" and shape[-1] % 32 == 0:
        return "Q8_0"
    return "F16"


def _rope_type(config: Any) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type", "default")) or "default"


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def check_architecture(config: Any) -> str:
    """The draft's HF model_type if the exporter can write it; otherwise a DraftsmithError saying what is missing."""
    arch = config.model_type
    if arch not in _ARCHS:
        raise DraftsmithError(f"GGUF export supports {', '.join(_ARCHS)} models, not {arch!r}")
    unsupported = []
    if _rope_type(config) != "default":
        unsupported.append(f"RoPE scaling {_rope_type(config)!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        unsupported.append(f"activation {config.hidden_act!r}")
    if arch == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
        unsupported.append("llama with bias terms")
    if unsupported:
        raise DraftsmithError(f"GGUF export of this {arch} draft is not supported: {', '.join(unsupported)}")
    return arch


def gguf_tensors(model: Any) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight, q/k permuted for llama, a tied head left out."""
    import gguf

    config = model.config
    arch = check_architecture(config)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _ARCHS[arch]), config.num_hidden_layers)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    out = []
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and tied:  # llama.cpp reuses token_embd when output.weight is absent
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise DraftsmithError(f"GGUF export: no GGUF name for tensor {key!r} of this {arch} model")
        w = tensor.detach().to(torch.float32).cpu().numpy()
        if arch == "llama" and ".self_attn.q_proj." in key:
            w = permute_qk(w, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in key:
            w = permute_qk(w, n_kv)
        out.append((name, np.ascontiguousarray(w)))
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer metadata


def target_tokenizer_fields(target_gguf: Path) -> list[tuple[str, Any, Any, Any]]:
    """Every `tokenizer.*` key of the target's GGUF as (key, value, value type, item type)."""
    from gguf import GGUFReader

    reader = GGUFReader(target_gguf)  # decodes the whole header (seconds on a 150k vocabulary), once
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            fields.append((key, field.contents(), field.types[0], sub))
    if not any(key == "tokenizer.ggml.tokens" for key, *_ in fields):
        raise DraftsmithError(f"{target_gguf}: target GGUF has no tokenizer.ggml.tokens to copy")
    return fields


def resize_vocab(fields: list[tuple[str, Any, Any, Any]], n_rows: int) -> list[tuple[str, Any, Any, Any]]:
    """The per-token arrays cut or padded to the draft's `n_rows` embedding rows (llama.cpp needs them equal);
    padding rows are `[PAD{id}]`, type UNUSED, score 0, as llama.cpp's converter writes them."""
    pad = {"tokenizer.ggml.tokens": lambda i: f"[PAD{i}]", "tokenizer.ggml.token_type": lambda i: _TOKEN_UNUSED,
           "tokenizer.ggml.scores": lambda i: 0.0}  # fmt: skip
    out = []
    for key, value, vtype, sub in fields:
        if key in pad:
            value = list(value[:n_rows]) + [pad[key](i) for i in range(len(value), n_rows)]
        out.append((key, value, vtype, sub))
    return out


def rule_check(target_gguf: Path, draft_tokenizer: Any, n_rows: int, fields: list[tuple[str, Any, Any, Any]]) -> dict:
    """llama.cpp's draft rule for the draft's own tokenizer and for the metadata about to be written."""
    target = tokenizer_meta(None, gguf_path=target_gguf)
    own = tokenizer_meta(draft_tokenizer, n_rows=n_rows)
    written = {**target, "tokens": dict((k, v) for k, v, *_ in fields)["tokenizer.ggml.tokens"]}
    written["n_vocab"] = len(written["tokens"])
    failed: list[str] = []
    for meta in (own, written):
        failed += [note for note in llama_cpp_rule(target, meta)[1] if note not in failed]
    return {"passes": not failed, "failed": failed, "target_n_vocab": target["n_vocab"], "draft_rows": n_rows,
            "draft_tokenizer_n_vocab": own["n_vocab"], "vocab_type": target["vocab_type"]}


# ---------------------------------------------------------------------------------------------
# Writing


def prepare_vocab(model: Any, tokenizer: Any, target_gguf: Path) -> tuple[list[tuple[str, Any, Any, Any]], dict]:
    """(tokenizer fields to write, llama.cpp rule verdict) for `model` as a draft of `target_gguf`.

    Raises DraftsmithError when the architecture cannot be written or llama.cpp's draft rule fails, naming
    every failing clause; export calls it before writing anything."""
    check_architecture(model.config)
    n_rows = int(model.get_input_embeddings().weight.shape[0])
    fields = resize_vocab(target_tokenizer_fields(Path(target_gguf)), n_rows)
    rule = rule_check(Path(target_gguf), tokenizer, n_rows, fields)
    if not rule["passes"]:
        raise DraftsmithError(
            f"llama.cpp would refuse this draft for {Path(target_gguf).name}: {'; '.join(rule['failed'])}")
    return fields, rule


def write_gguf(
    model: Any, tokenizer: Any, path: Path, *, target_gguf: Path, gguf_type: str = "f16", name: str | None = None,
    prepared: tuple[list, dict] | None = None, progress: bool = False,
) -> dict:
    """Write `model` (an HF causal LM in memory) to `path` as a GGUF draft of `target_gguf`; returns a summary.

    Raises DraftsmithError, before anything is written, when llama.cpp's draft rule would fail (`prepared`:
    `prepare_vocab`'s result, to read the target's GGUF once for several types)."""
    import gguf

    config = model.config
    arch = check_architecture(config)
    tensor_type("", (1,), gguf_type)  # an unknown type fails before the work
    fields, rule = prepared or prepare_vocab(model, tokenizer, Path(target_gguf))
    tensors = gguf_tensors(model)
    n_rows = int(model.get_input_embeddings().weight.shape[0])

    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]  # fmt: skip
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    types: dict[str, int] = {}
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_type("model")
        w.add_name(name or f"draftsmith draft ({arch})")
        w.add_file_type(file_type)
        if gguf_type == "q8_0":
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(config.max_position_embeddings)
        w.add_embedding_length(config.hidden_size)
        w.add_block_count(config.num_hidden_layers)
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(_rope_theta(config))
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
        w.add_vocab_size(n_rows)
        if head_dim != config.hidden_size // config.num_attention_heads:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        for key, value, vtype, sub in fields:
            w.add_key_value(key, value, vtype, sub_type=sub)
        for tname, array in tensors:
            ttype = tensor_type(tname, array.shape, gguf_type)
            types[ttype] = types.get(ttype, 0) + 1
            if ttype == "Q8_0":
                w.add_tensor(tname, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(tname, array.astype(np.float16 if ttype == "F16" else np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=progress)
        w.close()
    return {"path": str(path), "gguf_type": gguf_type, "architecture": arch, "bytes": Path(path).stat().st_size,
            "tensors": len(tensors), "tensor_types": types, "llama_cpp_rule": rule,
            "expected": {n: [list(a.shape), tensor_type(n, a.shape, gguf_type)] for n, a in tensors}}


# ---------------------------------------------------------------------------------------------
# Checks


@torch.inference_mode()
def logits_diff(reference: Any, candidate: Any, prompts: list[list[int]]) -> dict:
    """Max |logit difference| and top-1 (argmax) agreement of two models over every position of `prompts`."""
    max_diff, max_ref, agree, total = 0.0, 0.0, 0, 0
    for ids in prompts:
        x = torch.tensor([ids])
        a, b = reference(x).logits[0].float(), candidate(x).logits[0].float()  # (T, V)
        max_diff = max(max_diff, float((a - b).abs().max()))
        max_ref = max(max_ref, float(a.abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    # relative to the largest |logit|, so one tolerance fits a random tiny model and a trained one
    return {"max_abs_diff": max_diff, "rel_max_abs_diff": max_diff / max_ref if max_ref else max_diff,
            "max_abs_logit": max_ref, "top1_agreement": agree / total if total else None, "positions": total}


def read_back(path: Path, expected: dict[str, list]) -> dict:
    """Parse the written file with gguf.GGUFReader and compare tensor names, shapes and types with the plan."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    # GGUF lists dimensions fastest-first; numpy (and the plan) slowest-first
    found = {t.name: [[int(d) for d in reversed(t.shape.tolist())], t.tensor_type.name] for t in reader.tensors}
    problems = [f"{n}: wrote {found.get(n)}, planned {e}" for n, e in expected.items() if found.get(n) != e]
    problems += [f"{n}: not planned" for n in found if n not in expected]
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    return {"ok": not problems, "problems": problems[:5], "tensor_count": len(found), "n_vocab": n_tokens,
            "architecture": reader.fields["general.architecture"].contents()}


def load_with_transformers(path: Path) -> Any:
    """The GGUF file dequantised by transformers' own GGUF loader (an independent reader of what we wrote)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
    return model.eval()


def verify_gguf(path: Path, model: Any, prompts: list[list[int]], expected: dict[str, list]) -> dict:
    """Read the file back (structure) and load it through transformers (logits vs the in-memory `model`)."""
    check = {"read_back": read_back(Path(path), expected)}
    check["logits"] = logits_diff(model, load_with_transformers(Path(path)), prompts)
    return check


def export_gguf(model: Any, tokenizer: Any, path: Path, gguf_type: str, target_gguf: Path, prepared: tuple | None,
                name: str, prompts: list[list[int]], failed: list[str]) -> dict:
    """Write `path` as `gguf_type`, read it back and compare its logits with `model`'s within GGUF_TOL; a failed
    check is appended to `failed`. Returns what export.json records for this file."""
    g = write_gguf(model, tokenizer, path, target_gguf=target_gguf, gguf_type=gguf_type, name=name, prepared=prepared)
    g["checks"] = verify_gguf(path, model, prompts, g.pop("expected"))
    lg, (rel_tol, top1_tol) = g["checks"]["logits"], GGUF_TOL[gguf_type]
    g["tolerance"] = {"rel_max_abs_diff": rel_tol, "top1_agreement": top1_tol}
    if not g["checks"]["read_back"]["ok"]:
        failed.append(f"GGUF {gguf_type} read back: {g['checks']['read_back']['problems']}")
    if lg["rel_max_abs_diff"] > rel_tol or lg["top1_agreement"] < top1_tol:
        failed.append(f"GGUF {gguf_type} logits: relative max diff {lg['rel_max_abs_diff']:.3g} (tolerance "
                      f"{rel_tol}), top-1 {lg['top1_agreement']:.3f} (tolerance {top1_tol})")
    return g


__all__ = ["GGUF_TOL", "GGUF_TYPES", "check_architecture", "export_gguf", "gguf_tensors", "load_with_transformers",
           "logits_diff", "permute_qk", "prepare_vocab", "read_back", "resize_vocab", "rule_check",
           "target_tokenizer_fields", "tensor_type", "unpermute_qk", "verify_gguf", "write_gguf"]
