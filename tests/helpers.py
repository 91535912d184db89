"""Tiny real models for tests: a word-level tokenizer and random Llamas, built in milliseconds.

    tok = word_tokenizer([*WORDS, "<eos>", "[UNK]"], eos="<eos>")      # id = position in the list
    target = tiny_loaded(0, tmp_path / "target", tok, eos_id=EOS)      # a Loaded, config saved in the folder
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from decode.loading import Loaded


def word_tokenizer(tokens: list[str], *, eos: str, unk: str = "[UNK]", bos: str | None = None,
                   split_punctuation: bool = False) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose ids are the positions in `tokens` (which must hold `eos`, `unk`, `bos`).
    Words are split on whitespace, and on punctuation too with `split_punctuation`."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace() if split_punctuation else pre_tokenizers.WhitespaceSplit()
    special = {"eos_token": eos, "unk_token": unk} | ({"bos_token": bos} if bos is not None else {})
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def tiny_llama(seed: int, vocab_size: int, *, eos_id: int, bos_id: int | None = None, layers: int = 2,
               max_positions: int = 256, head_scale: float = 8.0, dtype: torch.dtype = torch.float32):
    """A random Llama (hidden 32, 4 heads, 2 KV heads) in eval mode; the LM head is scaled by `head_scale`
    so that its logits are peaky and the text it writes varies from token to token."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.generation_config.eos_token_id = eos_id
    return model


def tiny_loaded(seed: int, folder: Path, tokenizer: PreTrainedTokenizerFast, *, eos_id: int, layers: int = 2,
                dtype: torch.dtype = torch.float32) -> Loaded:
    """`tiny_llama` with one row per id up to `eos_id` (the last one), its config saved in `folder` as a real
    model's is (weights stay in memory)."""
    model = tiny_llama(seed, eos_id + 1, eos_id=eos_id, layers=layers, dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    return Loaded(model=model, tokenizer=tokenizer, path=folder, name=folder.name)
