"""Where a speedup comes from: the ladder.

A ladder is a list of rungs, each a draft at a round policy, the next rung changing one thing about the one below
(the stock draft as loaded at plain K -> with its walked policy -> int4 weights -> a pruned vocabulary -> trained).
All rungs decode side by side with the target alone in one interleaved run (`pairing.validate.validate`: same test
prompts, same repeats), so each rung's tokens/s over the rung below is the worth of the one thing it changed,
measured, per domain, as the median and range of the repeats, next to the speedup its dev-prompt evidence predicted.

    table = ladder(validation, [Rung("stock_plain", "stock 0.5B as loaded, plain K = 4", predicted=1.62),
                                Rung("draft_before", "its walked policy", predicted=1.71), ...])
    table["rungs"][1]["over_below"]["code"]   # {"median": 1.06, "range": [1.02, 1.08], "repeats": [...]}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from draftsmith.decode.bench import Validation
from draftsmith.decode.runtime.errors import DraftsmithError

LADDER_VERSION = 1


@dataclass(frozen=True)
class Rung:
    """One rung: decoder `name` in the validation, what it changes over the rung below (`step`; the first rung's
    says what it is), and the speedup over the target alone its dev-prompt evidence predicted (None: none)."""

    name: str
    step: str
    predicted: float | None = None


def ladder(val: Validation, rungs: list[Rung]) -> dict:
    """Each rung's tokens/s over the target alone and over the rung below, over all prompts ("all") and per domain:
    `Validation.ratio_by_group` (each repeat's ratio; median, range, repeats). The first rung has no rung below.
    -> {"version", "groups": ["all", domains...], "rungs": [{name, step, predicted, over_target, over_below}]}."""
    if not rungs:
        raise DraftsmithError("ladder: no rungs")
    missing = [r.name for r in rungs if r.name not in val.stats]
    if missing:
        raise DraftsmithError(f"ladder: rungs {missing} were not timed (timed: {val.drafts})")
    if len({r.name for r in rungs}) != len(rungs):
        raise DraftsmithError(f"ladder: a decoder appears twice in {[r.name for r in rungs]}")
    rows = []
    for i, r in enumerate(rungs):
        rows.append({**asdict(r), "over_target": val.ratio_by_group(r.name),
                     "over_below": val.ratio_by_group(r.name, rungs[i - 1].name) if i else None})
    groups = list(rows[0]["over_target"])
    return {"version": LADDER_VERSION, "groups": groups, "rungs": rows}


def waterfall(table: dict, group: str = "all") -> list[tuple[str, float, float]]:
    """The waterfall of `group`: (rung step, level below, level here) for each rung, levels being speedups over the
    target alone (medians); the first rung starts from the target alone (1.0). What a waterfall chart draws."""
    out, below = [], 1.0
    for r in table["rungs"]:
        here = r["over_target"][group]["median"]
        out.append((r["step"], below, here))
        below = here
    return out
