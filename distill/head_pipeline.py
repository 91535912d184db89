"""A draft head through the recipe line: data and training (`run_head`), then timing beside the target alone and
a standalone draft (`validate_head`). `draftsmith run` calls these when a recipe says `distill.draft: head`.

    from distill.head_pipeline import HeadRunConfig, run_head, validate_head
    result = run_head("smollm2-135m-instruct", Path("runs/x/distill"), HeadRunConfig(train_minutes=12.5),
                      prompts="code,json,summarize,chat", eval_per_domain=4)

Prompts split as in distillation (the first `eval_per_domain` of every domain held out). `out/data/`: the
target's sampled continuations of the training prompts with its features (`distill.head_data`); with
`written_prompts`, `out/prompts/` (requests the target writes itself, `distill.prompt_gen`) and `out/written/`
(its continuations of them, trained on beside `out/data/`); `out/held/`:
greedy continuations of the held-out prompts; `out/head/`: training (`distill.head_train`; `best/` by held-out
depth-1 agreement, resumable); `out/head.json`: this run's result. Every step resumes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from decode.batch import GEN_DTYPES
from decode.bench import validate_drafts
from decode.errors import DraftsmithError
from decode.head import HeadDraft, head_quant, load_head
from decode.io import atomic_write_json, read_json
from decode.loading import eos_ids, load
from decode.machine import machine_info, versions
from decode.prompts import Prompt, load_prompts
from decode.quant import draft_quant
from decode.runner import make_runner
from decode.textgen import prompt_ids
from distill.head_data import HeadDataConfig, build_head_data, load_head_data
from distill.head_train import HeadTrainConfig, depth_records, train_head
from pairing.cost import COST_CONTEXT, calibrate_decoder, measure_cost
from pairing.depth import expected_tau_from_depth_rates, round_walk
from pairing.derive import resolve_candidate

HEAD = "head"  # distill.draft's value that trains a head instead of distilling a standalone draft
HEAD_RESULT = "head.json"


@dataclass
class HeadRunConfig:
    """A recipe's `head:` section: the head's data and training (used when distill.draft is `head`)."""

    samples: int = 12  # sampled continuations of the target per training prompt
    max_new_tokens: int = 128  # tokens per continuation
    temperature: float = 0.8  # of the training continuations (held-out ones are greedy)
    gen_batch_size: int = 64  # rows the target decodes together
    written_prompts: int = 0  # prompts the target writes itself (distill.prompt_gen, the training prompts' domains),
    # answered and trained on beside the recipe's own
    written_samples: int = 1  # sampled continuations per written prompt
    prompt_tokens: int = 96  # a written prompt longer than this is dropped
    gen_dtype: str = "float32"  # the target's weights while it writes the training data (a copy; bfloat16: faster
    # on CPUs with AMX); the held-out references are always written in the target's own dtype
    draft_vocab_size: int = 8192  # ids the head can propose: the target's most frequent predictions
    ttt_steps: int = 3  # depths unrolled in training (EAGLE-3's training-time test)
    lr: float = 1e-3  # peak AdamW learning rate
    epochs: float = 10.0  # passes over the data (at most; train_minutes usually ends training first)
    rows_per_step: int = 8  # sequences per optimizer step
    train_minutes: float = 12.5  # training time budget (the cosine schedule is fitted to it); 0 = epochs decide
    budget_minutes: float = 0.0  # data and training together: training gets what the data's generation left
    # (its recorded seconds, so a resumed run plans the same), at most train_minutes; 0 = train_minutes alone
    eval_every: int = 50  # steps between held-out evaluations
    label_temperature: float = 1.0  # the target's distribution the head learns, at this temperature (< 1 sharpens)
    train_dtype: str = "float32"  # matmuls of training in bfloat16 (autocast; weights and optimizer stay float32)
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in (("gen_dtype", self.gen_dtype), ("train_dtype", self.train_dtype)):
            if value not in GEN_DTYPES:
                raise ValueError(f"{name} must be {' or '.join(GEN_DTYPES)}, got {value!r}")
        if self.written_prompts < 0:
            raise ValueError(f"written_prompts must be >= 0, got {self.written_prompts}")
        for name in ("samples", "written_samples", "prompt_tokens", "max_new_tokens", "gen_batch_size",
                     "draft_vocab_size", "ttt_steps", "rows_per_step", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.label_temperature <= 0:
            raise ValueError(f"label_temperature must be > 0, got {self.label_temperature}")
        if self.lr <= 0 or self.epochs <= 0 or self.train_minutes < 0 or self.temperature < 0:
            raise ValueError("lr and epochs must be > 0, train_minutes and temperature >= 0")
        if self.budget_minutes < 0:
            raise ValueError(f"budget_minutes must be >= 0, got {self.budget_minutes}")


def aux_layers_for(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature layers: low, middle, high ([2, L/2, L-3], as llama.cpp's converter assumes)."""
    if n_layers < 4:
        raise DraftsmithError(f"a head reads 3 target layers [2, L/2, L-3]: the target has only {n_layers}")
    return 2, n_layers // 2, n_layers - 3


def run_head(target_spec: str, out: Path, cfg: HeadRunConfig, *, prompts: str = "code,json,summarize,chat",
             limit_per_domain: int | None = None, eval_per_domain: int = 4, device: str = "cpu",
             progress: bool = True) -> dict:
    """Data, held-out references and training into `out`; returns (and writes out/head.json) the result."""
    from distill.pipeline import split_prompts

    out = Path(out)
    target = load(target_spec, device=device)
    aux = aux_layers_for(target.model.config.num_hidden_layers)
    train_p, held_p = split_prompts(load_prompts(prompts, limit_per_domain=limit_per_domain), eval_per_domain)
    t0 = time.perf_counter()
    data = build_head_data(target, train_p, out / "data", HeadDataConfig(
        samples=cfg.samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed,
        batch_size=cfg.gen_batch_size, aux_layers=aux, dtype=cfg.gen_dtype), progress=progress)
    folders, written = [out / "data"], None
    if cfg.written_prompts:
        from distill.prompt_gen import DOMAINS, generate_prompts

        domains = [d for d in dict.fromkeys(p.domain for p in train_p) if d in DOMAINS] or list(DOMAINS)
        generate_prompts(target, cfg.written_prompts, domains, out / "prompts", temperature=cfg.temperature or 0.8,
                         seed=cfg.seed, batch_size=cfg.gen_batch_size, max_prompt_tokens=cfg.prompt_tokens,
                         dtype=cfg.gen_dtype, progress=progress)
        written = build_head_data(target, load_prompts(out / "prompts"), out / "written", HeadDataConfig(
            samples=cfg.written_samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            seed=cfg.seed, batch_size=cfg.gen_batch_size, aux_layers=aux, dtype=cfg.gen_dtype), progress=progress)
        folders.append(out / "written")
    held = build_head_data(target, held_p, out / "held", HeadDataConfig(
        samples=1, max_new_tokens=cfg.max_new_tokens, temperature=0.0, batch_size=cfg.gen_batch_size,
        aux_layers=aux), progress=progress)
    data_seconds = time.perf_counter() - t0
    rows = [r for folder in folders for r in load_head_data(folder)]
    generation_s = sum(d["generate_seconds"] + d["feature_seconds"] for d in (data, written, held) if d)
    if cfg.written_prompts:
        generation_s += read_json(out / "prompts" / "stats.json", what="prompt statistics")["seconds_this_run"]
    train_minutes = cfg.train_minutes
    if cfg.budget_minutes:
        left = cfg.budget_minutes - generation_s / 60
        if left < 1:
            raise DraftsmithError(f"head: the data took {generation_s / 60:.1f} of budget_minutes "
                                  f"{cfg.budget_minutes:g}; nothing is left to train (raise it, or ask for less data)")
        train_minutes = min(train_minutes, left) if train_minutes else left
    summary = train_head(target, rows, load_head_data(out / "held"), out / "head",
                         HeadTrainConfig(draft_vocab_size=cfg.draft_vocab_size, ttt_steps=cfg.ttt_steps, lr=cfg.lr,
                                         epochs=cfg.epochs, rows_per_step=cfg.rows_per_step,
                                         eval_every=cfg.eval_every, max_minutes=train_minutes, seed=cfg.seed,
                                         dtype=cfg.train_dtype, label_temperature=cfg.label_temperature),
                         aux_layers=aux, progress=progress)
    evals = summary["evals"]
    best = next((e for e in evals if e["step"] == summary["best_step"]), evals[-1])
    result = {
        "kind": HEAD, "target": target_spec, "head": str(out / "head" / "best"), "aux_layers": list(aux),
        "config": asdict(cfg), "train_prompts": len(train_p), "held_out_prompts": len(held_p),
        "held_out_ids": [p.id for p in held_p], "data": data, "written_data": written, "held_data": held,
        "data_seconds_this_session": data_seconds, "generation_seconds": generation_s,
        "train_minutes": train_minutes,
        "agreement_before": evals[0]["agreement_by_depth"], "agreement_after": best["agreement_by_depth"],
        "curve": [{"tokens": e["tokens"], "agreement_by_depth": e["agreement_by_depth"]} for e in evals],
        "train_summary": {k: v for k, v in summary.items() if k != "evals"},
    }
    atomic_write_json(out / HEAD_RESULT, result)
    return result


def carried_rates(rates: list[float | None], depth: int) -> list[float]:
    """Acceptance at depths 1..depth from the measured ones (None: no positions there): the last measured rate
    carries to deeper depths, as `pairing.depth.expected_tau_from_depth_rates` needs one rate per depth."""
    known = [r for r in rates if r is not None] or [0.0]
    return [known[min(j, len(known) - 1)] for j in range(depth)]


def validate_head(target_spec: str, head_dir: Path, prompts: list[Prompt], *, standalone: str | None,
                  agreement: list[float | None], k: int, max_k: int, max_new_tokens: int, out: Path,
                  quant: str | None = "int8", device: str = "cpu", standalone_k: int | None = None,
                  held: list[dict] | None = None, gate: bool = True, siblings: int = 2,
                  sibling_depth: int = 1) -> dict:
    """Time the target alone, the head (`draft_after`) and, when given, the standalone draft the pair stage
    ranked first (`draft_before`, at `standalone_k`, its best predicted K, when given), interleaved on the same
    held-out prompts in one run; write `out`.

    K: `k` when > 0, else the best predicted from the head's held-out acceptance and the round cost timed in the
    decoder (a 2-prompt calibration decode of the head). With `held` (the held-out reference rows) the prediction
    walks the decoder's own rounds on the head's teacher-forced records of them (`depth_records`, `round_walk`),
    and with `gate` it also picks a confidence threshold: a round stops after a draft token the head gives less
    than it, which saves the draft steps and verify rows of rounds that would fail, or, with `siblings` = m >= 2
    (where the target runner verifies trees), proposes the head's m most probable first tokens side by side there
    instead (`KPolicy.siblings`), and with `sibling_depth` 2 also those rounds with each sibling's next token
    (`KPolicy.sibling_depth`; the verify of 2m + 1 rows is timed too); without `held`,
    `agreement` (acceptance by depth) predicts fixed-K rounds.
    Refuses a run whose output differs from the target's greedy output, after writing the numbers."""
    torch.set_grad_enabled(False)
    target = load(target_spec, device=device)
    head = load_head(head_dir, target.model.get_input_embeddings())
    ids = [prompt_ids(target.tokenizer, p.prompt) for p in prompts]
    tree_k = 2 * siblings if siblings and sibling_depth == 2 else 0  # tokens a sibling round with children drafts
    max_len = (max(max(len(i) for i in ids) + max_new_tokens, COST_CONTEXT)
               + max(k, max_k, standalone_k or 0, tree_k) + 2)
    t_run = make_runner(target.model, max_len)
    drafts: dict = {}
    if standalone:
        before = load(resolve_candidate(standalone), device=device)
        drafts["draft_before"] = make_runner(before.model, max_len, quantize=draft_quant(before.model, quant))
    hq = head_quant(head, quant)
    drafts["draft_after"] = HeadDraft(head, max_len, quantize=hq)
    curve: dict[int, float] = {}
    gated: dict[tuple[int, float, int, int], float] = {}
    confidence, sib, depth = None, 0, 1
    timed: dict = {}  # the head's round, as the calibration decode timed it
    if k:
        why = "set by the recipe"
    else:
        # 9 interleaved repeats (median): with 3, one stall on a busy machine set v(2..4) ~1.29 where they are
        # ~1.01 (run 13's second validate), which ruled out sibling rounds that measured 1.41-1.43x
        iso = measure_cost(t_run, None, ks=range(1, max(max_k, tree_k) + 1), context=COST_CONTEXT, repeats=9,
                           warmup=2, device=device)
        dc = calibrate_decoder(t_run, drafts["draft_after"], ids[:2], k=1, isolated=iso, max_new_tokens=32,
                               eos_ids=eos_ids(target), device=device)
        timed = {"cost_ratio": dc.draft_step_s / dc.target_token_s,
                 "verify_cost": {str(K): v / dc.target_token_s for K, v in dc.verify_s.items()},
                 "decoder_cost": asdict(dc)}
        if held:
            m = siblings if hasattr(t_run, "forward_tree") and siblings <= max_k else 0  # v(m) is timed to max_k
            curve, gated = _gated_curve(head, held, dc, max_k, max_new_tokens, gate, m, sibling_depth)
            k, confidence, sib, depth = max(gated, key=lambda kc: (gated[kc], -kc[0], -kc[1], -kc[2], -kc[3]))
            chosen = gated[(k, confidence, sib, depth)]
            confidence = confidence or None
            best = ", ".join(f"K={K}: {x:.2f}x" for K, x in curve.items())
            how = (f"proposing the head's {sib} most probable first tokens side by side"
                   + (" with the head's next token after each" if depth == 2 else "") if sib else "stopping")
            why = (f"best predicted from the decoder's rounds walked on the held-out references and the round cost "
                   f"timed in the decoder ({best}"
                   + (f"; {how} where the head's first draft has probability below {confidence}: {chosen:.2f}x"
                      if confidence else "") + ")")
        else:
            rates = carried_rates(agreement, max_k)
            curve = {K: dc.speedup(expected_tau_from_depth_rates(rates, K), K, max_new_tokens)
                     for K in range(1, max_k + 1)}
            k = max(curve, key=lambda K: (curve[K], -K))
            why = (f"best predicted from the head's held-out acceptance by depth and its round cost timed in the "
                   f"decoder ({', '.join(f'K={K}: {x:.2f}x' for K, x in curve.items())})")
    ks = {"draft_before": standalone_k} if standalone and standalone_k else None
    val = validate_drafts(t_run, drafts, ids, k=k, max_new_tokens=max_new_tokens, eos_ids=eos_ids(target),
                          names=[p.id for p in prompts], device=device, ks=ks,
                          confidence={"draft_after": confidence} if confidence else None,
                          siblings={"draft_after": sib} if sib else None,
                          sibling_depth={"draft_after": depth} if depth == 2 else None)
    result = {"target": target_spec, "draft": standalone, "distilled": str(head_dir), "kind": HEAD,
              "labels": {"draft_before": f"standalone draft ({standalone})", "draft_after": "head"},
              **val.to_dict(), "k_reason": why,
              "predicted_speedup": gated.get((k, confidence or 0.0, sib, depth), curve.get(k)),
              "predicted_speedup_by_k": {str(K): x for K, x in curve.items()}, "confidence": confidence,
              "siblings": sib, "sibling_depth": depth,
              "predicted_speedup_gated": {f"K={K} below {c}" + (f", {m} siblings" if m else "")
                                          + (" with children" if d == 2 else ""): x
                                          for (K, c, m, d), x in gated.items() if c},
              "draft_quant": quant if standalone else None, "head_quant": hq,
              "alpha": agreement[0] if agreement else None, "cost_ratio": timed.get("cost_ratio"),
              "verify_cost": timed.get("verify_cost", {}), "decoder_cost": timed.get("decoder_cost"),
              "machine": machine_info(), "versions": versions()}
    if standalone:
        result["speedup_after_vs_before"] = val.tok_per_s["draft_after"] / val.tok_per_s["draft_before"]
    atomic_write_json(out, result)
    if not all(val.greedy_equal.values()):
        raise DraftsmithError(f"validate: speculative output differs from the target's greedy output "
                              f"({val.greedy_equal}); see {out}")
    return result


GATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # the thresholds `validate_head` predicts for


def _gated_curve(head, held: list[dict], dc, max_k: int, tokens: int, gate: bool, siblings: int = 0,
                 sibling_depth: int = 1) -> tuple[dict[int, float], dict[tuple[int, float, int, int], float]]:
    """Predicted speedups: by K for fixed rounds, and by (K, threshold, m, depth) for rounds that stop early
    (m = 0; threshold 0: never; only K >= 2 can stop early) or, m = `siblings` >= 2, propose m first tokens
    side by side below the threshold (depth 2, up to `sibling_depth`: with each one's next token, K >= 2),
    walking the decoder's own rounds on the head's teacher-forced records of the held-out references
    (`round_walk`, exact at temperature 0) over the round cost timed in the decoder."""
    records = depth_records(head, held, max_k, ranks=True)
    curve, gated = {}, {}
    for K in range(1, max_k + 1):
        for thr in (GATES if gate else (0.0,)):
            for m in ((0, siblings) if siblings and thr else (0,)):
                if K == 1 and thr and not m:
                    continue  # a round of one draft has nothing to stop early
                for d in range(1, (sibling_depth if m and K >= 2 else 1) + 1):
                    n, rounds = round_walk(records, K, thr, budget=tokens, siblings=m, sibling_depth=d)
                    gated[(K, thr, m, d)] = dc.walk_speedup(n, rounds, len(records))
        curve[K] = gated[(K, 0.0, 0, 1)]
    return curve, gated


def held_rows(folder: Path) -> list[dict] | None:
    """The held-out reference rows `run_head` wrote into folder/held (None where there are none)."""
    held = Path(folder) / "held"
    return load_head_data(held) if any(held.glob("shard-*.safetensors")) else None


def head_result(folder: Path) -> dict | None:
    """out/head.json of a head run (None when absent)."""
    return read_json(Path(folder) / HEAD_RESULT, missing_ok=True, what="head result")


__all__ = ["HEAD", "HeadRunConfig", "aux_layers_for", "carried_rates", "head_result", "run_head", "validate_head"]
