"""Runners: a model behind the two calls the decoder needs, `forward(tokens, pos)` and `max_seq_len`.

`forward(tokens, pos, keep=0)` feeds tokens (T,) at positions [pos, pos+T) and returns logits (T, V) in
float32 (float64 for float64 models); `keep=n > 0` returns only the last n rows (a prefill needs one).
The KV cache then holds positions [0, pos+T); calling forward again with a smaller `pos` rolls the
cache back to that prefix: nothing before `pos` is recomputed.

- `decode.runtime.lean.LeanLM`: the lean runner for Llama-family models (Llama, Qwen2, Mistral): a preallocated KV
  cache over the HF model's own weights, and tree verification for sibling rounds.
- `HFRunner` (here): the generic runner, any Hugging Face causal LM (Gemma3 and the rest) with HF's own
  DynamicCache, cropped on rollback.

`make_runner` picks the lean one where it applies. `quantize="int8"` gives a draft with dynamically quantised int8
Linear weights (`decode.runtime.quant`).

`runner.capture_layers = (i, j, k)` (both runners; a draft head's aux layers) makes every forward also keep
`runner.last_hidden` (T, 3H): the residual stream entering those layers (HF's `output_hidden_states[i]`) for
the T positions it computed, concatenated in that order; `()` (the default) keeps nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from draftsmith.decode.runtime.quant import Calibration


class Runner(Protocol):
    vocab_size: int
    max_seq_len: int

    def forward(self, tokens: Tensor, pos: int, keep: int = 0) -> Tensor: ...


class HFRunner:
    """Any Hugging Face causal LM, with HF's DynamicCache cropped back to `pos` on rollback."""

    capture_layers: tuple[int, ...] = ()
    last_hidden: Tensor | None = None

    def __init__(self, hf_model, max_seq_len: int) -> None:
        from transformers import DynamicCache

        self.model = hf_model.eval()
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        self.max_seq_len = max_seq_len
        self._new_cache = lambda: DynamicCache(config=hf_model.config)
        self.cache = self._new_cache()

    @torch.inference_mode()
    def forward(self, tokens: Tensor, pos: int, keep: int = 0) -> Tensor:
        cached = self.cache.get_seq_length()
        if pos == 0:
            self.cache = self._new_cache()
        elif cached > pos:
            self.cache.crop(-(cached - pos))
        elif cached < pos:
            raise ValueError(f"cache holds {cached} positions, cannot continue at {pos}")
        T = tokens.shape[0]
        positions = torch.arange(pos, pos + T, device=tokens.device)
        out = self.model(
            input_ids=tokens[None], cache=self.cache, use_cache=True,
            cache_position=positions, position_ids=positions[None], logits_to_keep=keep,
            output_hidden_states=bool(self.capture_layers),
        )
        if self.capture_layers:
            self.last_hidden = torch.cat([out.hidden_states[i][0] for i in self.capture_layers], dim=-1)
        logits = out.logits[0]
        return logits if logits.dtype == torch.float64 else logits.float()


def make_runner(hf_model, max_seq_len: int, *, lean: bool | None = None, quantize: str | None = None,
                calib: Calibration | None = None) -> Runner:
    """The fastest exact runner for `hf_model` (lean when the architecture allows, else HF's own); `calib` (int4
    only) rounds the int4 weights by GPTQ on those sequences (`decode.runtime.quant.quantize_int4`), unless the
    model's folder carries its own int4 groups (`decode.runtime.quant.stored_int4_groups`), which then serve."""
    # imported here, not at the top: the decoder needs only `Runner`, and importing it must not load the kernels
    from draftsmith.decode.runtime.allocator import release_freed_memory
    from draftsmith.decode.runtime.lean import LeanLM, lean_supported
    from draftsmith.decode.runtime.plan import plan_rows
    from draftsmith.decode.runtime.quant import quantize_int4, quantize_int8, stored_int4_groups

    supported, why = lean_supported(hf_model.config)
    if lean is None:
        lean = supported
    elif lean and not supported:
        raise ValueError(f"lean runner unavailable: {why}")
    runner: Runner = (
        LeanLM(hf_model, max_seq_len, fast_head=quantize in (None, "none")) if lean else HFRunner(hf_model, max_seq_len)
    )
    if quantize == "int8":
        runner = quantize_int8(runner)
    elif quantize == "int4":
        if not lean:
            raise ValueError("int4 quantisation needs the lean runner")
        # a folder training wrote carries the int4 groups its weights are exactly (`distill.groups`): those
        runner = quantize_int4(runner, calib, stored_int4_groups(hf_model, runner))
    elif quantize not in (None, "none"):
        raise ValueError(f"unknown quantisation {quantize!r} (choose int8, int4 or none)")
    if quantize not in (None, "none"):
        release_freed_memory()  # the float copy it quantised, freed, would otherwise stay in the process's heap
    if lean:  # pad few-row forwards to the row count this machine runs fastest (`decode.runtime.plan.plan_rows`)
        nbytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
        from draftsmith.decode.runtime.zoo import cache_dir

        key = (hf_model.config.name_or_path, hf_model.config.num_hidden_layers, nbytes, quantize)
        plan_rows(runner, key, nbytes, store=cache_dir() / "plans")
    return runner
