"""alpha against the tokens a draft has trained on: the learning curve, its fit, and what it predicts.

    points = learning_curve(rows)              # log.jsonl's rows -> [(tokens seen, held-out alpha), ...]
    fit = fit_log_curve(points)                # alpha ~ a + b ln(tokens), least squares
    fit.tokens_for(points[0][1] + 0.05)        # tokens the fit predicts for +0.05 alpha over the start

What a user with a GPU should budget: the fit is the simplest curve that bends the way these curves bend (each
doubling of the data buying the same gain); it is an extrapolation from the points measured, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass


def learning_curve(rows: Iterable[dict]) -> list[tuple[int, float]]:
    """(tokens trained on so far, alpha) at each evaluation of a training log (log.jsonl's rows in order: step rows
    carry `tokens`, evaluation rows `eval` and `alpha`); the evaluation before training is at 0 tokens. Rows of a
    step logged twice (a resumed run) count once."""
    seen: dict[int, int] = {}
    points: list[tuple[int, float]] = []
    for r in rows:
        if r.get("eval"):
            if r.get("alpha") is not None:
                points.append((sum(v for s, v in seen.items() if s <= r["step"]), float(r["alpha"])))
        elif r.get("tokens") is not None and r.get("step") is not None:
            seen[int(r["step"])] = int(r["tokens"])
    return points


@dataclass(frozen=True)
class LogFit:
    """alpha ~ a + b ln(tokens), fitted on `points` evaluations after training began."""

    a: float
    b: float
    points: int

    def alpha_at(self, tokens: float) -> float:
        return self.a + self.b * math.log(tokens)

    def tokens_for(self, alpha: float) -> float | None:
        """The tokens at which the fit reaches `alpha` (None where it never does: b <= 0)."""
        if self.b <= 0:
            return None
        return math.exp((alpha - self.a) / self.b)

    def to_dict(self) -> dict:
        return asdict(self)


def fit_log_curve(points: Iterable[tuple[float, float]]) -> LogFit | None:
    """Least squares of alpha on ln(tokens) over the points with tokens > 0 (float64, closed form); None with fewer
    than two distinct token counts."""
    pts = [(math.log(t), float(a)) for t, a in points if t > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return LogFit(a=my - b * mx, b=b, points=n)


def curve_summary(rows: Iterable[dict], gain: float = 0.05) -> dict:
    """The curve, its fit and the tokens the fit predicts for `gain` alpha over the evaluation before training
    (`tokens_for_gain`; None where the fit does not rise or there is no fit)."""
    points = learning_curve(rows)
    fit = fit_log_curve(points)
    start = points[0][1] if points and points[0][0] == 0 else None
    need = fit.tokens_for(start + gain) if fit is not None and start is not None else None
    return {"points": [{"tokens": t, "alpha": a} for t, a in points], "fit": fit.to_dict() if fit else None,
            "gain": gain, "tokens_for_gain": need,
            "tokens_seen": points[-1][0] if points else 0}
