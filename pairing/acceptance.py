"""Teacher-forced acceptance: how much of each draft the target would accept, without decoding.

    refs = reference_continuations(target, prompts)
    for a in measure_acceptance(target, [load(d) for d in names], refs):
        print(a.draft, a.alpha, a.expected_tau[4])

Each reference row (prompt + the target's own continuation) is fed once through the target and once
through every draft, right-padded in batches. At every position that predicts a continuation token,
`beta = sum_x min(p(x), q(x))` (1 - total variation; at temperature 0, 1[argmax p == argmax q]) is the
probability that speculative decoding accepts the draft's token there. alpha is its mean. One target
pass per batch serves every draft; logits live one batch at a time.

Drafts with a different tokenizer are measured through text, at temperature 0: the draft reads the same
prompt (through its own chat template) and the same continuation text, re-tokenized; at each target token
whose start is also a boundary between draft tokens, the draft's greedy next token is decoded and
re-tokenized with the target's tokenizer, and accepted iff the first resulting token is the target's
token. Target tokens that start inside a draft token count as rejected, and a draft token that covers more
text than the target's token is judged by its first target token only, so this is a conservative
estimate of what a text-level speculative decoder would accept.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import datasets
import torch
from torch import Tensor
from tqdm.auto import tqdm

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.loading import Loaded, eos_ids
from draftsmith.decode.pruned import Proposes, restrict_logits
from draftsmith.decode.sampling import SamplingParams, fit_vocab, greedy_token, to_probs
from draftsmith.decode.textgen import prompt_ids
from draftsmith.pairing.cost import expected_tau
from draftsmith.pairing.depth import depth_rates_censored, depth_rates_from_rounds, round_matrix, tokens_per_round

K_RANGE = range(1, 17)
TOKEN_LEVEL = "teacher-forced"
THROUGH_TEXT = "teacher-forced, through text (cross-tokenizer)"
TAU_DEFINITION = "tokens emitted per target forward, including the bonus/corrected token"


# -- the math ------------------------------------------------------------------------------------------


def _beta_given_p(p: Tensor, q_logits: Tensor, params: SamplingParams) -> Tensor:
    q = to_probs(fit_vocab(q_logits, p.shape[-1]).to(p.device), params)  # as the decoder aligns them
    return torch.minimum(p, q).sum(dim=-1)


def beta(p_logits: Tensor, q_logits: Tensor, params: SamplingParams) -> Tensor:
    """Per-position acceptance sum_x min(p(x), q(x)): target logits (N, V), draft logits (N, Vd) -> (N,).

    Both go through the same `to_probs` transform; at temperature 0 this is exactly 1[argmax p == argmax q].
    """
    return _beta_given_p(to_probs(p_logits, params), q_logits, params)


# -- results ---------------------------------------------------------------------------------------------


@dataclass
class Acceptance:
    draft: str
    alpha: float
    alpha_by_domain: dict[str, float]
    positions: int
    positions_by_domain: dict[str, int]
    by_position: list[float]  # mean beta at continuation index t = 0, 1, ...
    expected_tau: dict[int, float]  # K -> E[tau] from alpha, i.i.d. positions (the textbook formula), K = 1..16
    method: str  # TOKEN_LEVEL or THROUGH_TEXT
    rows: list[list[float]] = field(default_factory=list)  # beta per continuation token, one list per reference row
    row_domains: list[str] = field(default_factory=list)
    budget: int | None = None  # the references' max_new_tokens (a shorter row ended at EOS)
    matrices: list[list[list[float]]] | None = None  # a head's rows: [s][j-1] = acceptance of depth j from start s
    row_ids: list[str] = field(default_factory=list)  # each row's prompt id

    def to_dict(self) -> dict:
        d = asdict(self)
        d["expected_tau"] = {str(k): v for k, v in self.expected_tau.items()}
        d["tau_definition"] = TAU_DEFINITION
        return d

    def accept_rows(self, domain: str | None = None, ids: set[str] | None = None) -> list[Tensor]:
        """Each row's round matrix (`pairing.depth.round_matrix`, depths 1..16; a head's own), of one domain or
        all, of the prompts `ids` or all."""
        keep = [bool(r) and (domain is None or d == domain) and (ids is None or i in ids)
                for r, d, i in zip(self.matrices if self.matrices is not None else self.rows, self.row_domains,
                                   self.row_ids or [None] * len(self.rows))]
        if self.matrices is not None:
            return [torch.tensor(m, dtype=torch.float64) for m, k in zip(self.matrices, keep) if k]
        return [round_matrix(r, max(K_RANGE)) for r, k in zip(self.rows, keep) if k]

    def tokens_per_round(self, K: int, domain: str | None = None, ids: set[str] | None = None) -> float:
        """Tokens per target forward the decoder makes at K on these rows (of a domain, of some prompt ids),
        rounds walked as it walks them (`pairing.depth.tokens_per_round`): acceptance as it happens."""
        rows = self.accept_rows(domain, ids)
        return tokens_per_round(rows, K, budgets=[self.budget] * len(rows) if self.budget else None)

    def depth_rates(self, K_max: int = max(K_RANGE)) -> list[float]:
        """a_j = P(depth j accepted | depths < j were), every start counted (`depth_rates_censored`); for a head,
        the same over its own matrices (depth j judged where its position lies in the row)."""
        if self.matrices is None:
            return depth_rates_censored([r for r in self.rows if r], K_max)
        return depth_rates_from_rounds(self.accept_rows(), K_max)


class _Tally:
    """Running sums of beta: per domain and per continuation index."""

    def __init__(self) -> None:
        self.sum: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.pos_sum: list[float] = []
        self.pos_n: list[int] = []
        self.rows: dict[int, list[float]] = {}  # reference row index -> its betas in order
        self.row_domain: dict[int, str] = {}
        self.row_id: dict[int, str] = {}

    def add_row(self, index: int, domain: str, betas: list[float], row_id: str | None = None) -> None:
        self.rows[index] = list(betas)
        self.row_domain[index] = domain
        self.row_id[index] = str(index) if row_id is None else str(row_id)
        for t, b in enumerate(betas):
            self.add(domain, t, b)

    def add(self, domain: str, t: int, b: float) -> None:
        self.sum[domain] += b
        self.n[domain] += 1
        while len(self.pos_sum) <= t:
            self.pos_sum.append(0.0)
            self.pos_n.append(0)
        self.pos_sum[t] += b
        self.pos_n[t] += 1

    def result(self, draft: str, method: str, budget: int | None = None) -> Acceptance:
        n = sum(self.n.values())
        alpha = sum(self.sum.values()) / n
        domains = sorted(self.n)
        return Acceptance(
            draft=draft, alpha=alpha,
            alpha_by_domain={d: self.sum[d] / self.n[d] for d in domains},
            positions=n, positions_by_domain={d: self.n[d] for d in domains},
            by_position=[s / c if c else float("nan") for s, c in zip(self.pos_sum, self.pos_n)],
            expected_tau={K: expected_tau(min(max(alpha, 0.0), 1.0), K) for K in K_RANGE},
            method=method,
            rows=[self.rows[i] for i in sorted(self.rows)],
            row_domains=[self.row_domain[i] for i in sorted(self.rows)],
            row_ids=[self.row_id[i] for i in sorted(self.rows)],
            budget=budget,
        )


# -- teacher forcing -----------------------------------------------------------------------------------


@torch.inference_mode()
def _forward(model: Any, seqs: list[list[int]], first: int) -> Tensor:
    """Right-padded batch forward of a HF causal LM; logits (B, T - first, V) for columns first..T-1.

    Right padding keeps every real token at its true position and, the model being causal, out of reach
    of the padding; the attention mask says so as well.
    """
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, : len(s)] = 1
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False, logits_to_keep=T - first)
    return out.logits


def _runner_forward(runner: Any, seqs: list[list[int]], first: int) -> Tensor:
    """`_forward` through a decoder runner (a draft with its int8 or int4 weights, as it decodes): each sequence
    fed whole from position 0, one at a time; logits (B, T - first, V), the rows past a sequence's end zero."""
    T = max(len(s) for s in seqs)
    out = None
    for b, s in enumerate(seqs):
        logits = runner.forward(torch.tensor(s, dtype=torch.long), 0)[first:]
        if out is None:
            out = logits.new_zeros(len(seqs), T - first, logits.shape[-1])
        out[b, : logits.shape[0]] = logits
    return out


def _continuation_rows(rows: list[dict], logits: Tensor, first: int) -> Tensor:
    """The logit rows that predict continuation tokens, row after row: (sum of continuation lengths, V)."""
    b_idx, cols = [], []
    for b, r in enumerate(rows):
        P, C = len(r["prompt_ids"]), len(r["continuation_ids"])
        b_idx += [b] * C
        cols += range(P - 1 - first, P + C - 1 - first)
    return logits[torch.tensor(b_idx, device=logits.device), torch.tensor(cols, device=logits.device)]


def _restrict(q_logits: Tensor, kept: Tensor | Proposes, rows: list[dict], lengths: list[int]) -> Tensor:
    """A pruned draft's continuation rows (`_continuation_rows`) as it decodes them: -inf outside its kept ids, and
    with context ids outside those and the ids each row has read (its prompt and the continuation before it)."""
    kept = kept if isinstance(kept, Proposes) else Proposes(kept)
    if not kept.context:
        return restrict_logits(q_logits, kept.ids)
    parts = []
    for r, part in zip(rows, q_logits.split(lengths)):
        P = len(r["prompt_ids"])
        seq = torch.tensor(list(r["prompt_ids"]) + list(r["continuation_ids"]), dtype=torch.long)
        parts.append(restrict_logits(part, kept.ids, context=seq, at=torch.arange(P - 1, P - 1 + part.shape[0])))
    return torch.cat(parts)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _prefix_ends(tokenizer: Any, ids: list[int]) -> tuple[str, list[int | None]]:
    """The text of `ids` and, for i = 0..len(ids), where the text of ids[:i] ends in it (None when that
    prefix does not decode to a prefix of the whole: a split character or a decoder clean-up)."""
    text = _decode(tokenizer, ids)
    ends: list[int | None] = []
    for i in range(len(ids) + 1):
        s = _decode(tokenizer, ids[:i]) if i < len(ids) else text
        ends.append(len(s) if text.startswith(s) else None)
    return text, ends


class _TextRow:
    """One reference row seen through a draft with another tokenizer."""

    def __init__(self, row: dict, target: Loaded, draft: Loaded, chat: bool) -> None:
        cont = list(row["continuation_ids"])
        self.cont = cont
        self.text, t_ends = _prefix_ends(target.tokenizer, cont)
        self.prompt = prompt_ids(draft.tokenizer, row["prompt"], chat=chat)
        if not self.prompt:
            raise DraftsmithError(f"draft {draft.name!r} turns prompt {row.get('id', '')!r} into no tokens")
        self.dc = draft.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        d_text, d_ends = _prefix_ends(draft.tokenizer, self.dc)
        agree = next((i for i, (a, b) in enumerate(zip(d_text, self.text)) if a != b), min(len(d_text), len(self.text)))
        boundary: dict[int, int] = {}  # character offset -> first draft prefix length ending there
        for j, e in enumerate(d_ends):
            if e is not None and e <= agree:
                boundary.setdefault(e, j)
        # target token t starts where the text of cont[:t] ends
        self.draft_at = [boundary.get(t_ends[t]) if t_ends[t] is not None else None for t in range(len(cont))]
        self.seq = self.prompt + self.dc

    def judge(self, target: Loaded, draft: Loaded, greedy: list[int], t_eos: set[int], d_eos: set[int]) -> list[float]:
        """0/1 acceptance at each continuation token; greedy[j] = the draft's argmax after prompt + dc[:j]."""
        out = []
        for t, j in enumerate(self.draft_at):
            if j is None:
                out.append(0.0)
                continue
            g, want = greedy[j], self.cont[t]
            if want in t_eos:
                out.append(float(g in d_eos))
                continue
            before = _decode(draft.tokenizer, self.dc[:j])
            ext = _decode(draft.tokenizer, self.dc[:j] + [g])
            proposal = ext[len(before):] if ext.startswith(before) else _decode(draft.tokenizer, [g])
            first = target.tokenizer(proposal, add_special_tokens=False)["input_ids"][:1] if proposal else []
            out.append(float(first == [want]))
        return out


def _chat_setting(refs: datasets.Dataset) -> bool | None:
    """The `chat` the references were generated with, when `reference_continuations` recorded it."""
    try:
        return bool(json.loads(refs.info.description)["draftsmith_reference"]["chat"])
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def _budget(refs: datasets.Dataset) -> int | None:
    """The max_new_tokens the references were generated with, when recorded."""
    try:
        return int(json.loads(refs.info.description)["draftsmith_reference"]["max_new_tokens"])
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def _row_chat(target: Loaded, row: dict) -> bool:
    """Whether a row's prompt went through the chat template (for references from elsewhere)."""
    return prompt_ids(target.tokenizer, row["prompt"], chat=True) == list(row["prompt_ids"])


def measure_acceptance(
    target: Loaded,
    drafts: list[Loaded],
    refs: datasets.Dataset,
    *,
    params: SamplingParams = SamplingParams(),
    batch_size: int = 4,
    progress: bool = True,
    kept: list[Tensor | Proposes | None] | None = None,
    runners: list[Any | None] | None = None,
) -> list[Acceptance]:
    """alpha (overall, per domain, per continuation index) and E[tau] for K = 1..16, for each draft in order.

    `refs` has the columns of `pairing.reference.reference_continuations`. Drafts whose tokenizer differs
    from the target's are measured through text at temperature 0 (see the module docstring). `kept[i]`: the
    target ids a vocabulary-pruned draft i proposes (`decode.pruned`; a `Proposes` with context: and the ids
    each row has read); its q is 0 outside them, as it decodes. `runners[i]`: the runner draft i decodes with (its
    int8 or int4 weights, `decode.runtime.runner.make_runner(..., quantize=...)`, not pruned: `kept` prunes): its q comes
    from that runner fed each row whole, so alpha is the quantised draft's, not its float model's; None (the
    default) reads the model as loaded, batched.
    """
    if batch_size < 1:
        raise DraftsmithError(f"batch_size must be >= 1, got {batch_size}")
    missing = {"domain", "prompt", "prompt_ids", "continuation_ids"} - set(refs.column_names)
    if missing:
        raise DraftsmithError(f"reference dataset lacks column(s) {', '.join(sorted(missing))}")
    rows = [dict(r, _index=i) for i, r in enumerate(refs) if len(r["continuation_ids"]) and len(r["prompt_ids"])]
    if not rows:
        raise DraftsmithError("the reference dataset has no continuation tokens to measure acceptance on")
    if not drafts:
        return []
    rows.sort(key=lambda r: len(r["prompt_ids"]) + len(r["continuation_ids"]))  # less padding per batch

    t_vocab = target.tokenizer.get_vocab()
    through_text = [d.tokenizer.get_vocab() != t_vocab for d in drafts]
    kept = list(kept) if kept is not None else [None] * len(drafts)
    if len(kept) != len(drafts) or any(k is not None and text for k, text in zip(kept, through_text)):
        raise DraftsmithError("kept ids: one entry per draft, and only for drafts with the target's tokenizer")
    runners = list(runners) if runners is not None else [None] * len(drafts)
    if len(runners) != len(drafts) or any(r is not None and text for r, text in zip(runners, through_text)):
        raise DraftsmithError("runners: one entry per draft, and only for drafts with the target's tokenizer")
    chat = _chat_setting(refs)
    t_eos = set(eos_ids(target))
    d_eos = [set(eos_ids(d)) for d in drafts]
    tallies = [_Tally() for _ in drafts]
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]

    for batch in tqdm(batches, desc="acceptance", unit="batch", disable=not progress):
        seqs = [list(r["prompt_ids"]) + list(r["continuation_ids"]) for r in batch]
        first = min(len(r["prompt_ids"]) for r in batch) - 1
        lengths = [len(r["continuation_ids"]) for r in batch]
        p = None
        if not all(through_text):
            p = to_probs(_continuation_rows(batch, _forward(target.model, seqs, first), first), params)
        for k, draft in enumerate(drafts):
            if not through_text[k]:
                q_all = (_forward(draft.model, seqs, first) if runners[k] is None
                         else _runner_forward(runners[k], seqs, first))
                q_logits = _continuation_rows(batch, q_all, first)
                if kept[k] is not None:
                    q_logits = _restrict(q_logits, kept[k], batch, lengths)
                betas = _beta_given_p(p, q_logits, params).split(lengths)
                for r, b in zip(batch, betas):
                    tallies[k].add_row(r["_index"], r["domain"], b.tolist(), r.get("id"))
                continue
            text_rows = [_TextRow(r, target, draft, _row_chat(target, r) if chat is None else chat) for r in batch]
            d_first = min(len(x.prompt) for x in text_rows) - 1
            logits = _forward(draft.model, [x.seq for x in text_rows], d_first)
            greedy = greedy_token(logits[..., : len(draft.tokenizer)]).tolist()  # (B, W); no padding rows
            for r, x, g in zip(batch, text_rows, greedy):
                start = len(x.prompt) - 1 - d_first
                tallies[k].add_row(r["_index"], r["domain"],
                                   x.judge(target, draft, g[start : start + len(x.dc) + 1], t_eos, d_eos[k]), r.get("id"))

    budget = _budget(refs)
    return [
        tally.result(d.name, THROUGH_TEXT if text else TOKEN_LEVEL, budget)
        for d, tally, text in zip(drafts, tallies, through_text)
    ]


HEAD = "teacher-forced, a head by depth (later depths read its own output)"


@torch.inference_mode()
def measure_head_acceptance(
    target: Loaded, head: Any, refs: datasets.Dataset, name: str, *, params: SamplingParams = SamplingParams(),
    depth: int = max(K_RANGE), progress: bool = True,
) -> Acceptance:
    """A draft head's acceptance at every depth of every round, teacher-forced on the references.

    One target forward per row gives the head's features (its aux layers) and the target's p at every
    position; `decode.head.ttt_logits` gives the head's proposals at depths 1..`depth` for every entry, depth
    j >= 2 reading its own output as in the decoder. A round whose first draft is continuation position s
    reads entry e = P + s + j - 3 at depth j (P = prompt length) and proposes position s + j - 1, judged by
    beta = sum min(p, q) against the target there (1[argmax agree] at temperature 0). `alpha` and the
    per-position view are depth 1's; `matrices` hold every depth for `Acceptance.tokens_per_round`."""
    from draftsmith.decode.head import ttt_logits

    rows = [dict(r, _index=i) for i, r in enumerate(refs) if len(r["continuation_ids"]) and len(r["prompt_ids"]) >= 2]
    if not rows:
        raise DraftsmithError("the reference dataset has no row a head can draft on (prompt >= 2 tokens, continuation)")
    tally, mats = _Tally(), {}
    device = next(target.model.parameters()).device
    layers = tuple(head.config.aux_layers)
    for r in tqdm(rows, desc=f"acceptance {name}", unit="row", disable=not progress):
        P, C = len(r["prompt_ids"]), len(r["continuation_ids"])
        seq = torch.tensor(list(r["prompt_ids"]) + list(r["continuation_ids"]), device=device)
        out = target.model(input_ids=seq[None], output_hidden_states=True, use_cache=False)
        feats = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
        p = to_probs(out.logits[0], params)
        m = torch.zeros(C, depth, dtype=torch.float64)
        for j, logits in enumerate(ttt_logits(head, feats, seq, min(depth, C)), start=1):
            lo, hi = max(0, 3 - P - j), C - j + 1  # starts whose depth j lies in the row
            if hi <= lo:
                continue
            s = torch.arange(lo, hi, device=device)
            e = P + s + j - 3
            q_logits = head.to_target_vocab(logits[e])
            m[s.cpu(), j - 1] = _beta_given_p(p[e + 1], q_logits, params).to("cpu", torch.float64)
        mats[r["_index"]] = m.tolist()
        tally.add_row(r["_index"], r["domain"], m[:, 0].tolist(), r.get("id"))
    acc = tally.result(name, HEAD, _budget(refs))
    acc.matrices = [mats[i] for i in sorted(mats)]
    return acc


__all__ = ["Acceptance", "HEAD", "THROUGH_TEXT", "TOKEN_LEVEL", "beta", "expected_tau", "measure_acceptance",
           "measure_head_acceptance"]
