"""The decoder's rounds one at a time (`chain_round`, `sibling_round`), checked against a greedy decode computed
independently: Hugging Face's own forward over the whole sequence at every step, no KV cache, no runner."""

from __future__ import annotations

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.speculative import KPolicy, RoundSettings, chain_round, generate, prefill, sibling_round
from tests.decode.test_speculative import Disagree, tiny_hf

PROMPT = [1, 5, 7, 9]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, each from a full forward of the HF model (ties to the lowest id)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class SecondBest(Disagree):
    """The target's logits with its top token pushed just below its runner-up: the draft's second choice is
    always the target's greedy token."""

    def forward(self, tokens, pos, keep=0):
        logits = self.runner.forward(tokens, pos, keep).clone()
        top2 = logits.topk(2, dim=-1)
        logits.scatter_(-1, top2.indices[..., :1], top2.values[..., 1:] - 1e-3)
        return logits


def noisy_copy(seed: int, noise: float):
    """The target (tiny_hf(seed, scale=8)) with its LM head perturbed: a draft that agrees often, not always."""
    hf = tiny_hf(seed, scale=8.0)
    with torch.no_grad():
        hf.lm_head.weight.add_(torch.randn(hf.lm_head.weight.shape, generator=torch.Generator().manual_seed(seed),
                                           dtype=hf.lm_head.weight.dtype) * noise)
    return hf


def test_chain_rounds_emit_the_target_greedy_continuation() -> None:
    """Round after round at temperature 0 (each with its own rollback of both caches), the tokens emitted are the
    target's greedy ones, whatever the draft got right; counts agree with what was emitted."""
    t_hf = tiny_hf(0, scale=8.0)
    ref = hf_greedy(t_hf, PROMPT, 40)
    target, draft = make_runner(t_hf, 128), make_runner(noisy_copy(0, 0.05), 128)
    st = prefill(target, draft, PROMPT, "cpu")
    rounds = []
    while len(st.seq) - len(PROMPT) < len(ref) - 5:
        r = chain_round(target, draft, st, 4, RoundSettings())
        assert r.drafted == r.steps == 4 and r.accepted == len(r.emitted) - 1 and 1 <= len(r.emitted) <= 5
        n = len(st.seq) - len(PROMPT)
        assert r.emitted == ref[n : n + len(r.emitted)], (n, r)
        st.advance(r.emitted)
        rounds.append(r)
    assert any(0 < r.accepted < r.drafted for r in rounds)  # partly accepted rounds: rollbacks were exercised
    assert any(r.accepted == r.drafted for r in rounds)  # and fully accepted ones (the draft cache lags one token)


def test_a_chain_round_with_a_draft_that_never_agrees_emits_one_target_token() -> None:
    t_hf = tiny_hf(1, scale=8.0)
    ref = hf_greedy(t_hf, PROMPT, 6)
    target = make_runner(t_hf, 64)
    draft = Disagree(make_runner(t_hf, 64))
    st = prefill(target, draft, PROMPT, "cpu")
    for n in range(6):
        r = chain_round(target, draft, st, 3, RoundSettings())
        assert (r.emitted, r.accepted, r.drafted) == ([ref[n]], 0, 3)
        st.advance(r.emitted)
    no_draft = prefill(target, None, PROMPT, "cpu")
    r = chain_round(target, None, no_draft, 0, RoundSettings())  # K = 0: one plain target step
    assert (r.emitted, r.accepted, r.drafted, r.steps) == ([ref[0]], 0, 0, 0)


def sibling_run(keep_path: bool = True) -> tuple[list[int], list[int], list]:
    """Sibling rounds (m = 3) with a draft whose second choice is the target's, each followed by a chain round
    (the same draft, rejected at once: one target token): (tokens, independent greedy reference, sibling rounds)."""
    t_hf = tiny_hf(3, scale=8.0)
    ref = hf_greedy(t_hf, PROMPT, 30)
    target = make_runner(t_hf, 128)
    if not keep_path:
        target.keep_path = lambda pos, rows: None
    draft = SecondBest(make_runner(t_hf, 128))
    how = RoundSettings(policy=KPolicy(k=2, confidence=0.5, siblings=3))
    st = prefill(target, draft, PROMPT, "cpu")
    sib = []
    while len(st.seq) - len(PROMPT) < 24:
        r = sibling_round(target, draft, st, 2, how)
        sib.append(r)
        st.advance(r.emitted)
        st.advance(chain_round(target, draft, st, 2, how).emitted)  # its target forward reads the moved KV
    return st.seq[len(PROMPT):], ref, sib


def test_a_sibling_round_accepts_the_second_choice_and_keeps_the_kv_path() -> None:
    """Each sibling round accepts the target's token through the tree's second candidate row (its KV moved next to
    the current token's) and adds the bonus from that row; the chain round after it, reading the moved KV, still
    gives the target's greedy tokens."""
    tokens, ref, sib = sibling_run()
    assert all((r.accepted, r.drafted, r.steps, len(r.emitted)) == (1, 3, 1, 2) for r in sib)
    assert tokens == ref[: len(tokens)]


def test_a_sibling_round_that_leaves_the_kv_in_the_tree_layout_fails_the_check() -> None:
    """Negative control: without `keep_path` the cache keeps the first candidate's KV where the accepted one's
    belongs, and the decode leaves the target's greedy path."""
    tokens, ref, _ = sibling_run(keep_path=False)
    assert tokens != ref[: len(tokens)]


def test_sibling_rounds_on_the_generic_runner_are_refused_in_plain_words() -> None:
    hf = tiny_hf(5)
    target = make_runner(hf, 64, lean=False)  # the generic HF runner, as Gemma-3 gets
    with pytest.raises(DraftsmithError, match="sibling rounds need the lean runner") as e:
        generate(target, [1, 2], draft=make_runner(hf, 64), max_new_tokens=4,
                 policy=KPolicy(k=2, confidence=0.5, siblings=2))
    message = str(e.value)
    assert "(llama)" in message and "generic runner (HFRunner)" in message and "use siblings 0" in message
    assert "\n" not in message and isinstance(e.value, ValueError)
