"""How far a forward is from what the machine allows: the memory floor and the compute roof, beside the measured
time of a cached forward over 1..N rows.

    .venv/bin/draftsmith floor --target qwen2.5-coder-1.5b-instruct --rows 16 --out floor.json   # and floor.png
    .venv/bin/draftsmith floor --from floor.json                  # its table and plot again, timing nothing

A cached decode step reads every weight once, so on a CPU its time cannot go below weight bytes / memory bandwidth
(the floor); a forward over T rows does T multiply-adds per weight, so it cannot go below 2 T params / peak FLOP/s
either (the roof). Both are measured here, on the machine that runs the model, with torch's own threads:
bandwidth as the best of a streaming sum, max and copy over a buffer far larger than the caches; peak as the best
of a cache-resident float32 matmul. `floor_report` times the target at 1..N rows (median of `repeats`, the
decoder's `COST_CONTEXT`-token context) and reports each time beside max(floor, roof), and v(K) = time(K+1 rows) /
time(1 row), the verify cost the decoder's K chooser uses.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn

from decode import native
from decode.kernels import DYNAMIC_INT8, best_time, dnn_layout

COST_CONTEXT = 64  # tokens of context when timing a forward: pair and validate (pairing.cost) time here too


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> dict[str, float]:
    """Streaming memory bandwidth in GB/s (1e9 bytes) with torch's threads, three ways, and the best of them:
    a sum and a max (read only) and a copy (bytes read plus bytes written) over `nbytes` of float32."""
    a = torch.empty(nbytes // 4).uniform_()
    b = torch.empty_like(a)
    gb = a.numel() * 4 / 1e9
    out = {
        "sum": gb / best_time(a.sum, reps),
        "amax": gb / best_time(a.amax, reps),
        "copy": 2 * gb / best_time(lambda: b.copy_(a), reps),
    }
    out["best"] = max(out.values())
    return out


def compute_peak(n: int = 512, reps: int = 20) -> float:
    """The best float32 GFLOP/s of an (n x n) @ (n x n) matmul whose operands stay in cache: the compute roof."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), reps) / 1e9


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


def floor_table(times: dict[int, float], nbytes: int, params: int, bandwidth_gbs: float,
                peak_gflops: float) -> dict:
    """Per row count: measured seconds, the floor (bytes / bandwidth), the roof (2 T params / peak), their max
    (the bound), measured / bound, and v(K) = time(K+1) / time(1) for K = T - 1 >= 1."""
    floor = nbytes / (bandwidth_gbs * 1e9)
    table = {}
    for T, t in sorted(times.items()):
        roof = 2 * T * params / (peak_gflops * 1e9)
        bound = max(floor, roof)
        table[T] = {"seconds": t, "floor_s": floor, "roof_s": roof, "bound_s": bound, "over_bound": t / bound,
                    "v": t / times[1] if 1 in times and T > 1 else None}
    return table


def floor_report(target: str, *, rows: int = 16, repeats: int = 5, max_seq_len: int = 256) -> dict:
    """Load `target` (a zoo name or folder), time its forward at 1..rows rows as the decoder runs it (its row plan,
    `plan_rows`) and, interleaved, every row count unpadded on oneDNN (no plan); measure the machine's bandwidth
    before and after (the best counts) and its compute peak; return the whole record."""
    from decode.loading import load
    from decode.machine import machine_info, versions
    from decode.runner import make_runner

    model = load(target).model
    runner = make_runner(model, max_seq_len)
    nbytes, params = weight_bytes(model)
    bw = [read_bandwidth()]
    plan, on_blas = dict(getattr(runner, "row_plan", {})), getattr(runner, "blas_rows", frozenset())
    on_native = getattr(runner, "native_rows", frozenset())
    times = forward_times(runner, list(range(1, rows + 1)), repeats=repeats, plans={"planned": plan, "unpadded": {}},
                          blas_rows={"planned": on_blas, "unpadded": frozenset()},
                          native_rows={"planned": on_native, "unpadded": frozenset()})
    bw.append(read_bandwidth())
    best_bw, peak = max(b["best"] for b in bw), compute_peak()
    tables = {s: floor_table(t, nbytes, params, best_bw, peak) for s, t in times.items()}
    table = tables["planned"]
    worst_v = max((row["v"] for T, row in table.items() if row["v"] is not None and T <= 9), default=None)
    return {
        "target": target, "machine": machine_info(), "versions": versions(),
        "dtype": str(next(model.parameters()).dtype), "weight_bytes": nbytes, "params": params,
        "bandwidth_gbs": {"runs": bw, "best": best_bw}, "peak_gflops": peak, "context": COST_CONTEXT,
        "repeats": repeats, "row_plan": plan, "blas_rows": sorted(on_blas),
        "native_rows": sorted(on_native), "rows": table,
        "compare": {"unpadded": tables["unpadded"]},
        "goals": {"one_row_over_floor": table[1]["over_bound"], "one_row_within_15pct": table[1]["over_bound"] <= 1.15,
                  "worst_v_K_le_8": worst_v, "v_K_le_8_within_1_15": worst_v is not None and worst_v <= 1.15},
    }


def format_floor(report: dict) -> str:
    """The table a person reads: rows, ms, floor, roof, measured / bound, v(K)."""
    other = report.get("compare", {})
    lines = [f"{report['target']}: {report['weight_bytes'] / 1e9:.2f} GB of weights, "
             f"bandwidth {report['bandwidth_gbs']['best']:.1f} GB/s, peak {report['peak_gflops']:.0f} GFLOP/s; "
             f"plan: pad {report.get('row_plan') or 'none'}, BLAS at rows {report.get('blas_rows') or 'none'}, "
             f"native at rows {report.get('native_rows') or 'none'}",
             f"{'rows':>4} {'ms':>8} {'floor ms':>9} {'roof ms':>8} {'x bound':>8} {'v(K)':>6}"
             + "".join(f" {s + ' ms':>9} {s + ' v':>7}" for s in other)]
    for T, row in report["rows"].items():
        v = f"{row['v']:.2f}" if row["v"] is not None else "-"
        line = (f"{T:>4} {row['seconds'] * 1e3:8.1f} {row['floor_s'] * 1e3:9.1f} {row['roof_s'] * 1e3:8.1f} "
                f"{row['over_bound']:8.2f} {v:>6}")
        for t in other.values():
            ov = f"{t[T]['v']:.2f}" if t[T]["v"] is not None else "-"
            line += f" {t[T]['seconds'] * 1e3:9.1f} {ov:>7}"
        lines.append(line)
    return "\n".join(lines)


COMPARED = {"unpadded": "every row count unpadded, oneDNN"}  # how a plot names the record's `compare` entries


def floor_plot(report: dict) -> bytes:
    """A floor record (`floor_report`, or its JSON read back) as one PNG: left, the forward's time by row count as
    the decoder runs it (and each compared way) beside the memory floor and the compute roof; right, v(K) beside
    the 1.15 that the floor goal asks for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from decode.io import png_bytes

    def by_rows(table: dict) -> dict[int, dict]:
        return {int(T): row for T, row in table.items()}

    planned = by_rows(report["rows"])
    series = {"as the decoder runs it": planned,
              **{COMPARED.get(name, name): by_rows(t) for name, t in report.get("compare", {}).items()}}
    rows = sorted(planned)
    fig, (ax, av) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (label, table), style in zip(series.items(), ("-o", "--s", ":^", "-.v")):
        ax.plot(rows, [table[T]["seconds"] * 1e3 for T in rows], style, ms=3, label=label)
        ks = [T - 1 for T in rows if T > 1 and table[T]["v"] is not None]
        av.plot(ks, [table[k + 1]["v"] for k in ks], style, ms=3, label=label)
    ax.axhline(planned[rows[0]]["floor_s"] * 1e3, color="grey", lw=1,
               label=f"memory floor ({report['bandwidth_gbs']['best']:.1f} GB/s)")
    ax.plot(rows, [planned[T]["roof_s"] * 1e3 for T in rows], color="grey", ls="-.", lw=1,
            label=f"compute roof ({report['peak_gflops']:.0f} GFLOP/s)")
    ax.set_xlabel("rows in the forward"), ax.set_ylabel("ms"), ax.set_ylim(bottom=0), ax.legend(fontsize=7)
    ax.set_title(f"{report['target']}: {report['weight_bytes'] / 1e9:.2f} GB, {report.get('dtype', '')}", fontsize=9)
    av.axhline(1.15, color="grey", lw=1, ls="--", label="goal: v(K) <= 1.15")
    av.set_xlabel("K (the verify reads K + 1 rows)"), av.set_ylabel("v(K) = time(K + 1 rows) / time(1 row)")
    av.legend(fontsize=7)
    machine = report.get("machine", {})
    where = [machine.get("cpu", "?"), f"{machine.get('cpu_count', '?')} cores", machine.get("cpu_capability")]
    av.set_title(", ".join(w for w in where if w), fontsize=9)
    return png_bytes(fig)


PLAN_ROWS = 12  # row counts planned: verify steps up to K = 11
PLAN_MIN_BYTES = 256 * 10**6  # smaller models (tests' tiny ones) are never timed: their steps are overhead
_PLANS: dict[tuple, dict[int, int]] = {}  # per process: (model identity) -> row plan


def choose_rows(times: dict[int, float], *, gain: float = 0.95) -> dict[int, int]:
    """T -> the row count T' >= T whose forward is fastest, where it is faster than T's own by more than
    1 - `gain` (noise is not a reason to pad); only the T that pad are listed."""
    plan = {}
    for T, t in times.items():
        best = min((times[r], r) for r in times if r >= T)
        if best[1] > T and best[0] < gain * t:
            plan[T] = best[1]
    return plan


def plan_rows(runner, key: tuple, nbytes: int, *, repeats: int = 3) -> dict[int, int]:
    """Give a lean runner on the CPU its `row_plan`, `blas_rows` and `native_rows`: cached forwards over
    1..PLAN_ROWS rows timed once per process and model (`key`), on oneDNN's kernels and (where the runner has float
    Linears on them) on BLAS and, over 1..12 rows of float32 or int8 Linears, on `decode.native`'s kernel,
    interleaved; each row count runs on the fastest kernels (`choose_kernels`, BLAS then native), then at the
    fastest count at or above it (`choose_rows`). On the AMD EPYC here the float32 Qwen2.5-Coder-1.5B's one-row step ran 228.6 ms
    planned against 277.9 unpadded; on the Intel Xeon it ran 240.0 ms on BLAS against oneDNN's 267.9
    (docs/results/floor.md). Models under PLAN_MIN_BYTES of weights (`nbytes`, as loaded) and DRAFTSMITH_ROWS=off
    get no plan (every forward at its own row count, on oneDNN)."""
    if (os.environ.get("DRAFTSMITH_ROWS", "auto") == "off" or not hasattr(runner, "row_plan")
            or runner.max_seq_len < COST_CONTEXT + PLAN_ROWS or runner.cos.device.type != "cpu"):
        return {}
    if nbytes < PLAN_MIN_BYTES:
        return {}
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
        best, on_native_rows = choose_kernels(best, times.get("native", {}))  # the same rule against that choice
        _PLANS[key] = (choose_rows(best), on_blas - on_native_rows, on_native_rows)
    plan, runner.blas_rows, runner.native_rows = _PLANS[key]
    runner.row_plan = dict(plan)
    return runner.row_plan


def choose_kernels(dnn: dict[int, float], blas: dict[int, float], *,
                   gain: float = 0.95) -> tuple[dict[int, float], frozenset[int]]:
    """Per row count, oneDNN's time (`dnn`) or BLAS's (`blas`, where timed) where that is faster by more than
    1 - `gain` (noise is not a reason to switch) -> (the time each row count runs at, the counts that run BLAS).
    `plan_rows` applies it again to that choice and the native kernel's times."""
    on_blas = frozenset(T for T, t in blas.items() if T in dnn and t < gain * dnn[T])
    return {T: blas[T] if T in on_blas else t for T, t in dnn.items()}, on_blas

