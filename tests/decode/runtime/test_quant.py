"""`draft_quant`: the one rule for which drafts run with int8 weights (on the CPU, float32, lean-supported)."""

from __future__ import annotations

import torch

from draftsmith.decode.runtime.quant import draft_quant
from draftsmith.decode.runtime.runner import make_runner
from tests import helpers


def test_int8_only_for_a_float32_lean_draft_on_the_cpu() -> None:
    model = helpers.tiny_llama(0, 11)
    assert draft_quant(model) == draft_quant(model, "int8") == "int8"
    make_runner(model, 16, quantize=draft_quant(model))  # and the runner takes it
    assert draft_quant(model, None) is None and draft_quant(model, "none") is None  # not asked for
    assert draft_quant(helpers.tiny_llama(0, 11, dtype=torch.float64)) is None  # int8 drafts need float32
    assert draft_quant(helpers.tiny_llama(0, 11, hidden_act="gelu")) is None  # not the lean runner's
    assert draft_quant(helpers.tiny_llama(0, 11).to("meta")) is None  # not on the CPU (fbgemm is a CPU kernel)


def test_int8_runner_fuses_projections_and_computes_the_same_bits() -> None:
    """An int8 lean runner stacks q, k, v (with their biases: Qwen2) and gate, up into one Linear each before it
    quantises (per output row, so the same int8 rows and scales): its logits equal, bit for bit, those of the
    same runner quantised unfused, for a prompt, one-row steps and a multi-row forward."""
    import copy

    from draftsmith.decode.runtime.lean import LeanLM
    from draftsmith.decode.runtime.quant import quantize_int8, quantize_linears_int8

    model = helpers.tiny_llama(3, 300, layers=2, hidden=64, heads=4, kv_heads=2, arch="qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # biases are stacked too
    base = LeanLM(model, 64, fast_head=False)
    fused, plain = quantize_int8(base), quantize_linears_int8(copy.deepcopy(base))
    plain.native_many = fused.native_many  # the prompt on the same kernel (`quantize_int8` sets it where built)
    assert fused.layers[0].qkv is not None and fused.layers[0].q is None and plain.layers[0].qkv is None
    assert base.layers[0].qkv is None and base.layers[0].q is not None  # the float runner is left as it was
    ids = torch.arange(40) * 7 % 300
    outs = []
    for r in (fused, plain):
        outs.append([r.forward(ids[:20], 0), *(r.forward(ids[i : i + 1], i) for i in range(20, 24)),
                     r.forward(ids[24:30], 24)])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert not torch.equal(outs[0][0], base.forward(ids[:20], 0))  # int8: not the float runner's logits


def test_a_quantised_runner_reads_the_hf_models_embedding_and_quantises_a_tied_head_from_a_copy() -> None:
    """The quantised copy shares the input embedding with the HF model (read only; a Qwen 0.5B's is 545 MB) and
    quantises its own copy of a tied LM head: the HF model's weights are left as they were."""
    from draftsmith.decode.runtime.lean import LeanLM
    from draftsmith.decode.runtime.quant import quantize_int8

    model = helpers.tiny_llama(3, 300, layers=2, hidden=64, heads=4, kv_heads=2, arch="qwen2")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the Qwen 0.5B's
    before = model.model.embed_tokens.weight.detach().clone()
    q = quantize_int8(LeanLM(model, 64, fast_head=False))
    assert q.embed is model.model.embed_tokens
    assert type(q.lm_head) is not torch.nn.Linear  # the head quantised ...
    assert type(model.lm_head) is torch.nn.Linear and torch.equal(model.lm_head.weight, before)  # ... on a copy

