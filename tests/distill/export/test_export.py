"""Export on tiny random Llama and Qwen2 models: the HF folder reloads to the same logits and assists greedily
without changing the output, the GGUF round-trips through transformers' own GGUF loader (F32 exactly, F16 and
Q8_0 within tolerance), llama.cpp's draft rule refuses by clause, and the serving lines carry K and the path.

    .venv/bin/python -m pytest tests/distill/export/test_export.py -q

The target GGUF here is metadata only (the tokenizer, written below as llama.cpp's converter would): export
reads nothing else from it. transformers loads a draft GGUF without a usable tokenizer (it reads the model's
config and tensors only), so tiny fake vocabularies suffice.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

import draftsmith.distill.export.gguf as gx
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.prompts import load_suite
from draftsmith.distill.export import GGUF_TOL, ExportConfig, choose_k, export, load_draft, provenance
from draftsmith.distill.export.gguf import logits_diff, permute_qk, tensor_type, unpermute_qk, verify_gguf, write_gguf

SPECIALS = ["<unk>", "<s>", "</s>"]
VOCAB = 300


def bpe_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE (llama.cpp's 'gpt2' vocab type, like SmolLM2's and Qwen's) trained on the prompt suites."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.prompt for s in ("code", "chat", "json", "summarize") for p in load_suite(s)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def target_vocab_gguf(path: Path, tok: PreTrainedTokenizerFast, *, n_tokens: int | None = None) -> Path:
    """A metadata-only 'target GGUF': the tokenizer keys llama.cpp's converter writes for a gpt2-type vocab."""
    import gguf

    n = n_tokens or len(tok)
    tokens = tok.convert_ids_to_tokens(list(range(len(tok)))) + [f"[PAD{i}]" for i in range(len(tok), n)]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(arch: str, seed: int, layers: int, rows: int = VOCAB):
    """Random model with peaky logits (so argmax is decisive) and dims that split into Q8_0 blocks of 32."""
    torch.manual_seed(seed)
    common = dict(vocab_size=rows, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = LlamaConfig(**common, tie_word_embeddings=True) if arch == "llama" else Qwen2Config(
        **common, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)  # std 0.1: logits of a few units, like a trained model's scale relative to its diffs
            elif p.dim() == 1 and p.abs().sum() > 0:
                p.add_(0.1 * torch.randn_like(p))  # norms not all 1 and biases not 0: a permutation error shows
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    return model


def save(model, tok, folder: Path) -> Path:
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    tok = bpe_tokenizer()
    prompts = [tok(p.prompt)["input_ids"][:40] for p in load_suite("code")[:2]]
    return {"root": root, "tok": tok, "target_gguf": target_vocab_gguf(root / "target.gguf", tok), "prompts": prompts,
            "llama_target": save(tiny_model("llama", 0, 2), tok, root / "llama_target"),
            "llama_draft": save(tiny_model("llama", 1, 1), tok, root / "llama_draft")}


# ---------------------------------------------------------------------------------------------
# Pure pieces


def test_qk_permutation_interleaves_halves_per_head_and_round_trips() -> None:
    rows = np.arange(2 * 4, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)  # 2 heads, head_dim 4
    assert permute_qk(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # (x0, x1 | y0, y1) -> x0 y0 x1 y1
    w = np.random.default_rng(0).standard_normal((6 * 16, 64)).astype(np.float32)
    for heads in (6, 3, 2):  # query heads and grouped KV heads
        assert np.array_equal(unpermute_qk(permute_qk(w, heads), heads), w)
        assert not np.array_equal(permute_qk(w, heads), w)
    bias = np.arange(32, dtype=np.float32)
    assert np.array_equal(unpermute_qk(permute_qk(bias, 2), 2), bias)


def test_tensor_types_follow_llama_cpp() -> None:
    assert tensor_type("blk.0.attn_norm.weight", (64,), "q8_0") == "F32"  # 1-D stays F32 in every type
    assert tensor_type("blk.0.attn_q.bias", (64,), "f16") == "F32"
    assert tensor_type("blk.0.attn_q.weight", (64, 64), "f16") == "F16"
    assert tensor_type("blk.0.attn_q.weight", (64, 64), "q8_0") == "Q8_0"
    assert tensor_type("blk.0.ffn_down.weight", (64, 48), "q8_0") == "F16"  # rows not in 32-blocks: F16
    assert tensor_type("token_embd.weight", (300, 64), "f32") == "F32"
    with pytest.raises(DraftsmithError, match="q4_0"):
        tensor_type("x", (64, 64), "q4_0")


def test_k_and_provenance_come_from_the_distill_run(tmp_path: Path) -> None:
    (tmp_path / "best").mkdir()
    run = {"target": "t", "data_source": "target", "config": {"loss": "fkl"}, "alpha_before": 0.1, "alpha_after": 0.3,
           "speed": {"k": 4, "prompts": 2, "tok_per_s": {"target_only": 10.0, "draft_after": 12.0},
                     "speedup_vs_target_only": {"draft_after": 1.2}}}
    (tmp_path / "distill.json").write_text(json.dumps(run))
    prov = provenance(tmp_path / "best", None)
    assert (prov["loss"], prov["alpha_after"], prov["speedup"], prov["k_measured"]) == ("fkl", 0.3, 1.2, 4)
    assert choose_k(None, prov)[0] == 4 and choose_k(7, prov) == (7, "given (--best-k)")
    assert choose_k(None, provenance(tmp_path / "best", {"best_k": 2}))[0] == 2  # info wins
    (tmp_path / "other").mkdir()  # not the run's best/: the run's numbers are not this draft's
    assert choose_k(None, provenance(tmp_path / "other", None)) == (3, "not measured (default 3)")


# ---------------------------------------------------------------------------------------------
# GGUF round trip through transformers' GGUF loader


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_round_trip_within_tolerance(world, arch: str, tmp_path: Path) -> None:
    model = tiny_model(arch, 3, 2)
    for t in ("f32", "f16", "q8_0"):
        path = tmp_path / f"draft-{t}.gguf"
        s = write_gguf(model, world["tok"], path, target_gguf=world["target_gguf"], gguf_type=t)
        check = verify_gguf(path, model, world["prompts"], s["expected"])
        assert check["read_back"]["ok"], check["read_back"]["problems"]
        assert check["read_back"]["n_vocab"] == VOCAB and s["llama_cpp_rule"]["passes"]
        lg, (rel, top1) = check["logits"], GGUF_TOL[t]
        assert lg["rel_max_abs_diff"] <= rel and lg["top1_agreement"] >= top1, (t, lg)
        if t == "f32":
            assert lg["max_abs_diff"] < 1e-4, lg  # float32 all the way: only summation order may differ
        head = "output.weight" in s["expected"]
        assert head == (arch == "qwen2")  # a tied head is left out, as llama.cpp expects


def test_a_missing_llama_permutation_is_caught(world, tmp_path: Path, monkeypatch) -> None:
    model = tiny_model("llama", 3, 2)
    monkeypatch.setattr(gx, "permute_qk", lambda w, n: w)  # what a converter that forgets the permutation writes
    s = write_gguf(model, world["tok"], tmp_path / "bad.gguf", target_gguf=world["target_gguf"], gguf_type="f32")
    lg = verify_gguf(tmp_path / "bad.gguf", model, world["prompts"], s["expected"])["logits"]
    assert lg["rel_max_abs_diff"] > 100 * GGUF_TOL["f16"][0]


def test_rule_refuses_a_vocab_size_beyond_128_rows(world, tmp_path: Path) -> None:
    model = tiny_model("llama", 4, 1, rows=VOCAB + 200)
    with pytest.raises(DraftsmithError, match=r"llama.cpp would refuse.*n_vocab difference 200 > 128"):
        write_gguf(model, world["tok"], tmp_path / "x.gguf", target_gguf=world["target_gguf"])
    assert not list(tmp_path.iterdir())  # refused before writing anything


def test_rule_refuses_a_draft_with_another_tokenizer(world, tmp_path: Path) -> None:
    other = bpe_tokenizer(VOCAB - 20)  # same training text, fewer merges: ids past 280 hold other tokens
    model = tiny_model("llama", 4, 1)
    with pytest.raises(DraftsmithError, match="token text differs"):
        write_gguf(model, other, tmp_path / "x.gguf", target_gguf=world["target_gguf"])


def test_padding_rows_within_128_are_written_as_pad_tokens(world, tmp_path: Path) -> None:
    from gguf import GGUFReader

    model = tiny_model("llama", 4, 1, rows=VOCAB + 20)
    s = write_gguf(model, world["tok"], tmp_path / "x.gguf", target_gguf=world["target_gguf"], gguf_type="f32")
    tokens = GGUFReader(tmp_path / "x.gguf").fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == VOCAB + 20 and tokens[-1] == f"[PAD{VOCAB + 19}]" and s["llama_cpp_rule"]["passes"]


# ---------------------------------------------------------------------------------------------
# The whole verb


def test_export_all_writes_checked_hf_folder_gguf_and_report(world, tmp_path: Path) -> None:
    out = tmp_path / "out"
    s = export(str(world["llama_draft"]), str(world["llama_target"]), out,
               ExportConfig(gguf_types=["f16", "q8_0"], target_gguf=str(world["target_gguf"])), n_prompts=2,
               max_new_tokens=12, progress=False)
    assert s["ok"] and json.loads((out / "export.json").read_text())["ok"]
    hf = out / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= {
        p.name for p in hf.iterdir()}
    assert json.loads((hf / "tokenizer.json").read_text())["model"]["vocab"] == json.loads(
        (world["llama_target"] / "tokenizer.json").read_text())["model"]["vocab"]  # the target's tokenizer
    assert s["hf"]["checks"]["reload"]["max_abs_diff"] == 0.0
    assert s["hf"]["checks"]["assisted_greedy"]["equal"] and s["hf"]["checks"]["assisted_greedy"]["prompts"] == 2
    assert [g["gguf_type"] for g in s["gguf"]] == ["f16", "q8_0"] and (out / "draft-q8_0.gguf").is_file()
    assert (s["best_k"], s["best_k_source"]) == (3, "not measured (default 3)")
    card = (out / "README.md").read_text()
    assert "not measured" in card and "num_speculative_tokens" in card and str((out / "hf").resolve()) in card
    assert s["warnings"] == []


def test_export_hf_only_warns_about_vllm_vocab_and_merges_a_lora_adapter(world, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = save(tiny_model("qwen2", 5, 1, rows=VOCAB + 4), world["tok"], tmp_path / "base")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")  # adapter_config.json names `base` as base_model_name_or_path
    loaded, merged = load_draft(str(tmp_path / "adapter"))
    assert logits_diff(peft_model.eval(), merged, world["prompts"])["max_abs_diff"] < 1e-5
    s = export(str(tmp_path / "adapter"), str(world["llama_target"]), tmp_path / "out",
               ExportConfig(formats=["hf"], best_k=4), n_prompts=1, max_new_tokens=8, progress=False)
    assert "vLLM requires equal vocabulary sizes" in s["warnings"][0] and s["gguf"] == []
    assert '"num_speculative_tokens": 4' in s["serving"]["vllm"] and "llama_cpp" not in s["serving"]
    assert json.loads((tmp_path / "out" / "hf" / "generation_config.json").read_text())["num_assistant_tokens"] == 4


def test_gguf_export_of_an_hf_target_needs_its_gguf(world, tmp_path: Path) -> None:
    with pytest.raises(DraftsmithError, match="needs the target's GGUF"):
        export(str(world["llama_draft"]), str(world["llama_target"]), tmp_path, ExportConfig(formats=["gguf"]),
               progress=False)


def test_export_refuses_before_writing_when_llama_cpp_would(world, tmp_path: Path) -> None:
    wide = save(tiny_model("llama", 6, 1, rows=VOCAB + 200), world["tok"], tmp_path / "wide")
    with pytest.raises(DraftsmithError, match="n_vocab difference 200 > 128"):
        export(str(wide), str(world["llama_target"]), tmp_path / "out",
               ExportConfig(target_gguf=str(world["target_gguf"])), progress=False)
    assert not (tmp_path / "out").exists()  # not even the HF folder


def test_llama_cpp_check_compares_each_draft_with_the_target_alone_before_and_after(world, tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """The orchestration around llama-server (the real engine runs in tests/distill/export/test_llama_cpp.py): the
    target alone is served before and after the drafts, the ratio uses their mean, text is compared."""
    import draftsmith.distill.export.llama_cpp as lc

    calls = []

    def fake_server(target_gguf, draft_gguf, prompts, n_predict=64, draft_max=3, **kw):
        calls.append(Path(draft_gguf).name if draft_gguf else None)
        alone = draft_gguf is None
        tps = {None: 20.0 if calls.count(None) == 1 else 30.0, "draft-f16.gguf": 50.0, "draft-q8_0.gguf": 10.0,
               "before-f16.gguf": 40.0}
        contents = [f"text {i}" for i in range(len(prompts))]
        if not alone and "q8_0" in str(draft_gguf):
            contents[0] = "other text"
        drafted = 0 if alone else 12
        return {"drafted": drafted, "accepted": 0 if alone else 6, "acceptance": None if alone else 0.5,
                "prompts": len(prompts), "per_prompt": [], "predicted_n": 64 * len(prompts),
                "tokens_per_s": tps[calls[-1]], "draft_max": None if alone else draft_max, "contents": contents,
                "server_version": "fake", "command": "llama-server ..."}

    monkeypatch.setattr(lc, "check_with_llama_cpp", fake_server)
    import draftsmith.distill.export as ex  # the prediction beside it: test_llama_cpp_prediction_orchestration below
    monkeypatch.setattr(ex, "predict_llama_cpp", lambda *a, **kw: None)
    out = tmp_path / "out"
    s = export(str(world["llama_draft"]), str(world["llama_target"]), out,
               ExportConfig(formats=["gguf"], gguf_types=["f16", "q8_0"], target_gguf=str(world["target_gguf"]),
                            check_llama_cpp=True), n_prompts=2, progress=False)
    assert calls == [None, "draft-f16.gguf", "draft-q8_0.gguf", None]
    base = s["llama_cpp_target_only"]
    assert base["runs_tokens_per_s"] == [20.0, 30.0] and base["tokens_per_s"] == 25.0
    assert s["llama_cpp"]["f16"]["speedup_vs_target_only"] == 2.0
    assert s["llama_cpp"]["q8_0"]["speedup_vs_target_only"] == 0.4
    assert s["llama_cpp"]["f16"]["greedy_equal"] == {"prompts": 2, "equal": 2}
    assert s["llama_cpp"]["q8_0"]["greedy_equal"] == {"prompts": 2, "equal": 1}
    assert s["ok"] and any("differs from the target alone on 1 of 2" in w for w in s["warnings"])
    card = (out / "README.md").read_text()
    assert "50.0 tok/s vs 25.0 for the target alone (20.0, 30.0): 2.00x" in card
    # with the un-distilled draft beside it: its GGUF is written here (not a zoo model) and served in the same check
    calls.clear()
    s = export(str(world["llama_draft"]), str(world["llama_target"]), tmp_path / "out2",
               ExportConfig(formats=["gguf"], gguf_types=["f16"], target_gguf=str(world["target_gguf"]),
                            check_llama_cpp=True), n_prompts=2, before=str(world["llama_draft"]), progress=False)
    assert calls == [None, "draft-f16.gguf", "before-f16.gguf", None]
    assert set(s["llama_cpp"]) == {"f16"} and (tmp_path / "out2" / "before-f16.gguf").is_file()
    b = s["llama_cpp_before"]
    assert b["draft"] == str(world["llama_draft"]) and b["gguf_source"] == "written here (f16)"
    assert b["draft_max"] == s["llama_cpp"]["f16"]["draft_max"] and b["speedup_vs_target_only"] == 1.6
    searched = {}
    monkeypatch.setattr(lc, "search_llama_cpp", lambda t, drafts, prompts, **kw: searched.update(drafts) or {})
    export(str(world["llama_draft"]), str(world["llama_target"]), tmp_path / "out3",
           ExportConfig(formats=["gguf"], gguf_types=["f16"], target_gguf=str(world["target_gguf"]),
                        check_llama_cpp=True, llama_cpp_search=True), n_prompts=2, before=str(world["llama_draft"]),
           progress=False)
    assert {k: v.name for k, v in searched.items()} == {"draftsmith f16": "draft-f16.gguf",
                                                        "before before-f16.gguf": "before-f16.gguf"}


def test_llama_cpp_prediction_orchestration(world, tmp_path: Path, monkeypatch) -> None:
    """predict_llama_cpp around a fake llama-server and llama-bench (the real ones: test_llama_cpp.py): our
    acceptance and decoder run for real on the served prompts, calibration runs on other prompts, every K is
    predicted and served, and a llama.cpp acceptance far from our decoder's is flagged."""
    import draftsmith.distill.export.llama_cpp as lc
    from draftsmith.decode.runtime.loading import load
    from draftsmith.distill.export import predict_llama_cpp

    calls = []

    def fake_server(target_gguf, draft_gguf, prompts, n_predict=64, draft_max=3, **kw):
        calls.append((draft_max if draft_gguf else None, prompts[0]))
        n = n_predict * len(prompts)
        drafted = 0 if draft_gguf is None else (n // 2) * draft_max
        return {"drafted": drafted, "accepted": drafted // 20, "prompts": len(prompts), "predicted_n": n,
                "predicted_ms": 1000.0 * n / (20.0 if draft_gguf is None else 18.0), "per_prompt": [],
                "tokens_per_s": 20.0 if draft_gguf is None else 18.0, "contents": ["x"] * len(prompts),
                "draft_max": draft_max if draft_gguf else None,
                "server_version": "fake", "command": "llama-server ..."}

    monkeypatch.setattr(lc, "check_with_llama_cpp", fake_server)
    monkeypatch.setattr(lc, "find_llama_server", lambda **kw: Path("/nowhere/llama-server"))
    monkeypatch.setattr(lc, "server_version", lambda server: "fake")
    monkeypatch.setattr(lc, "llama_bench", lambda gguf, prompt_sizes=(), **kw: {1: 0.04, **{n: 0.05 + 0.002 * n
                                                                                         for n in prompt_sizes}})
    tgt, draft = load(str(world["llama_target"])), load(str(world["llama_draft"]))
    warnings: list[str] = []
    pred = predict_llama_cpp(tgt, draft, world["target_gguf"], tmp_path / "d.gguf", [1, 2, 4], 2, warnings, False)
    assert [r["k"] for r in pred["curve"]] == [1, 2, 4] and [r["k"] for r in pred["parity"]] == [1, 2, 4]
    measured, calibration = pred["runs"]["1"], [c for c in calls[:3]]
    assert [k for k, _ in calibration] == [None, 1, 3]  # the target alone, then the draft at K = 1 and 3
    assert all(p != pred_p for _, p in calibration for pred_p in [calls[3][1]])  # other prompts than the measured
    assert [k for k, _ in calls[3:]] == [None, 1, 2, 4, None]
    c = pred["cost"]
    assert c["draft_step_s"] == 0.04 and c["verify_s"]["2"] == pytest.approx(0.056)
    assert c["target_token_s"] == pytest.approx(1 / 20.0 * 32 * 2 / (32 * 2 - 2))  # 32 tokens a calibration prompt
    for row in pred["curve"]:
        assert row["measured"] == pytest.approx(18.0 / 20.0)
        assert row["predicted"] == pytest.approx(row["tau"] * c["target_token_s"] / c["round_s"][str(row["k"])])
    assert measured["speedup_vs_target_only"] == pytest.approx(0.9) and "contents" not in measured
    dec = pred["parity"][0]
    assert dec["decoder_counts"][1] > 0 and 0 <= dec["expected"] <= 1
    # greedy, standalone: the teacher-forced walk is the decoder's walk (same rows, same rounds)
    assert all(r["expected"] == pytest.approx(r["decoder"], abs=0.02) for r in pred["parity"])
    # the fake server accepts 1 in 20; the tiny draft agrees with its tiny target far less or far more: either
    # way the row says so, and a flag becomes a warning
    assert pred["parity_flagged"] == [r["k"] for r in pred["parity"] if r["flagged"]]
    assert bool(pred["parity_flagged"]) == any("parity gap" in w for w in warnings)
    assert pred["decoder_greedy_equal"]["decodes"] == 2 * 3
    assert pred["decoder_greedy_equal"]["equal"] == 2 * 3  # our decoder is exact
    assert "predicted best" in pred["verdict"]
