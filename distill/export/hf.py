"""The Hugging Face folder of an export: the draft (LoRA merged) with the target's tokenizer files and a generation
config, and its checks (reloaded logits equal the in-memory model's; HF assisted generation with it is
greedy-equal to the target alone).

    from draftsmith.distill.export.hf import export_hf
    result = export_hf(model, target, Path("out/hf"), k=3, prompts=prompts, max_new_tokens=32, failed=failed)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from draftsmith.decode.runtime.io import atomic_dir
from draftsmith.decode.runtime.loading import Loaded, eos_ids
from draftsmith.distill.export.gguf import logits_diff

HF_RELOAD_TOL = 1e-5  # the same float32 weights, read back: any difference is a bug


def write_hf(model: Any, target: Loaded, dest: Path, k: int) -> None:
    """config.json + model.safetensors (float32) + the target's tokenizer files + generation_config.json,
    replacing `dest` atomically. The generation config asks HF assisted generation for a constant K."""
    with atomic_dir(dest) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        target.tokenizer.save_pretrained(tmp)
        gen = copy.deepcopy(target.model.generation_config)
        gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = k, "constant"
        gen.save_pretrained(tmp)


@torch.inference_mode()
def assisted_greedy(target: Loaded, draft_model: Any, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """HF `generate(assistant_model=draft)` vs `generate()` alone, greedy, per prompt."""
    eos = eos_ids(target)
    kw = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
              pad_token_id=target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0])
    assist: dict[str, Any] = {"assistant_model": draft_model}
    same_rows = draft_model.config.vocab_size == target.model.config.vocab_size
    if not same_rows:  # transformers then insists on its text-level ("universal") path, given both tokenizers
        assist.update(tokenizer=target.tokenizer, assistant_tokenizer=target.tokenizer)
    rows = []
    for ids in prompts:
        x = torch.tensor([ids])
        ref = target.model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids):].tolist()
        out = target.model.generate(x, attention_mask=torch.ones_like(x), **assist, **kw)[0, len(ids):].tolist()
        rows.append({"tokens": len(ref), "equal": out == ref})
    return {"equal": all(r["equal"] for r in rows), "prompts": len(rows), "per_prompt": rows,
            "mode": "token-level" if same_rows else "universal (vocab sizes differ)"}


def export_hf(model: Any, target: Loaded, hf_dir: Path, k: int, prompts: list[list[int]], max_new_tokens: int,
              failed: list[str]) -> dict:
    """Write the folder, reload it and check it; a failed check is appended to `failed`. Returns what export.json
    records under "hf"."""
    from transformers import AutoModelForCausalLM

    write_hf(model, target, hf_dir, k)
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    checks = {"reload": logits_diff(model, reloaded, prompts),
              "assisted_greedy": assisted_greedy(target, reloaded, prompts, max_new_tokens)}
    if checks["reload"]["max_abs_diff"] > HF_RELOAD_TOL:
        failed.append(f"HF reload: max |logit diff| {checks['reload']['max_abs_diff']:.3g} > {HF_RELOAD_TOL}")
    if not checks["assisted_greedy"]["equal"]:
        failed.append("HF assisted generation is not greedy-equal to the target")
    return {"path": str(hf_dir), "files": sorted(p.name for p in hf_dir.iterdir()), "checks": checks}


__all__ = ["HF_RELOAD_TOL", "assisted_greedy", "export_hf", "write_hf"]
