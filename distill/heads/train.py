"""Train an EAGLE-3 draft head on the target's own text and features (`distill.heads.data`), with the
training-time test: the head is unrolled on its own outputs for `ttt_steps` depths, as decoding will run it.

    from draftsmith.distill.heads.train import HeadTrainConfig, train_head
    summary = train_head(target, load_head_data(data_dir), held_out_rows, Path("runs/head"), HeadTrainConfig())

Depth 1 of entry e reads fc(features_e) and the embedding of token e+1; depth j >= 2 reads the head's own
output hidden of entry e-1 at depth j-1, and attends to the depth-1 entries before the round (keys < e-j+2)
plus its own chain (depth s at entry e-j+s, s = 2..j): exactly what `decode.head.HeadDraft` computes when a
round starts after token e-j+2. Every depth of entry e predicts token e+2: the label is the target's
distribution at position e+1 over the draft vocabulary (its logits recomputed from the stored final hidden
state with the target's own lm_head rows), the loss forward KL(p || q), depth j weighted 0.8^(j-1).

A prompt sampled several times is trained on once: its other rows start at the prompt's last entry (the
forward still runs over the whole row, whose entries the later ones attend to).

Rows are unrolled `rows_per_step` at a time, right-padded (similar lengths share a step); the output head and
the loss run only on the entries counted. `dtype="bfloat16"` runs the matmuls under autocast (AMX: ~1.6x the
tokens per minute here); weights, optimizer and the target's label distribution stay float32.
`label_temperature` < 1 sharpens the distribution learned (held-out KL is always reported at temperature 1).

The draft vocabulary is the `draft_vocab_size` ids the target predicts most often in the training data; the
head's lm_head starts as the target's rows for those ids and its final norm as the target's. The best head
by held-out depth-1 agreement (greedy, continuation positions only) is kept in `out/best/`; `out/checkpoint/`
(weights, optimizer, step; safetensors + torch.load(weights_only=True)) lets a rerun resume.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from draftsmith.decode.batch import GEN_DTYPES
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.head import Eagle3Head, HeadConfig, save_head, ttt_hidden, vocab_map
from draftsmith.decode.runtime.io import atomic_dir, atomic_write_json, read_json
from draftsmith.decode.runtime.kernels import dense
from draftsmith.decode.runtime.loading import Loaded
from draftsmith.pairing.prune import count_tokens


@dataclass
class HeadTrainConfig:
    """How a head is trained."""

    draft_vocab_size: int = 8192  # ids the head can propose: the target's most frequent predictions
    ttt_steps: int = 3  # depths unrolled in training (EAGLE-3's training-time test)
    lr: float = 1e-3  # peak AdamW learning rate
    warmup_steps: int = 20  # linear warm-up, then cosine to 0
    epochs: float = 2.0  # passes over the training rows
    rows_per_step: int = 8  # sequences per optimizer step
    eval_every: int = 50  # steps between held-out evaluations
    max_minutes: float = 0.0  # time budget: the schedule is fitted to it after 10 timed steps; 0 = epochs decide
    dedup_prompts: bool = True  # a prompt's own positions are trained on once (its first row), not once per sample
    label_temperature: float = 1.0  # the target's distribution the head learns, at this temperature (< 1 sharpens)
    dtype: str = "float32"  # matmuls in bfloat16 (autocast; weights and optimizer stay float32) run faster with AMX
    intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in GEN_DTYPES:
            raise DraftsmithError(f"dtype must be {' or '.join(GEN_DTYPES)}, got {self.dtype!r}")
        if not self.label_temperature > 0:
            raise DraftsmithError(f"label_temperature must be > 0, got {self.label_temperature}")


class _SoftCrossEntropy(torch.autograd.Function):
    """Per row, logsumexp(z) - sum(p * z) = -sum(p * log_softmax(z)), z = logits in float32 (at least), with one
    fused backward: (softmax(z) - p) * grad. Half the time of autograd's logsumexp, product and sum on (1632,
    8192) rows here."""

    @staticmethod
    def forward(ctx, logits: Tensor, p: Tensor) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            z = logits.to(torch.promote_types(logits.dtype, torch.float32))
            lse = torch.logsumexp(z, dim=-1)
            ctx.save_for_backward(z, lse, p)
            ctx.in_dtype = logits.dtype
            return lse - torch.linalg.vecdot(p.to(z.dtype), z)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        z, lse, p = ctx.saved_tensors
        g = torch.exp(z - lse[:, None]).sub_(p).mul_(grad[:, None])
        return g.to(ctx.in_dtype), None


def soft_cross_entropy(logits: Tensor, p: Tensor) -> Tensor:
    """(M, N) logits and a distribution p (M, N) -> (M,) cross-entropy -sum p log softmax(logits); p takes no
    gradient."""
    return _SoftCrossEntropy.apply(logits, p.detach())


def _row_loss(head: Eagle3Head, row: dict, w_draft: Tensor, steps: int,
              start: int = 0) -> tuple[Tensor, int, list[tuple[int, int]]]:
    """Summed weighted KL over the row's valid entries from `start` on, their count, and (correct, counted) per
    depth (continuation entries only)."""
    return _batch_loss(head, [row], [start], w_draft, steps)


def _batch_loss(head: Eagle3Head, rows: list[dict], starts: list[int], w_draft: Tensor, steps: int,
                agreement: bool = True) -> tuple[Tensor, int, list[tuple[int, int]]]:
    """`_row_loss` summed over rows unrolled together (right-padded to the longest). The output head and the
    loss run on the entries counted only (not on pads, nor on a repeated prompt's entries); the target's
    distribution is computed in float32 whatever autocast says. `agreement=False` skips counting hits."""
    B, T = len(rows), max(len(r["tokens"]) for r in rows)
    tokens = torch.zeros(B, T, dtype=torch.long)
    feats = rows[0]["features"].new_zeros(B, T, rows[0]["features"].shape[-1])
    final = rows[0]["final"].new_zeros(B, T, rows[0]["final"].shape[-1])
    nxt = torch.full((B, T), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r["tokens"])
        tokens[b, :n], feats[b, :n], final[b, :n], nxt[b, :n] = r["tokens"], r["features"], r["final"], r["next"]
    entry = torch.arange(T - 1)[None, :].expand(B, -1)  # (B, E)
    length = torch.tensor([len(r["tokens"]) - 1 for r in rows])[:, None]
    sel = (entry >= torch.tensor(starts)[:, None]) & (entry < length)  # the entries trained on
    entry = entry[sel]
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # the target at position e+1, draft vocabulary
        p_log = F.log_softmax(dense(final[:, 1:][sel].float(), w_draft.float()), dim=-1)  # final: after the norm
        p = p_log.exp()
        neg_entropy = (p * p_log).sum(-1)  # KL(p || q) = sum p log p - sum p log q
    label = nxt[:, 1:][sel]  # the target's greedy next token after position e+1
    cont = entry + 1 >= torch.tensor([r["prompt_len"] for r in rows])[:, None].expand(B, T - 1)[sel]
    target_ids = head.draft_ids
    total, n, acc = 0.0, 0, []
    for j, h in enumerate(ttt_hidden(head, feats, tokens, steps), start=1):
        logits = head.lm_head(head.norm(h[sel]))  # (M, N), bfloat16 under autocast
        kl = neg_entropy + soft_cross_entropy(logits, p)
        valid = entry >= j - 1
        total = total + 0.8 ** (j - 1) * kl[valid].sum()
        n += int(valid.sum()) if j == 1 else 0
        if agreement:
            hit = target_ids[logits.argmax(-1)] == label
            acc.append((int((hit & valid & cont).sum()), int((valid & cont).sum())))
    return total, n, acc


def evaluate(head: Eagle3Head, rows: list[dict], w_draft: Tensor, steps: int) -> dict:
    """Held-out agreement with the target's greedy token per depth (continuation positions, teacher-forced)."""
    tot = [[0, 0] for _ in range(steps)]
    kl, n = 0.0, 0
    with torch.no_grad():
        for row in rows:
            loss, cnt, acc = _row_loss(head, row, w_draft, steps)
            kl, n = kl + float(loss), n + cnt
            for j, (a, b) in enumerate(acc):
                tot[j][0] += a
                tot[j][1] += b
    return {"agreement_by_depth": [a / b if b else None for a, b in tot], "kl": kl / max(n, 1)}




def _new_head(target: Loaded, rows: list[dict], cfg: HeadTrainConfig,
              aux_layers: tuple[int, ...]) -> tuple[Eagle3Head, Tensor, float]:
    """A head whose draft vocabulary is the `draft_vocab_size` ids the target predicts most often in `rows`, its
    lm_head the target's rows for them and its final norm the target's; with those rows (N, H) and the share of
    the target's predictions the vocabulary covers."""
    torch.manual_seed(cfg.seed)
    hf = target.model
    counts = count_tokens([r["next"] for r in rows], hf.config.vocab_size)
    head = Eagle3Head(HeadConfig.for_target(hf.config, draft_vocab_size=cfg.draft_vocab_size, aux_layers=aux_layers,
                                            intermediate_size=cfg.intermediate_size), hf.get_input_embeddings())
    head.set_vocab(*vocab_map(counts, cfg.draft_vocab_size))
    w_draft = hf.get_output_embeddings().weight.detach()[head.draft_ids].float()  # (N, H): the target's rows
    with torch.no_grad():
        head.lm_head.weight.copy_(w_draft)
        head.norm.weight.copy_(hf.model.norm.weight.detach())
    return head, w_draft, float(counts[head.draft_ids].sum() / counts.sum())


def _optimizer(head: Eagle3Head, cfg: HeadTrainConfig, plan: dict):
    """AdamW with a linear warm-up, then a cosine to 0 at `plan["total"]` steps (read when stepped: a time budget
    refits it)."""
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / (cfg.warmup_steps + 1), 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - cfg.warmup_steps) / max(1, plan["total"] - cfg.warmup_steps))))))
    return opt, sched


def _resume(head: Eagle3Head, opt, sched, ckpt: Path, state: dict, plan: dict) -> dict:
    """The trainer's state from `ckpt` when a run left one there (weights, optimizer and schedule loaded)."""
    if not (ckpt / "trainer.json").is_file():
        return state
    from safetensors.torch import load_file

    head.load_state_dict(load_file(str(ckpt / "head.safetensors")), strict=False)
    blob = torch.load(ckpt / "optim.pt", weights_only=True)
    opt.load_state_dict(blob["opt"]), sched.load_state_dict(blob["sched"])
    state = read_json(ckpt / "trainer.json", what="head checkpoint")
    plan["total"] = state.get("planned_steps") or plan["total"]
    return state


def train_head(target: Loaded, rows: list[dict], held_out: list[dict], out: Path, cfg: HeadTrainConfig, *,
               aux_layers: tuple[int, ...], progress: bool = True) -> dict:
    """Train from scratch (or resume from out/checkpoint); returns the summary (also out/summary.json)."""
    out = Path(out)
    head, w_draft, coverage = _new_head(target, rows, cfg, aux_layers)
    w_label = w_draft / cfg.label_temperature  # the logits the loss's labels come from (held-out KL stays at T = 1)
    plan = {"total": max(1, math.ceil(cfg.epochs * len(rows) / cfg.rows_per_step))}
    plan["epochs"] = plan["total"]  # the most steps: the epochs'
    opt, sched = _optimizer(head, cfg, plan)
    ckpt = out / "checkpoint"
    state = _resume(head, opt, sched, ckpt, {"step": 0, "best": -1.0, "best_step": None, "log": [], "seconds": 0.0,
                                             "planned_steps": None}, plan)
    calibrate = min(10, max(1, cfg.warmup_steps))  # steps timed before a time budget fixes the schedule's length
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.cat([_bucketed(rows, cfg.rows_per_step, gen) for _ in range(math.ceil(cfg.epochs) + 1)])
    log_path = out / "log.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=plan["total"], initial=state["step"], desc="head", unit="step", disable=not progress)
    t_start = time.perf_counter() - state["seconds"]
    if state["step"] == 0:
        _eval_and_keep(head, held_out, w_draft, cfg, state, out, log_path, tokens=0)
    starts = _loss_starts(rows, cfg.dedup_prompts)
    t_loop, s0 = time.perf_counter(), state["step"]
    while state["step"] < plan["total"]:
        if cfg.max_minutes and time.perf_counter() - t_start > 60 * cfg.max_minutes:
            break
        if cfg.max_minutes and state.get("planned_steps") is None and state["step"] - s0 == calibrate:
            _fit_plan(plan, state, cfg, (time.perf_counter() - t_loop) / calibrate, t_start, bar)
        s = state["step"]
        batch = [int(i) for i in order[s * cfg.rows_per_step : (s + 1) * cfg.rows_per_step]]
        opt.zero_grad(set_to_none=True)
        n_tok = sum(len(rows[i]["tokens"]) - 1 - starts[i] for i in batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
            loss, _, _ = _batch_loss(head, [rows[i] for i in batch], [starts[i] for i in batch], w_label,
                                     cfg.ttt_steps, agreement=False)
        (loss / n_tok).backward()
        loss_sum = float(loss.detach())
        if not math.isfinite(loss_sum):
            raise DraftsmithError(f"head training: non-finite loss at step {s}; lower lr")
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step(), sched.step()
        state["step"] = s + 1
        state["tokens"] = state.get("tokens", 0) + n_tok
        state["seconds"] = time.perf_counter() - t_start
        with log_path.open("a") as f:
            f.write(json.dumps({"step": state["step"], "loss": loss_sum / n_tok, "lr": sched.get_last_lr()[0],
                                "tokens": state["tokens"]}) + "\n")
        bar.update(1), bar.set_postfix(loss=f"{loss_sum / n_tok:.3f}")
        if state["step"] % cfg.eval_every == 0 or state["step"] == plan["total"]:
            _eval_and_keep(head, held_out, w_draft, cfg, state, out, log_path, tokens=state["tokens"])
            if cfg.max_minutes and state["step"] < plan["total"] and state["step"] - s0 > calibrate:
                _fit_plan(plan, state, cfg, (time.perf_counter() - t_loop) / (state["step"] - s0), t_start, bar)
            _checkpoint(head, opt, sched, state, ckpt)
    bar.close()
    if state["log"] and state["log"][-1]["step"] != state["step"]:
        _eval_and_keep(head, held_out, w_draft, cfg, state, out, log_path, tokens=state.get("tokens", 0))
    summary = {"steps": state["step"], "total_steps": plan["total"], "seconds": state["seconds"],
               "tokens_seen": state.get("tokens", 0), "best_step": state["best_step"],
               "best_agreement_depth1": state["best"], "evals": state["log"], "config": asdict(cfg),
               "draft_vocab_coverage": coverage, "train_rows": len(rows), "held_out_rows": len(held_out),
               "train_tokens": sum(len(r["tokens"]) for r in rows),
               "train_entries": sum(len(r["tokens"]) - 1 - a for r, a in zip(rows, starts))}
    atomic_write_json(out / "summary.json", summary)
    return summary


def _fit_plan(plan: dict, state: dict, cfg: HeadTrainConfig, per_step: float, t_start: float, bar) -> None:
    """Under a time budget the cosine ends when the budget does: the steps that fit in what is left at
    `per_step` seconds (evaluations included), with 5% to spare. Fitted after the first timed steps, then again
    at every evaluation (steps differ in length); kept in the checkpoint, so a resume follows the same plan."""
    left = 60 * cfg.max_minutes - (time.perf_counter() - t_start)
    plan["total"] = min(plan["epochs"], state["step"] + max(1, int(0.95 * left / per_step)))
    state["planned_steps"] = bar.total = plan["total"]


def _bucketed(rows: list[dict], per_step: int, gen: torch.Generator) -> Tensor:
    """One epoch's row order: shuffled, then sorted by length within windows of 16 steps and the steps of a
    window shuffled, so that a step's rows (unrolled together, padded to the longest) have similar lengths."""
    perm = torch.randperm(len(rows), generator=gen)
    window = 16 * per_step
    out = []
    for a in range(0, len(perm), window):
        chunk = sorted(perm[a : a + window].tolist(), key=lambda i: len(rows[i]["tokens"]))
        steps = [chunk[k : k + per_step] for k in range(0, len(chunk), per_step)]
        full = len(steps) - (len(steps[-1]) < per_step)  # a short last step stays last: steps keep their bounds
        out += [i for k in torch.randperm(full, generator=gen).tolist() + list(range(full, len(steps)))
                for i in steps[k]]
    return torch.tensor(out, dtype=torch.long)


def prompt_key(row: dict) -> bytes:
    """A row's prompt tokens as bytes: the rows of one prompt (its samples) share it."""
    return row["tokens"][: row["prompt_len"]].numpy().tobytes()


def _loss_starts(rows: list[dict], dedup: bool) -> list[int]:
    """The first entry each row is trained on: 0, or, for a row whose prompt an earlier row already had (another
    sample of it), the prompt's last entry, whose label is the continuation's first token."""
    seen: set[bytes] = set()
    starts = []
    for row in rows:
        key = prompt_key(row)
        starts.append(max(row["prompt_len"] - 1, 0) if dedup and key in seen else 0)
        seen.add(key)
    return starts


def _eval_and_keep(head, held_out, w_draft, cfg, state, out, log_path, *, tokens: int) -> None:
    ev = evaluate(head, held_out, w_draft, cfg.ttt_steps)
    entry = {"step": state["step"], "eval": True, "tokens": tokens, **ev}
    state["log"].append(entry)
    with log_path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    a1 = ev["agreement_by_depth"][0] or 0.0
    if a1 > state["best"]:
        state["best"], state["best_step"] = a1, state["step"]
        save_head(head, out / "best")


def _checkpoint(head, opt, sched, state, ckpt: Path) -> None:
    from safetensors.torch import save_file

    with atomic_dir(ckpt) as tmp:
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp / "head.safetensors"))
        torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, tmp / "optim.pt")
        (tmp / "trainer.json").write_text(json.dumps(state))
