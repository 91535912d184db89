"""The row plan: how many rows a few-row forward runs at, and on which kernels, on this machine.

    from draftsmith.decode.runtime.plan import plan_rows
    plan_rows(runner, key, nbytes)   # times cached forwards over 1..PLAN_ROWS rows once per process and model

A cached forward over T rows can run faster padded to T' > T rows, or on BLAS or the native kernel rather than
oneDNN, depending on the machine; `plan_rows` times each way once (`forward_times`) and gives the runner its
`row_plan`, `blas_rows` and `native_rows`, saved in the cache (`<cache>/plans/*.json`) so a later process on the
same machine times nothing. `draftsmith floor` (`decode.floor`) shows the result beside the memory
floor and compute roof.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from draftsmith.decode.runtime import native
from draftsmith.decode.runtime.io import atomic_write_json
from draftsmith.decode.runtime.kernels import DYNAMIC_INT8, dnn_layout
from draftsmith.decode.runtime.machine import machine_info
from draftsmith.decode.runtime.settings import current

COST_CONTEXT = 64  # tokens of context when timing a forward: pair and validate (pairing.cost) time here too
PLAN_ROWS = 12  # row counts planned: verify steps up to K = 11
PLAN_MIN_BYTES = 256 * 10**6  # smaller models (tests' tiny ones) are never timed: their steps are overhead
NATIVE_GAIN = 0.90  # a row count runs draftsmith's own kernel only where it timed > 10% faster than torch's
_PLANS: dict[tuple, tuple[dict[int, int], frozenset[int], frozenset[int]]] = {}  # per process: model -> plan


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes, parameters) a cached forward reads: every Linear weight (the LM head included) once; the
    embedding table is indexed, not read whole, so it counts only where it is also the (tied) LM head."""
    seen: set[int] = set()
    nbytes = params = 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            nbytes += m.weight.numel() * m.weight.element_size()
            params += m.weight.numel()
    return nbytes, params


@torch.inference_mode()
def forward_times(runner, rows: list[int], *, context: int = COST_CONTEXT, repeats: int = 5, warmup: int = 2,
                  plans: dict[str, dict[int, int]] | None = None,
                  blas_rows: dict[str, frozenset[int]] | None = None,
                  native_rows: dict[str, frozenset[int]] | None = None,
                  only: dict[str, frozenset[int]] | None = None) -> dict[str, dict[int, float]]:
    """Median seconds of one cached forward over T rows at `context` tokens of context, for each T in `rows` and
    each named row plan (`LeanLM.row_plan`; default: the runner's own, as "planned") with its BLAS rows and native
    rows (`blas_rows[name]`, `native_rows[name]`, `LeanLM.blas_rows` / `native_rows`; default: the runner's own),
    interleaved: each repeat times every (plan, T) once, so drift hits all alike; `only[name]` limits a plan to
    those T. The runner keeps its own plan afterwards."""
    plans = plans if plans is not None else {"planned": getattr(runner, "row_plan", {})}
    own = getattr(runner, "row_plan", None)
    own_blas, own_native = getattr(runner, "blas_rows", None), getattr(runner, "native_rows", None)
    ids = torch.arange(context + max(rows)) % runner.vocab_size
    runner.forward(ids[:context], 0, keep=1)
    timed = {name: [T for T in rows if only is None or name not in only or T in only[name]] for name in plans}
    times: dict[str, dict[int, list[float]]] = {name: {T: [] for T in timed[name]} for name in plans}
    try:
        for r in range(warmup + repeats):
            for name, plan in plans.items():
                if own is not None:
                    runner.row_plan = plan
                if own_blas is not None:
                    runner.blas_rows = (blas_rows or {}).get(name, own_blas)
                if own_native is not None:
                    runner.native_rows = (native_rows or {}).get(name, own_native)
                for T in timed[name]:
                    t0 = time.perf_counter()
                    runner.forward(ids[context : context + T], context)
                    if r >= warmup:
                        times[name][T].append(time.perf_counter() - t0)
    finally:
        if own is not None:
            runner.row_plan = own
        if own_blas is not None:
            runner.blas_rows = own_blas
        if own_native is not None:
            runner.native_rows = own_native
    return {name: {T: statistics.median(ts) for T, ts in by.items()} for name, by in times.items()}


def choose_rows(times: dict[int, float], *, gain: float = 0.95) -> dict[int, int]:
    """T -> the row count T' >= T whose forward is fastest, where it is faster than T's own by more than
    1 - `gain` (noise is not a reason to pad); only the T that pad are listed."""
    plan = {}
    for T, t in times.items():
        best = min((times[r], r) for r in times if r >= T)
        if best[1] > T and best[0] < gain * t:
            plan[T] = best[1]
    return plan


def plan_rows(runner, key: tuple, nbytes: int, *, repeats: int = 3, store: Path | None = None) -> dict[int, int]:
    """Give a lean runner on the CPU its `row_plan`, `blas_rows` and `native_rows`: cached forwards over
    1..PLAN_ROWS rows timed once per model (`key`) and machine, kept for the process and, with `store` (a folder:
    `make_runner` passes `<cache>/plans`), saved there as JSON a person can read (`saved_plan`) and reused by every
    later process on this machine under the same settings, so no forward is timed again. Timed on oneDNN's kernels
    and (where the runner has float Linears on them) on BLAS and, over 1..12 rows of float32 or int8 Linears, on
    `decode.runtime.native`'s kernel, interleaved; each row count runs on the fastest kernels (`choose_kernels`,
    BLAS then native, native only where it beats the library's by more than 10%: `NATIVE_GAIN`), then at the
    fastest count at or above it (`choose_rows`). On the AMD EPYC here the float32 Qwen2.5-Coder-1.5B's one-row
    step ran 228.6 ms planned against 277.9 unpadded; on the Intel Xeon it ran 240.0 ms on BLAS against oneDNN's
    267.9 (docs/results/floor.md). Models under PLAN_MIN_BYTES of weights (`nbytes`, as loaded) and
    `RuntimeSettings(rows=False)` get no plan (every forward at its own row count, on oneDNN)."""
    if (not current().rows or not hasattr(runner, "row_plan")
            or runner.max_seq_len < COST_CONTEXT + PLAN_ROWS or runner.cos.device.type != "cpu"):
        return {}
    if nbytes < PLAN_MIN_BYTES:
        return {}
    path = None
    if key not in _PLANS and store is not None:  # a later process: the plan an earlier one saved, if any
        path = store / f"{_plan_key(key)}.json"
        if (saved := saved_plan(path)) is not None:
            _PLANS[key] = saved
    if key not in _PLANS:
        runner.row_plan, runner.blas_rows, runner.native_rows = {}, frozenset(), frozenset()
        rows = list(range(1, PLAN_ROWS + 1))
        on_dnn = any(type(m) is nn.Linear and dnn_layout(m.weight) for m in runner.modules())
        on_native = native.kernels() is not None and any(
            (type(m) is nn.Linear and m.weight.dtype == torch.float32) or type(m) is DYNAMIC_INT8
            for m in runner.modules())  # float32 Linears, or the int8 draft's
        few = frozenset(range(1, native.MAX_ROWS + 1))
        plans = {"dnn": {}, **({"blas": {}} if on_dnn else {}), **({"native": {}} if on_native else {})}
        kw = dict(repeats=repeats, warmup=1, plans=plans, blas_rows={"blas": frozenset(rows)},
                  native_rows={"native": few}, only={"native": few})
        # two rounds, the faster of each: this machine's read speed drifts for tens of seconds at a time (the native
        # one-row step of the 1.5B timed 194 ms in one round and 138 in the next, in one process), and a plan
        # chosen in a slow round pads every few-row step onto a slower kernel for the whole process
        first, again = forward_times(runner, rows, **kw), forward_times(runner, rows, **kw)
        times = {name: {T: min(t, again[name][T]) for T, t in by_rows.items()} for name, by_rows in first.items()}
        best, on_blas = choose_kernels(times["dnn"], times.get("blas", {}))
        # ours only where it is clearly faster than the library's (docs/results/kernels.md: within 10%, the library's)
        best, on_native_rows = choose_kernels(best, times.get("native", {}), gain=NATIVE_GAIN)
        _PLANS[key] = (choose_rows(best), on_blas - on_native_rows, on_native_rows)
        if path is not None:
            _save_plan(path, key, _PLANS[key], times)
    plan, runner.blas_rows, runner.native_rows = _PLANS[key]
    runner.row_plan = dict(plan)
    return runner.row_plan


def _plan_key(key: tuple) -> str:
    """The file name of a plan: the model (`key`), this machine (CPU, vector instructions, cores, threads), torch's
    version, the settings it ran under and whether the native kernel was there."""
    machine = (repr(key), machine_info(), torch.__version__,
               json.dumps(current().to_dict(), sort_keys=True), native.kernels() is not None)
    return hashlib.sha256(repr(machine).encode()).hexdigest()[:16]


def saved_plan(path: Path) -> tuple[dict[int, int], frozenset[int], frozenset[int]] | None:
    """A plan `plan_rows` saved (row plan, BLAS rows, native rows), or None where there is none or it is damaged
    (then it is timed again and replaced)."""
    try:
        d = json.loads(path.read_text())
        return ({int(t): int(r) for t, r in d["row_plan"].items()}, frozenset(d["blas_rows"]),
                frozenset(d["native_rows"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _save_plan(path: Path, key: tuple, plan: tuple, times: dict) -> None:
    try:
        atomic_write_json(path, {"model": repr(key), "row_plan": {str(t): r for t, r in plan[0].items()},
                                 "blas_rows": sorted(plan[1]), "native_rows": sorted(plan[2]),
                                 "seconds": {name: {str(t): v for t, v in by.items()} for name, by in times.items()},
                                 "settings": current().to_dict(), "torch": torch.__version__})
    except OSError:  # a read-only cache: the plan holds for this process
        pass


def choose_kernels(dnn: dict[int, float], blas: dict[int, float], *,
                   gain: float = 0.95) -> tuple[dict[int, float], frozenset[int]]:
    """Per row count, oneDNN's time (`dnn`) or BLAS's (`blas`, where timed) where that is faster by more than
    1 - `gain` (noise is not a reason to switch) -> (the time each row count runs at, the counts that run BLAS).
    `plan_rows` applies it again to that choice and the native kernel's times."""
    on_blas = frozenset(T for T, t in blas.items() if T in dnn and t < gain * dnn[T])
    return {T: blas[T] if T in on_blas else t for T, t in dnn.items()}, on_blas
