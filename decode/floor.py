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

import torch

from draftsmith.decode.runtime.kernels import best_time
from draftsmith.decode.runtime.loading import load
from draftsmith.decode.runtime.machine import machine_info, versions
from draftsmith.decode.runtime.plan import COST_CONTEXT, forward_times, weight_bytes
from draftsmith.decode.runtime.runner import make_runner


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

    from draftsmith.decode.runtime.io import png_bytes

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


