"""Serving lines carry the draft, the target and K where each engine expects them; the model card states
measured numbers, says "not measured" where nothing was measured, and names every failed check."""

from __future__ import annotations

import json

from draftsmith.distill.export.model_card import model_card, serving_lines


def test_serving_lines_carry_k_and_paths() -> None:
    lines = serving_lines("/m/target", "/out/hf", "/m/t.gguf", "/out/draft-f16.gguf", 5)
    spec = json.loads(lines["vllm"].split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "draft_model", "model": "/out/hf", "num_speculative_tokens": 5}
    assert lines["vllm"].startswith("vllm serve /m/target ")
    s = lines["sglang"]
    assert "--model-path /m/target" in s and "--speculative-algorithm STANDALONE" in s
    assert "--speculative-draft-model-path /out/hf" in s and "--speculative-num-steps 5" in s
    assert "--speculative-num-draft-tokens 6" in s and "--speculative-eagle-topk 1" in s
    assert "-m /m/t.gguf -md /out/draft-f16.gguf" in lines["llama_cpp"] and " 5 " in lines["llama_cpp"]
    assert set(serving_lines("/m/target", None, None, None, 3)) == set()


def test_serving_lines_quote_paths_with_spaces() -> None:
    lines = serving_lines("/m/my target", "/out/my hf", "/m/t 1.gguf", "/out/d 1.gguf", 2)
    assert "vllm serve '/m/my target' " in lines["vllm"]
    assert "--speculative-draft-model-path '/out/my hf'" in lines["sglang"]
    assert "-m '/m/t 1.gguf' -md '/out/d 1.gguf'" in lines["llama_cpp"]


def _summary(**provenance) -> dict:
    return {"target": "smollm2-135m-instruct", "draft": "runs/x/best", "target_hf": "/m/target", "best_k": 3,
            "best_k_source": "measured", "provenance": provenance, "warnings": [],
            "serving": serving_lines("/m/target", "/out/hf", None, None, 3)}


def test_card_states_measured_numbers_and_says_what_was_not_measured() -> None:
    card = model_card(_summary(data_source="target", train_prompts=124, loss="fkl", alpha_before=0.037,
                               alpha_after=0.25, speedup=1.17, speedup_detail="K=3, 4 prompts"))
    assert card.startswith("# Draft model for `smollm2-135m-instruct`")
    assert "the target's own generations on 124 training prompts" in card
    assert "0.037 -> 0.250" in card and "1.17x (K=3, 4 prompts)" in card and "| loss | fkl |" in card
    assert "num_speculative_tokens" in card and "llama.cpp" not in card  # no GGUF, no llama.cpp line

    bare = model_card({**_summary(), "warnings": ["vocab padded"], "failed": ["gguf f16: logits differ"]})
    assert "not measured -> not measured" in bare and "| measured speedup | not measured |" in bare
    assert "> **Warning:** vocab padded" in bare and "- **FAILED:** gguf f16: logits differ" in bare


def test_card_compares_llama_cpp_acceptance_with_what_alpha_predicts() -> None:
    summary = _summary(alpha_after=0.5) | {"llama_cpp": {"f16": {"draft_max": 3, "accepted": 20, "drafted": 90,
                                                                 "acceptance": 20 / 90, "prompts": 4}}}
    card = model_card(summary)
    assert "20 of 90 drafted tokens accepted (0.222)" in card and "tok/s" not in card  # no baseline, no ratio
    assert f"{(0.5 + 0.25 + 0.125) / 3:.3f} at K = 3" in card  # (alpha + alpha^2 + alpha^3) / K

    summary["llama_cpp"]["f16"] |= {"tokens_per_s": 30.0, "greedy_equal": {"prompts": 4, "equal": 3}}
    summary["llama_cpp_target_only"] = {"tokens_per_s": 24.0, "runs_tokens_per_s": [25.0, 23.0]}
    card = model_card(summary)
    assert "30.0 tok/s vs 24.0 for the target alone (25.0, 23.0): 1.25x" in card
    assert "text equal to the target alone's on 3/4 prompts" in card
