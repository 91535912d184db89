"""Tiny real models for tests: a word-level tokenizer and random Llamas (or Qwen2s), built in milliseconds.

    tok = word_tokenizer([*WORDS, "<eos>", "[UNK]"], eos="<eos>")      # id = position in the list
    model = tiny_llama(0, len(tok) - 1, eos_id=EOS, dtype=torch.float64)   # eval mode, weights fixed by the seed
    target = tiny_loaded(0, tmp_path / "target", tok, eos_id=EOS)      # a Loaded, config saved in the folder
    folder = save_tiny(tmp_path / "draft", tok, 1, layers=1)           # model + tokenizer as an HF folder

The seed alone fixes the weights: the same call gives the same model in every test file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from draftsmith.decode.runtime.loading import Loaded


def word_tokenizer(tokens: list[str], *, eos: str | None, unk: str = "[UNK]", bos: str | None = None,
                   split_punctuation: bool = False) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose ids are the positions in `tokens` (which must hold `eos`, `unk`, `bos`;
    `eos=None` for one without an end token). Words are split on whitespace, and on punctuation too with
    `split_punctuation`. No chat template."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace() if split_punctuation else pre_tokenizers.WhitespaceSplit()
    special = {"unk_token": unk} | ({"eos_token": eos} if eos is not None else {}) \
        | ({"bos_token": bos} if bos is not None else {})
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def tiny_llama(seed: int, vocab_size: int, *, eos_id: int | None = None, bos_id: int | None = None,
               layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, max_positions: int = 256,
               head_scale: float = 8.0, tied: bool = False, arch: str = "llama",
               dtype: torch.dtype = torch.float32, **config):
    """A random Llama (`arch="qwen2"`: a Qwen2) in eval mode: `hidden` wide (MLP 2x), `heads` query and
    `kv_heads` KV heads; the LM head is scaled by `head_scale` so that its logits are peaky and the text it
    writes varies from token to token (1.0 leaves the initialisation as it is). With `eos_id` the config's
    BOS/EOS/PAD are `bos_id`/`eos_id`/None and the generation config stops at `eos_id`; without it the
    config class's defaults stay. `config` goes to the config class as is (e.g. sliding-window settings)."""
    torch.manual_seed(seed)
    ids = {} if eos_id is None else {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None}
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    cfg = cls(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=tied, **ids, **config,
    )
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    if eos_id is not None:
        model.generation_config.eos_token_id = eos_id
    return model


def save_tiny(folder: Path, tokenizer: PreTrainedTokenizerFast, seed: int, *, vocab_size: int | None = None,
              **kwargs) -> Path:
    """`tiny_llama(seed, vocab_size or len(tokenizer), **kwargs)` and `tokenizer` saved as an HF folder."""
    tiny_llama(seed, len(tokenizer) if vocab_size is None else vocab_size, **kwargs).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_loaded(seed: int, folder: Path, tokenizer: PreTrainedTokenizerFast, *, eos_id: int, layers: int = 2,
                dtype: torch.dtype = torch.float32) -> Loaded:
    """`tiny_llama` with one row per id up to `eos_id` (the last one), its config saved in `folder` as a real
    model's is (weights stay in memory)."""
    model = tiny_llama(seed, eos_id + 1, eos_id=eos_id, layers=layers, dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    return Loaded(model=model, tokenizer=tokenizer, path=folder, name=folder.name)


def write_run_folder(run: Path, *, target: str = "tiny-target", candidates: dict[str, float] | None = None,
                     distilled: tuple[str, float, float] | None = None, bench: dict | None = None,
                     export: dict | None = None, domains: tuple[str, ...] = ("chat", "code")) -> Path:
    """A synthetic recipe run folder with the files the pair and distill stages write (no model involved).

    `candidates`: draft -> alpha for pairing/leaderboard.json (alpha the same in every domain; best K 3,
    c 0.1, predicted speedup 1 + alpha). `distilled`: (draft, alpha before, alpha after) for
    distill/distill.json and distill/log.jsonl (40 steps; evals at steps 0 and 40, domain alphas before/after
    offset by -/+0.05 around the overall alpha). `bench`, `export`: written as validate/bench.json and
    export/export.json as given.
    state.json marks every stage written as done."""
    import json

    run.mkdir(parents=True, exist_ok=True)
    stages = {}
    (run / "recipe.yaml").write_text(f"name: {run.name}\ntarget: {target}\n")
    if candidates is not None:
        cands = [{
            "draft": d, "kind": "same-tokenizer", "compatible": True, "params": 12.5, "alpha": a,
            "alpha_by_domain": {dom: a for dom in domains}, "positions": 100, "cost_ratio": 0.1,
            "verify_cost": {str(k): 1.0 + 0.1 * k for k in range(1, 17)}, "best_k": 3, "predicted_speedup": 1 + a,
            "measured_speedup": None, "llama_cpp_compatible": True,
        } for d, a in candidates.items()]
        board = {"target": target, "settings": {"domains": list(domains), "n_prompts": 8, "prompts": "code,chat",
                                                "max_new_tokens": 16, "temperature": 0.0},
                 "candidates": cands}
        (run / "pairing").mkdir(exist_ok=True)
        (run / "pairing" / "leaderboard.json").write_text(json.dumps(board))
        stages["pair"] = {"status": "done", "seconds": 12.0, "finished": "2026-01-01T00:00:12+00:00"}
    if distilled is not None:
        draft, before, after = distilled
        result = {"target": target, "draft": draft, "data_source": "target", "data_rows": 32, "train_prompts": 32,
                  "held_out_prompts": 8, "alpha_before": before, "alpha_after": after, "alpha_gain": after - before,
                  "config": {"loss": "fkl", "steps": 40, "batch_size": 4, "lr": 0.001, "lora_r": 0},
                  "train_summary": {"best_step": 40, "steps_done": 40}}
        log = [{"step": s, "loss": 2.0 - s / 40} for s in range(1, 41)]
        log += [{"step": s, "eval": True, "alpha": a, "alpha_by_domain": {domains[0]: a - 0.05, domains[1]: a + 0.05}}
                for s, a in ((0, before), (40, after))]
        (run / "distill").mkdir(exist_ok=True)
        (run / "distill" / "distill.json").write_text(json.dumps(result))
        (run / "distill" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
        stages["distill"] = {"status": "done", "seconds": 30.0, "finished": "2026-01-01T00:00:42+00:00"}
    if bench is not None:
        (run / "validate").mkdir(exist_ok=True)
        (run / "validate" / "bench.json").write_text(json.dumps(bench))
        stages["validate"] = {"status": "done", "seconds": 5.0, "finished": "2026-01-01T00:00:47+00:00"}
    if export is not None:
        (run / "export").mkdir(exist_ok=True)
        (run / "export" / "export.json").write_text(json.dumps(export))
        stages["export"] = {"status": "done", "seconds": 9.0, "finished": "2026-01-01T00:00:56+00:00"}
    (run / "state.json").write_text(json.dumps({"stages": stages}))
    return run


SCRIPT_WORDS = "the a of to and in is it that for on with as was be by this are or at from code data list sort print".split()


def script_world(root: Path, *, layers: int, per_domain: int, draft_layers: int | None = None) -> dict:
    """What a script's smoke run needs under `root`: a tiny random Llama target of `layers` layers with BOS / EOS
    and a word tokenizer (and a draft of `draft_layers` sharing it), a prompts file of `per_domain` prompts in each
    of code and chat, and a subprocess environment with a model cache of its own, one thread."""
    tok = word_tokenizer(["[UNK]", "<s>", "</s>", *SCRIPT_WORDS], eos="</s>", bos="<s>", split_punctuation=True)
    world = {"root": root, "target": str(save_tiny(root / "target", tok, 0, eos_id=2, bos_id=1, layers=layers,
                                                   head_scale=4.0))}
    if draft_layers is not None:
        world["draft"] = str(save_tiny(root / "draft", tok, 1, eos_id=2, bos_id=1, layers=draft_layers,
                                       head_scale=4.0))
    rows = [(d, " ".join(SCRIPT_WORDS[(5 * i + j) % len(SCRIPT_WORDS)] for j in range(2 + i % 3)))
            for i in range(per_domain) for d in ("code", "chat")]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in rows))
    world["prompts"] = str(prompts)
    world["env"] = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1", "DRAFTSMITH_CACHE": str(root / "cache")}
    return world

