"""The cost model: what a draft step and a verify step cost on this machine, and the speedup they predict.

    from draftsmith.pairing.cost import measure_cost, speedup_curve
    cost = measure_cost(target_runner, draft_runner)        # runners from decode.runtime.runner.make_runner
    curve = speedup_curve(alpha, cost.c, cost.v)            # K -> predicted speedup (K chosen: pairing.policy)

Definitions (docs/design.md): `c` = one cached one-token draft forward / one cached one-token target
forward; `v(K)` = one cached target forward over K+1 tokens / one cached one-token target forward;
predicted speedup = E[tau] / (K*c + v(K)) with E[tau] = (1 - alpha^(K+1)) / (1 - alpha), tau counting the
bonus/corrected token; best K = its argmax over K in 1..16 (`pairing.policy.choose_policy`).

Why v(K) is measured per K and not assumed to be 1: on CPU the cost of a forward over T tokens depends
strongly on matrix shapes. Measured on this machine for a 1.5B float32 target, T=2 and T=4 cost ~1.45x a
one-token step, T=3 ~2.15x, T=8 ~2.5x, so the best K can sit on a dip of v rather than where a flat curve
would put it. Leviathan et al. 2023 (Thm 3.8) is the special case v = 1, which a GPU roughly gives for
small K.

Timing follows the decoder: both caches are filled with `context` tokens, then every timed call runs at
position `context` (the runners roll their caches back by position, so repeating a call there is valid).
The draft step keeps one row (keep=1) as the decoder does; the verify forward keeps all K+1 rows. Rounds
are interleaved (each round times every shape once) so that drift on a shared machine hits all shapes
alike; warm-up rounds are excluded; each timing is the median over `repeats` rounds (on a shared machine
a preempted call costs a whole time slice, a few ms: raise `repeats` when steps are that short). Timings
use the torch thread settings in force, so call this as the decoder will run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from draftsmith.decode.runtime.plan import COST_CONTEXT  # tokens of context when timing c and v(K): pair, validate, floor alike
from draftsmith.decode.runtime.runner import Runner
from draftsmith.decode.speculative import KPolicy, RoundClock, generate

K_RANGE = range(1, 17)


@dataclass
class CostModel:
    target_step_s: float  # median time of one cached one-token target forward
    draft_step_s: float  # same for the draft runner, as it will run (e.g. int8)
    verify_s: dict[int, float]  # K -> median time of one cached target forward over K+1 tokens
    context: int  # tokens already in the caches when timing
    repeats: int

    @classmethod
    def from_ratios(cls, c: float, v: dict[int, float]) -> "CostModel":
        """A cost model from the ratios alone (a target step of 1 s): for predictions on given c and v(K)."""
        return cls(1.0, c, dict(v), 0, 0)

    @property
    def c(self) -> float:
        return self.draft_step_s / self.target_step_s

    @property
    def v(self) -> dict[int, float]:
        return {K: t / self.target_step_s for K, t in sorted(self.verify_s.items())}

    def to_dict(self) -> dict:
        return {
            "target_step_s": self.target_step_s,
            "draft_step_s": self.draft_step_s,
            "verify_s": {str(K): t for K, t in sorted(self.verify_s.items())},
            "context": self.context,
            "repeats": self.repeats,
            "c": self.c,
            "v": {str(K): x for K, x in self.v.items()},
            "definitions": {
                "c": "draft one-token forward / target one-token forward (cached, median)",
                "v": "target forward over K+1 tokens / target one-token forward (cached, median)",
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Inverse of `to_dict` (the derived c and v are recomputed from the raw timings)."""
        return cls(
            target_step_s=float(d["target_step_s"]), draft_step_s=float(d["draft_step_s"]),
            verify_s={int(K): float(t) for K, t in d["verify_s"].items()},
            context=int(d["context"]), repeats=int(d["repeats"]),
        )


# -- the math: small pure functions --


def _check_alpha_k(alpha: float, K: int) -> None:
    if not 0.0 <= alpha <= 1.0:  # also rejects NaN
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")


def expected_tau(alpha: float, K: int) -> float:
    """E[tau] = (1 - alpha^(K+1)) / (1 - alpha), i.i.d. acceptance; K+1 at alpha = 1. Counts the bonus token."""
    _check_alpha_k(alpha, K)
    return sum(alpha**i for i in range(K + 1))  # the same sum, without 0/0 at alpha = 1


def speedup_from_tau(tau: float, K: int, c: float, v_K: float) -> float:
    """E[tau] / (K*c + v(K)) for any estimate of E[tau] (i.i.d. here, by depth in pairing.depth)."""
    if not c >= 0.0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    if not v_K > 0.0:
        raise ValueError(f"verify cost v(K) must be > 0, got {v_K} at K={K}")
    return tau / (K * c + v_K)


def predicted_speedup(alpha: float, K: int, c: float, v_K: float) -> float:
    """E[tau] / (K*c + v(K)): tokens per unit of target-step time, relative to the target alone."""
    _check_alpha_k(alpha, K)
    return speedup_from_tau(expected_tau(alpha, K), K, c, v_K)


def speedup_curve(alpha: float, c: float, v: dict[int, float]) -> dict[int, float]:
    """K -> predicted speedup, for every K in v."""
    return {K: predicted_speedup(alpha, K, c, v_K) for K, v_K in sorted(v.items())}




# -- measurement --


def _timer(device: torch.device):
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(runner: Runner, tokens: torch.Tensor, pos: int, keep: int) -> float:
        sync()
        t0 = time.perf_counter()
        runner.forward(tokens, pos, keep)
        sync()
        return time.perf_counter() - t0

    return timed


@torch.inference_mode()
def measure_cost(
    target_runner: Runner,
    draft_runner: Runner | None,
    *,
    ks: Iterable[int] = K_RANGE,
    context: int = COST_CONTEXT,
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = False,
    device: torch.device | str = "cpu",
) -> CostModel:
    """Median cached-forward times of both runners at `context` tokens of context; see the module docstring.

    `device` is where the token ids go (the runners' device), as in `decode.speculative.generate`.
    `draft_runner=None` times the target alone (draft_step_s = 0): a head's step is timed in the decoder.
    """
    ks = sorted(set(ks))
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be a non-empty set of K >= 1, got {ks}")
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for name, runner, T in (("target", target_runner, ks[-1] + 1), ("draft", draft_runner, 1)):
        if runner is not None and context + T > runner.max_seq_len:
            raise ValueError(f"{name} cache holds {runner.max_seq_len} positions, timing needs {context + T}")
    device = torch.device(device)
    timed = _timer(device)

    def ids(runner: Runner, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=device) % runner.vocab_size

    target_runner.forward(ids(target_runner, 0, context), 0, keep=1)
    # every shape timed: name -> (runner, tokens, keep)
    shapes = {"target": (target_runner, ids(target_runner, context, 1), 0)}
    if draft_runner is not None:
        draft_runner.forward(ids(draft_runner, 0, context), 0, keep=1)
        shapes["draft"] = (draft_runner, ids(draft_runner, context, 1), 1)
    shapes.update({K: (target_runner, ids(target_runner, context, K + 1), 0) for K in ks})
    times: dict = {name: [] for name in shapes}
    for r in tqdm(range(warmup + repeats), desc="cost", disable=not progress):
        for name, (runner, tokens, keep) in shapes.items():
            t = timed(runner, tokens, context, keep)
            if r >= warmup:
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return CostModel(
        target_step_s=med["target"], draft_step_s=med.get("draft", 0.0), verify_s={K: med[K] for K in ks},
        context=context, repeats=repeats,
    )


# -- cost as it happens: what rounds cost inside the decoder --


@dataclass
class DecoderCost:
    """Seconds of each part of a round inside `decode.speculative.generate`, from a short calibration decode
    (`calibrate_decoder`), plus the verify forward at every K.

    Target alone: `target_prefill_s` per prompt, then `target_token_s` a token (a one-token forward, its
    sampling and bookkeeping). With the draft: `spec_prefill_s` per prompt (both caches), then rounds of
    K draft steps (`draft_step_s` each, at the contexts decoding reaches, a first step that may feed two
    tokens and the draft's sampling included), one verify forward (`verify_s[K]`) and `other_s` outside the
    forwards. `verify_s` is measured in the decoder at `calibration_k` and carried to other K by the shape of
    the isolated curve v(K) (`measure_cost` at the decoder's mean context): verify_s[K] = v_iso(K) *
    (verify in the decoder at calibration_k / v_iso(calibration_k))."""

    target_token_s: float
    target_prefill_s: float
    spec_prefill_s: float
    draft_step_s: float
    other_s: float
    verify_s: dict[int, float]
    calibration_k: int
    calibration_seconds: float  # wall time of the calibration decodes (what this estimate cost)
    calibration_tokens: int
    shared_over: int = 1  # calibrations whose target side this one's is the median of (`shared_target_clock`)

    def round_s(self, K: int, steps: int | None = None) -> float:
        """Seconds of one round at K drafted tokens: `steps` draft steps (K unless told: a sibling round drafts
        its K tokens in one) + the verify forward over K + 1 rows + the rest."""
        if K not in self.verify_s:
            raise ValueError(f"no verify time for K={K} (have {sorted(self.verify_s)})")
        return (K if steps is None else steps) * self.draft_step_s + self.verify_s[K] + self.other_s

    def speedup(self, tau: float, K: int, tokens: float) -> float:
        """Predicted tokens/s with the draft over tokens/s alone, for prompts of `tokens` new tokens each:
        (prefill alone + tokens * token time) / (prefill with draft + tokens / tau * round time)."""
        return decoder_speedup(tau, K, tokens, target_token_s=self.target_token_s,
                               target_prefill_s=self.target_prefill_s, spec_prefill_s=self.spec_prefill_s,
                               round_s=self.round_s(K))

    def walk_speedup(self, tokens: int, drafted: list[int] | list[tuple[int, int]], prompts: int) -> float:
        """Predicted speedup of a walk of rounds (`pairing.depth.gated_walk` or `round_walk`): `tokens` emitted
        over `prompts` prompts in rounds that drafted `drafted` tokens each (0: a plain target step at the
        budget's end), or (draft steps, tokens drafted) per round: (prompts * prefill alone + tokens * token
        time) / (prompts * prefill with the draft + sum of the rounds)."""
        if tokens < 1 or prompts < 1 or not drafted:
            raise ValueError("need tokens >= 1, prompts >= 1 and at least one round")
        rounds = [(d, d) if isinstance(d, int) else d for d in drafted]
        spent = sum(self.round_s(d, steps) if d else self.target_token_s for steps, d in rounds)
        return ((prompts * self.target_prefill_s + tokens * self.target_token_s)
                / (prompts * self.spec_prefill_s + spent))

    def to_dict(self) -> dict:
        return {
            "target_token_s": self.target_token_s, "target_prefill_s": self.target_prefill_s,
            "spec_prefill_s": self.spec_prefill_s, "draft_step_s": self.draft_step_s, "other_s": self.other_s,
            "verify_s": {str(K): t for K, t in sorted(self.verify_s.items())},
            "round_s": {str(K): self.round_s(K) for K in sorted(self.verify_s)},
            "calibration_k": self.calibration_k, "calibration_seconds": self.calibration_seconds,
            "calibration_tokens": self.calibration_tokens, "target_side_shared_over": self.shared_over,
        }


def shared_target_clock(costs: Sequence[DecoderCost]) -> list[DecoderCost]:
    """Each calibration's target side (the one-token step, the prefill alone, the verify at every K) replaced by
    the median over all of them; the draft's side (its step, its share of the prefill, the rest of a round) kept.

    Every candidate of a leaderboard is verified by the same target, but each calibration times it in its own
    short window, and a VM's speed drifts between windows: on the 2-core EPYC one window timed the 1.5B's verify
    at 0.206 s where the three others timed 0.157-0.164, which alone ranked that candidate last. The pointwise
    median of non-decreasing verify curves is non-decreasing, so the shape rule of `calibrate_decoder` holds."""
    if len(costs) < 2:
        return list(costs)
    med = statistics.median
    token = med(c.target_token_s for c in costs)
    prefill = med(c.target_prefill_s for c in costs)
    ks = sorted(set.intersection(*(set(c.verify_s) for c in costs)))
    verify = {K: med(c.verify_s[K] for c in costs) for K in ks}
    return [replace(c, target_token_s=token, target_prefill_s=prefill, verify_s=dict(verify),
                    spec_prefill_s=prefill + max(0.0, c.spec_prefill_s - c.target_prefill_s),
                    shared_over=len(costs)) for c in costs]


def decoder_speedup(tau: float, K: int, tokens: float, *, target_token_s: float, target_prefill_s: float,
                    spec_prefill_s: float, round_s: float) -> float:
    """(target_prefill_s + tokens * target_token_s) / (spec_prefill_s + tokens / tau * round_s): a prompt's
    decode alone over the same with the draft, `tau` tokens per round (1 <= tau <= K+1)."""
    if not 1.0 <= tau <= K + 1 + 1e-9:
        raise ValueError(f"tokens per round must lie in [1, K+1] = [1, {K + 1}], got {tau}")
    if tokens <= 0 or target_token_s <= 0 or round_s <= 0 or target_prefill_s < 0 or spec_prefill_s < 0:
        raise ValueError("need tokens, target_token_s, round_s > 0 and prefill times >= 0")
    return (target_prefill_s + tokens * target_token_s) / (spec_prefill_s + tokens / tau * round_s)


@torch.inference_mode()
def calibrate_decoder(
    target_runner: Runner,
    draft_runner: Runner,
    prompts: list[list[int]],
    *,
    k: int,
    isolated: CostModel,
    max_new_tokens: int = 32,
    eos_ids: Iterable[int] = (),
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> DecoderCost:
    """Decode `prompts` with the target alone and with the draft at K = k (greedy, interleaved prompt by
    prompt, after a warm-up) with a `RoundClock`, and read what each part of a round costs; `isolated` (from
    `measure_cost`) gives the shape of v(K) to carry the verify time to other K, made non-decreasing in K (a
    busy machine can time a longer verify below a shorter one; trusting that dip picks a K that does not pay).
    Per-round times are medians over the rounds: a one-off stall (a page fault while the machine reclaims memory,
    a cold kernel) would otherwise set the mean of a 2-prompt decode. See `DecoderCost`."""
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    if k not in isolated.verify_s:
        raise ValueError(f"the isolated cost has no v(K) at the calibration K={k}")
    eos = list(eos_ids)
    policy = KPolicy(k=k, k_max=max(k, 16))
    t0 = time.perf_counter()
    generate(target_runner, prompts[0][:16], draft=draft_runner, max_new_tokens=4, policy=policy, device=device)
    alone, spec = RoundClock(), RoundClock()
    tokens = 0
    for ids in tqdm(prompts, desc="calibrate", unit="prompt", disable=not progress):
        generate(target_runner, list(ids), max_new_tokens=max_new_tokens, eos_ids=eos, device=device, clock=alone)
        res = generate(target_runner, list(ids), draft=draft_runner, max_new_tokens=max_new_tokens, eos_ids=eos,
                       policy=policy, device=device, clock=spec)
        tokens += res.stats.new_tokens
    seconds = time.perf_counter() - t0
    full = [r for r in spec.rounds if r[0] == k] or [r for r in spec.rounds if r[0]]
    if not full:  # no round drafted anything
        raise ValueError("the calibration decode drafted nothing: give longer prompts or more new tokens")
    verify_k = statistics.median(r[2] for r in full)
    k_cal = round(statistics.fmean(r[0] for r in full))
    shape, top = {}, 0.0  # a forward over more tokens never costs less: a dip in the timed shape is noise
    for K in sorted(isolated.verify_s):
        top = shape[K] = max(top, isolated.verify_s[K])
    scale = verify_k / shape[k_cal]
    return DecoderCost(
        target_token_s=statistics.median(r[3] for r in alone.rounds),
        target_prefill_s=statistics.fmean(alone.prefill_s),
        spec_prefill_s=statistics.fmean(spec.prefill_s),
        draft_step_s=statistics.median(r[1] / r[4] for r in spec.rounds if r[4]),
        other_s=statistics.median(r[3] - r[1] - r[2] for r in spec.rounds),
        verify_s={K: t * scale for K, t in shape.items()},
        calibration_k=k_cal, calibration_seconds=seconds, calibration_tokens=tokens,
    )
