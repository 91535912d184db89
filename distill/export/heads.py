"""Export an EAGLE-3 draft head (decode.head) to the folders vLLM and SGLang load, and check them by their contract.

    export_speculators(head, target.config, "meta-llama/Llama-3.1-8B-Instruct", out / "vllm", k=3)
    export_sglang(head, target.config, "meta-llama/Llama-3.1-8B-Instruct", out / "sglang")
    check_speculators_contract(out / "vllm", target_config=target.config)   # one-line DraftsmithError if broken

- vLLM speculators folder (vllm transformers_utils/configs/speculators/{base,algos}.py, models/llama_eagle3.py;
  speculators models/eagle3/{config,core}.py): speculators_model_type "eagle3", architectures ["Eagle3Speculator"],
  speculators_config {algorithm, proposal_methods [{greedy, speculative_tokens K}], default_proposal_method,
  verifier {name_or_path, architectures}}, transformer_layer_config (a one-layer LlamaConfig), draft_vocab_size,
  norm_before_residual false (vLLM defaults it to true), target_hidden_size, eagle_aux_hidden_state_layer_ids;
  weights `layers.0.*`, fc, norm, lm_head (draft_vocab_size rows), d2t (int64 offsets), t2d (bool, target vocab).
- SGLang / SpecForge folder (sglang srt/models/llama_eagle3.py): a one-layer LlamaConfig, architectures
  ["LlamaForCausalLMEagle3"], draft_vocab_size, tie_word_embeddings false (true: the embedding becomes the LM head),
  eagle_config.eagle_aux_hidden_state_layer_ids = ours - 1 (srt/models/llama.py captures the input of layer id+1);
  weights `midlayer.*`, fc, norm, lm_head, d2t, t2d.
Aux id i (decode.head) is the input of target layer i, as in vLLM. Both engines capture each layer once, ascending,
never layer 0 (residual still None): ids must be distinct in [1, L-1] (`refuse_pairing`, before anything is written);
the export sorts them and permutes fc's input blocks to match. No d2t / t2d for a whole-vocabulary head (both engines
then map one to one); never the target's embedding (both share the target's). Atomic writes, safetensors only; each
folder passes its contract check before it lands. speculators' own Eagle3DraftModel reads the speculators folder
and gives our logits (tests/distill/export/test_speculators.py, in a venv of its own: speculators_env.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.head import Eagle3Head, HeadConfig
from draftsmith.decode.runtime.io import atomic_dir, atomic_write_json, read_json
from draftsmith.distill.export.results import HEAD_CHECKS, HeadExport, HeadGguf, HeadLlamaCpp

SPECULATORS_ARCH, SGLANG_ARCH = "Eagle3Speculator", "LlamaForCausalLMEagle3"


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def _fail(where: Any, message: str) -> DraftsmithError:
    return DraftsmithError(f"{where}: {message}")


def refuse_pairing(head_config: HeadConfig, target_config: Any) -> None:
    """A one-line DraftsmithError when the head cannot serve this target (HF config or dict)."""
    c, L = head_config, int(_get(target_config, "num_hidden_layers"))
    problems = [f"{key} {getattr(c, key)} != the target's {_get(target_config, key)}"
                for key in ("hidden_size", "vocab_size") if getattr(c, key) != _get(target_config, key)]
    ids = c.aux_layers
    if len(set(ids)) != len(ids) or not all(1 <= i < L for i in ids):
        problems.append(f"aux layers {list(ids)} must be distinct target layers in [1, {L - 1}] (vLLM and SGLang "
                        f"capture each layer's input once, and none at layer 0)")
    if problems:
        raise DraftsmithError(f"refusing to export the head for this target: {'; '.join(problems)}")


def _layer_config(c: HeadConfig, target_config: Any, dtype: torch.dtype) -> dict:
    """The head's one decoder layer as a LlamaConfig dict (rope in both the transformers 4 and 5 spellings)."""
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "vocab_size": c.vocab_size, "max_position_embeddings": _get(target_config, "max_position_embeddings", 4096),
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "bos_token_id": _get(target_config, "bos_token_id"), "eos_token_id": _get(target_config, "eos_token_id"),
            "torch_dtype": str(dtype).removeprefix("torch.")}


def _tensors(head: Eagle3Head, layer_prefix: str) -> tuple[list[int], dict[str, Tensor]]:
    """(aux ids ascending, weights under the engine's names with fc's three input blocks in that order)."""
    c = head.config
    order = sorted(range(len(c.aux_layers)), key=lambda j: c.aux_layers[j])
    out = {}
    for name, t in head.state_dict().items():
        if name in ("d2t", "t2d") and c.draft_vocab_size == c.vocab_size:
            continue
        out[layer_prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name] = t
    blocks = head.fc.weight.detach().split(c.hidden_size, dim=1)
    out["fc.weight"] = torch.cat([blocks[j] for j in order], dim=1)
    out = {k: v.detach().cpu().contiguous() for k, v in out.items()}
    if "d2t" in out:
        out["d2t"], out["t2d"] = out["d2t"].long(), out["t2d"].bool()
    return [c.aux_layers[j] for j in order], out


def _write(out: str | Path, config: dict, tensors: dict[str, Tensor], check, target_config: Any) -> Path:
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
        check(tmp, target_config=target_config)  # a folder that breaks the contract never lands at `out`
    return Path(out)


def export_speculators(head: Eagle3Head, target_config: Any, target_name: str, out: str | Path, *, k: int) -> Path:
    """vLLM's speculators folder for `head` on the target (`target_name`: its HF id or path, the verifier)."""
    refuse_pairing(head.config, target_config)
    if k < 1:
        raise DraftsmithError(f"speculative_tokens K must be >= 1, got {k}")
    c, (ids, tensors) = head.config, _tensors(head, "layers.0.")
    config = {"architectures": [SPECULATORS_ARCH], "speculators_model_type": "eagle3",
              "speculators_config": {
                  "algorithm": "eagle3", "default_proposal_method": "greedy",
                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k),
                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                  "verifier": {"name_or_path": str(target_name),
                               "architectures": list(_get(target_config, "architectures") or [])}},
              "transformer_layer_config": _layer_config(c, target_config, head.fc.weight.dtype),
              "draft_vocab_size": c.draft_vocab_size, "norm_before_residual": False,
              "target_hidden_size": c.hidden_size, "eagle_aux_hidden_state_layer_ids": ids}
    return _write(out, config, tensors, check_speculators_contract, target_config)


def export_sglang(head: Eagle3Head, target_config: Any, target_name: str, out: str | Path) -> Path:
    """SGLang's EAGLE-3 draft folder (SpecForge's layout) for `head` on the target."""
    refuse_pairing(head.config, target_config)
    c, (ids, tensors) = head.config, _tensors(head, "midlayer.")
    config = {"architectures": [SGLANG_ARCH], **_layer_config(c, target_config, head.fc.weight.dtype),
              "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]},  # SGLang adds 1 back
              "draftsmith_target": str(target_name)}
    return _write(out, config, tensors, check_sglang_contract, target_config)


def export_llama_cpp_input(head: Eagle3Head, target_config: Any, target_name: str, out: str | Path) -> Path:
    """The folder llama.cpp's converter (convert_hf_to_gguf.py --target-model-dir) turns into an EAGLE-3 GGUF:
    SGLang's layout (a one-layer LlamaConfig with draft_vocab_size, which is how the converter detects an
    EAGLE-3 draft; weights midlayer.*, fc, norm, lm_head, d2t) plus `eagle_aux_hidden_state_layer_ids` at the
    top level, where the converter reads it, in llama.cpp's meaning: `t_layer_inp[i]`, the input of target
    layer i, as ours (without it the converter falls back to [2, L/2, L-3])."""
    refuse_pairing(head.config, target_config)
    c, (ids, tensors) = head.config, _tensors(head, "midlayer.")
    config = {"architectures": [SGLANG_ARCH], **_layer_config(c, target_config, head.fc.weight.dtype),
              "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
              "eagle_aux_hidden_state_layer_ids": ids, "norm_before_residual": False,
              "draftsmith_target": str(target_name)}
    return _write(out, config, tensors, check_llama_cpp_input_contract, target_config)


# ---------------------------------------------------------------------------------------------
# The contract: what the engines read, checked field by field and weight by weight


def _need(d: dict, key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise _fail(where, f"missing {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise _fail(where, f"{key!r} must be {typ.__name__}, got {type(v).__name__} {v!r}")
    return v


def _equal(d: dict, key: str, expected: Any, where: str) -> None:
    if d.get(key) != expected:
        raise _fail(where, f"{key!r} must be {expected!r}, got {d.get(key)!r}")


def _layer_dims(cfg: dict, where: str) -> dict[str, int]:
    dims = {key: _need(cfg, key, int, where) for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                          "num_key_value_heads", "vocab_size", "num_hidden_layers")}
    dims["head_dim"] = cfg.get("head_dim") or dims["hidden_size"] // dims["num_attention_heads"]
    _need(cfg, "rms_norm_eps", float, where)
    if cfg.get("rope_theta") is None and (cfg.get("rope_parameters") or {}).get("rope_theta") is None:
        raise _fail(where, "missing 'rope_theta'")
    if dims["num_hidden_layers"] != 1:
        raise _fail(where, f"num_hidden_layers must be 1 (one EAGLE-3 layer), got {dims['num_hidden_layers']}")
    return dims


def _target_layers(target_config: Any, verifier: str | None) -> int | None:
    if target_config is None and verifier and (Path(verifier) / "config.json").is_file():
        target_config = read_json(Path(verifier) / "config.json", what="verifier config")
        target_config = _get(target_config, "text_config") or target_config
    return None if target_config is None else int(_get(target_config, "num_hidden_layers"))


def _check_aux(ids: Any, layers: int | None, offset: int, where: str, key: str) -> None:
    """`ids` + offset must be 3 distinct ints, ascending, in [1, layers - 1] (the input of a target layer >= 1)."""
    hi = f"{layers - 1 - offset}" if layers is not None else "L-1"
    bad = (not isinstance(ids, list) or len(ids) != 3 or any(not isinstance(i, int) or isinstance(i, bool) for i in ids)
           or ids != sorted(set(ids)) or ids[0] + offset < 1 or (layers is not None and ids[-1] + offset >= layers))
    if bad:
        raise _fail(where, f"{key} must be 3 distinct ascending layer ids in [{1 - offset}, {hi}], got {ids!r}")


def _check_weights(folder: Path, d: dict[str, int], N: int, target_hidden: int, prefix: str) -> None:
    from safetensors import safe_open

    path = folder / "model.safetensors"
    if not path.is_file():
        raise _fail(folder, "no model.safetensors")
    H, I, D, V = d["hidden_size"], d["intermediate_size"], d["head_dim"], d["vocab_size"]
    q, kv = d["num_attention_heads"] * D, d["num_key_value_heads"] * D
    expected = {"fc.weight": (H, 3 * target_hidden), "norm.weight": (H,), "lm_head.weight": (N, H),
                **{prefix + k: s for k, s in {
                    "self_attn.q_proj.weight": (q, 2 * H), "self_attn.k_proj.weight": (kv, 2 * H),
                    "self_attn.v_proj.weight": (kv, 2 * H), "self_attn.o_proj.weight": (H, q),
                    "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
                    "input_layernorm.weight": (H,), "hidden_norm.weight": (H,),
                    "post_attention_layernorm.weight": (H,)}.items()}}
    maps = {"d2t": ((N,), "I64"), "t2d": ((V,), "BOOL"), "embed_tokens.weight": ((V, H), None)}  # optional ones
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        if N < V and not {"d2t", "t2d"} <= names:
            raise _fail(path, f"missing d2t / t2d: draft_vocab_size {N} < vocab_size {V} needs the id map")
        if "lm_head.weight" in names and (rows := f.get_slice("lm_head.weight").get_shape()[0]) != N:
            raise _fail(path, f"lm_head.weight has {rows} rows but draft_vocab_size is {N}")
        for name in sorted(set(expected) | names):
            if name not in names:
                raise _fail(path, f"missing weight {name}")
            want, want_dtype = (expected[name], None) if name in expected else maps.get(name, (None, None))
            if want is None:
                raise _fail(path, f"unexpected weight {name} (the engine has no such parameter)")
            sl = f.get_slice(name)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != want:
                raise _fail(path, f"{name} has shape {list(shape)}, the config says {list(want)}")
            if dtype != want_dtype if want_dtype else dtype not in ("F16", "BF16", "F32", "F64"):
                raise _fail(path, f"{name} is {dtype}, expected {want_dtype or 'a float type'}")
        if "d2t" in names or "t2d" in names:
            if not {"d2t", "t2d"} <= names:
                raise _fail(path, "d2t and t2d come together")
            ids, t2d = torch.arange(N) + f.get_tensor("d2t"), f.get_tensor("t2d")
            if ids.min() < 0 or ids.max() >= V or ids.unique().numel() != N or int(t2d.sum()) != N or not t2d[ids].all():
                raise _fail(path, "d2t and t2d disagree: draft_id + d2t[draft_id] must be N distinct target ids, "
                                  "exactly those t2d marks")


def _read_config(folder: str | Path) -> tuple[Path, dict, str]:
    folder = Path(folder)
    cfg = read_json(folder / "config.json", what="draft head config")
    if not isinstance(cfg, dict):
        raise _fail(folder / "config.json", "not a JSON object")
    return folder, cfg, str(folder / "config.json")


def check_speculators_contract(folder: str | Path, *, target_config: Any = None) -> None:
    """What vLLM (and the speculators library) read from a speculators EAGLE-3 folder; one-line DraftsmithError.
    The aux ids are checked against the target's layers when its config is given or the verifier is a local folder."""
    folder, cfg, where = _read_config(folder)
    _equal(cfg, "speculators_model_type", "eagle3", where)
    _equal(cfg, "architectures", [SPECULATORS_ARCH], where)
    sc = _need(cfg, "speculators_config", dict, where)
    _equal(sc, "algorithm", "eagle3", (w := where + " speculators_config"))
    _need(sc, "default_proposal_method", str, w)
    methods = _need(sc, "proposal_methods", list, w)
    if not methods or not isinstance(methods[0], dict) or _need(methods[0], "speculative_tokens", int, w) < 1:
        raise _fail(where, "speculators_config.proposal_methods[0].speculative_tokens must be an int >= 1")
    verifier = _need(sc, "verifier", dict, w)
    for key, typ in (("name_or_path", str), ("architectures", list)):
        _need(verifier, key, typ, w + ".verifier")
    dims = _layer_dims(_need(cfg, "transformer_layer_config", dict, where), where + " transformer_layer_config")
    N = _need(cfg, "draft_vocab_size", int, where)
    if _need(cfg, "norm_before_residual", bool, where):
        raise _fail(where, "norm_before_residual must be false (the head's residual is the un-normed hidden)")
    _check_aux(cfg.get("eagle_aux_hidden_state_layer_ids"), _target_layers(target_config, verifier["name_or_path"]),
               0, where, "eagle_aux_hidden_state_layer_ids")
    _check_weights(folder, dims, N, _need(cfg, "target_hidden_size", int, where), "layers.0.")


def check_sglang_contract(folder: str | Path, *, target_config: Any = None) -> None:
    """What SGLang's LlamaForCausalLMEagle3 reads from a draft folder; one-line DraftsmithError."""
    folder, cfg, where = _read_config(folder)
    _equal(cfg, "architectures", [SGLANG_ARCH], where)
    _equal(cfg, "model_type", "llama", where)
    dims = _layer_dims(cfg, where)
    if cfg.get("tie_word_embeddings"):
        raise _fail(where, "tie_word_embeddings must be false (SGLang would use the embedding as the LM head)")
    N = _need(cfg, "draft_vocab_size", int, where)
    eagle = _need(cfg, "eagle_config", dict, where)
    _check_aux(eagle.get("eagle_aux_hidden_state_layer_ids"), _target_layers(target_config, None), 1, where,
               "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang adds 1)")
    _check_weights(folder, dims, N, int(cfg.get("target_hidden_size") or dims["hidden_size"]), "midlayer.")


def check_llama_cpp_input_contract(folder: str | Path, *, target_config: Any = None) -> None:
    """What llama.cpp's converter reads from an EAGLE-3 draft folder (conversion/llama.py): num_hidden_layers 1
    and draft_vocab_size (the detection), top-level eagle_aux_hidden_state_layer_ids (the input of target layer
    i), norm_before_residual false, midlayer.* weights; one-line DraftsmithError."""
    folder, cfg, where = _read_config(folder)
    _equal(cfg, "architectures", [SGLANG_ARCH], where)
    dims = _layer_dims(cfg, where)
    N = _need(cfg, "draft_vocab_size", int, where)
    if _need(cfg, "norm_before_residual", bool, where):
        raise _fail(where, "norm_before_residual must be false (the head's residual is the un-normed hidden)")
    _check_aux(cfg.get("eagle_aux_hidden_state_layer_ids"), _target_layers(target_config, None), 0, where,
               "eagle_aux_hidden_state_layer_ids")
    _check_weights(folder, dims, N, _need(cfg, "target_hidden_size", int, where), "midlayer.")


__all__ = ["SGLANG_ARCH", "SPECULATORS_ARCH", "check_llama_cpp_input_contract", "check_sglang_contract",
           "check_speculators_contract", "export_llama_cpp_input", "export_sglang", "export_speculators",
           "refuse_pairing"]


def head_serving_lines(target_hf: str, vllm_dir: str, sglang_dir: str, k: int) -> dict[str, str]:
    """Command lines that serve the target with this head proposing `k` tokens a step (EAGLE-3 in both engines)."""
    import json
    import shlex

    q = shlex.quote
    spec = json.dumps({"method": "eagle3", "model": vllm_dir, "num_speculative_tokens": k})
    return {"vllm": f"vllm serve {q(target_hf)} --speculative-config {q(spec)}",
            "sglang": (f"python -m sglang.launch_server --model-path {q(target_hf)} --speculative-algorithm EAGLE3 "
                       f"--speculative-draft-model-path {q(sglang_dir)} --speculative-num-steps {k} "
                       f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")}


def export_head(head_dir: str | Path, target: str, out: str | Path, *, k: int, gguf: bool = False,
                check_llama_cpp: bool = False, target_gguf: str | Path | None = None, ks: list[int] | None = None,
                progress: bool = True) -> dict:
    """A trained head folder (decode.head.save_head) -> out/vllm and out/sglang, both checked, plus serving lines.
    `gguf`: also out/llama-cpp (the converter's input) and out/head-f16.gguf, converted by llama.cpp's own
    converter against the target's HF folder. `check_llama_cpp`: llama-server serves the target's GGUF with the
    head (`--spec-type draft-eagle3`) at each K in `ks` (default [k]), between two runs of the target alone;
    greedy text compared; and its speedup there predicted from llama.cpp's costs beside measured, with acceptance
    in both engines (`llama_cpp_prediction`, distill.export.predict_llama_cpp). A head that does not fit the
    target is refused before anything is written."""
    from draftsmith.decode.head import load_head
    from draftsmith.decode.runtime.loading import load

    t = load(target)
    config = read_json(Path(head_dir) / "config.json", what="head config")
    config.pop("architectures", None)
    try:
        head_config = HeadConfig(**config)
    except (TypeError, ValueError) as e:
        raise DraftsmithError(f"{head_dir}: not a head config ({e})") from None
    refuse_pairing(head_config, t.model.config)  # before anything is loaded or written
    head = load_head(head_dir, t.model.get_input_embeddings())
    out = Path(out)
    name = str(getattr(t.model.config, "_name_or_path", "") or target)
    vllm_dir = export_speculators(head, t.model.config, name, out / "vllm", k=k)
    sglang_dir = export_sglang(head, t.model.config, name, out / "sglang")
    result = HeadExport(str(vllm_dir), str(sglang_dir), head=str(head_dir), target=target, k=k,
                        serving=head_serving_lines(str(t.path), str(vllm_dir.resolve()), str(sglang_dir.resolve()), k),
                        checks={f: list(HEAD_CHECKS[f]) for f in ("vllm", "sglang")})  # each passed before it landed
    if gguf or check_llama_cpp:
        from draftsmith.distill.export.llama_cpp import convert_head_to_gguf

        src = export_llama_cpp_input(head, t.model.config, name, out / "llama-cpp")
        path = convert_head_to_gguf(src, t.path, out / "head-f16.gguf", outtype="f16", progress=progress)
        result.gguf = HeadGguf(str(path), path.stat().st_size, str(src))
        result.checks["gguf"] = list(HEAD_CHECKS["gguf"])
    if check_llama_cpp:
        from draftsmith.distill.export import predict_llama_cpp, target_gguf_for

        result.llama_cpp = HeadLlamaCpp.from_dict(check_head_with_llama_cpp(
            target, Path(result.gguf.path), ks or [k], target_gguf=target_gguf, progress=progress))
        result.warnings = []
        result.llama_cpp_prediction = predict_llama_cpp(
            t, head, target_gguf_for(target, target_gguf), Path(result.gguf.path), ks or [k], 4,
            result.warnings, progress, spec_type="draft-eagle3")
    record = result.to_dict()
    atomic_write_json(out / "export.json", record)
    return record


def check_head_with_llama_cpp(target: str, head_gguf: Path, ks: list[int], *, target_gguf: str | Path | None = None,
                              n_prompts: int = 4, n_predict: int = 64, progress: bool = True) -> dict:
    """llama-server with the target's GGUF and the head as an EAGLE-3 draft, at each K, between two runs of the
    target alone (one thread: see `check_with_llama_cpp`): accepted / drafted, tok/s and the ratio to the mean of
    the target alone, and whether the greedy text equals the target alone's on every prompt."""
    from draftsmith.decode.runtime.loading import load
    from draftsmith.decode.prompts import load_suite
    from draftsmith.decode.textgen import prompt_ids
    from draftsmith.distill.export import target_gguf_for
    from draftsmith.distill.export.llama_cpp import beside_target_alone

    t_gguf = target_gguf_for(target, target_gguf)
    if t_gguf is None:
        raise DraftsmithError(f"serving a head needs the target's GGUF: {target!r} is no zoo name or .gguf; "
                              "give target_gguf")
    tok = load(target).tokenizer
    prompts = [prompt_ids(tok, load_suite(s)[0].prompt) for s in ("code", "chat", "json", "summarize")][:n_prompts]
    drafts = {str(k): {"draft_gguf": head_gguf, "draft_max": k, "spec_type": "draft-eagle3"} for k in ks}
    runs, baseline = beside_target_alone(t_gguf, drafts, prompts, n_predict)
    return {"target_gguf": str(t_gguf), "head_gguf": str(head_gguf), "prompts": len(prompts), "n_predict": n_predict,
            "target_alone_tokens_per_s": baseline["runs_tokens_per_s"],
            "target_alone_mean_tokens_per_s": baseline["tokens_per_s"], "target_alone_contents": baseline["contents"],
            "runs": runs, "server_version": baseline["server_version"]}
