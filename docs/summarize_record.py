"""Trim raw run records under docs/ to small summaries, in place (docs/ stays under 1 MB; a record under 20 KB).

A tracked record keeps what the results pages read: the pick, the policy, per-decoder tokens/s, the speedups'
medians and ranges (overall and by domain), greedy equality, prompt ids, machine, versions, command. The raw
per-prompt and per-repeat timings are not tracked: the command on the results page regenerates the full file.

    python3 docs/summarize_record.py RUN/bench.json RUN/race.json ...   # rewrite each file in place
    python3 docs/summarize_record.py --keep expected_tau,verify_s FILE  # a page quotes these: keep them whole
    python3 docs/summarize_record.py --check FILE ...                   # exit 1 unless each file is a summary
    python3 docs/summarize_record.py --out DIR FILE ...                 # write DIR/FILE instead

Standard library only, generic, idempotent (a summary summarizes to itself, byte for byte):
  * DROP keys go wherever they are ("a/*/b": b under a's children); DROP_BLOBS keys only where they hold
    dicts or records ("repeats": 5 stays); so do nulls and empty dicts and lists;
  * --keep keys are neither dropped nor cut, and "summary_keeps" in the file remembers them for later runs;
  * a dict of more than MAX_KEYS numbers (a sweep: predicted_speedup_gated) keeps its TOP_KEYS largest, a curve
    by K keeps K <= MAX_K, a long list its first MAX_LIST (of records: MAX_RECORDS), each with "<key>_kept";
  * 3 repeats beside their median and range (which hold the same three numbers) become their count, 3;
  * floats keep DIGITS significant digits (one more while the last is a 5, so that rounding as a page does
    gives what rounding the raw value gave); a dict or list met again becomes "same as /path/of/the/first";
  * JSON Lines (a training log): all lines of the rarer kinds (evaluations), MAX_LIST of the commonest (steps)
    evenly spaced, after a first line that is the summary's note.
"""
import fnmatch, json, math, pathlib, sys
from collections import Counter

SUMMARY_OF = "raw record trimmed to a summary; the command on the results page regenerates the full file"
DROP = {
    # raw per-prompt / per-repeat records, generated text
    "stats", "prompt_stats", "per_prompt", "prompt_seconds", "greedy_equal_per_prompt", "tau_hist", "groups",
    "samples", "outputs", "texts", "completions", "generations", "contents", "token_ids", "trace",
    "rows/command",  # each searched server's own command line (the record's "command" reruns the search)
    "by_group/*/prompts",  # the ids are in the record's "prompts", each named for its domain
    # raw timing arrays and per-position curves behind the summary numbers (verify_cost, alpha, the speedups)
    "verify_s", "round_s", "alpha_by_position", "depth_rates", "expected_tau", "tokens_per_round",
    "tokens_per_round_by_domain", "candidates/timings", "calibration_seconds", "calibration_tokens",
    "target_side_shared_over",
    # inputs another field already names (the vocab path is in the draft's name; the config is the run's)
    "vocab_files", "counted_prompts", "train_summary/config", "draft_vocab/source", "positions_by_domain",
    "machine/platform",
    # prose repeated in every record (docs/design.md and the results pages define the terms)
    "definitions", "compat_notes", "llama_cpp_notes", "prediction_method", "acceptance_method",
}
DROP_SUFFIXES = ("_definition", "_contents")
DROP_BLOBS = {"repeats", "seconds", "tokens"}
MAX_KEYS, TOP_KEYS = 24, 3
MAX_K = 8  # a curve by K (a dict of numbers keyed 1, 2, ...) keeps K = 1..MAX_K
MAX_LIST, MAX_RECORDS = 24, 48
DIGITS = 4
DEDUPE_MIN = 24  # bytes of JSON below which a repeated dict or list stays as it is
BUDGET = 20_000  # bytes a summary may take


def _nested(v):
    items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
    return any(isinstance(x, (dict, list)) for x in items)


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _round(x):
    if not isinstance(x, float) or not math.isfinite(x) or x == 0:
        return x
    digits = DIGITS
    while True:
        r = round(x, digits - 1 - math.floor(math.log10(abs(x))))
        if digits >= 17 or not repr(r).split("e")[0].rstrip("0").endswith("5"):
            return r
        digits += 1


def _dropped(path, k, x, keep):
    if k in keep:
        return False
    if k in DROP or k.endswith(DROP_SUFFIXES):
        return True
    full = "/" + "/".join(path + (k,))
    if any("/" in pat and fnmatch.fnmatchcase(full, "*/" + pat) for pat in DROP):
        return True
    if x is None or x == {} or x == []:
        return True
    if k in DROP_BLOBS and isinstance(x, (dict, list)):
        return not (isinstance(x, list) and all(_number(y) for y in x))
    return False


def _three(rep, median, rng):
    """True where rep is 3 repeats that median and range (min, max) already say."""
    try:
        return (isinstance(rep, list) and len(rep) == 3 and isinstance(rng, list) and len(rng) == 2
                and sorted(rep) == sorted([rng[0], median, rng[1]]))
    except TypeError:
        return False


def _redundant(out, k):
    """Repeats that the median and range beside them already hold (3 repeats are the median, min and max)."""
    x = out[k]
    if k == "repeats":
        return _three(x, out.get("median"), out.get("range"))
    if k.endswith("_repeats") and isinstance(x, dict) and x:
        rng = out.get(k[:-len("_repeats")] + "_range")
        if not isinstance(rng, dict):
            return False
        medians = [m for kk, m in out.items() if isinstance(m, dict) and kk != k and m is not rng]
        return any(all(_three(r, m.get(d), rng.get(d)) for d, r in x.items()) for m in medians)
    return False


def summarize(v, keep=frozenset(), path=()):
    """The summary of one JSON value (applying it to its own result changes nothing)."""
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if _dropped(path, k, x, keep):
                continue
            if isinstance(x, dict) and x and all(_number(y) for y in x.values()) and k not in keep:
                if len(x) > MAX_KEYS:
                    out[k] = {kk: _round(y) for kk, y in sorted(x.items(), key=lambda kv: -kv[1])[:TOP_KEYS]}
                    out[k + "_kept"] = f"top {TOP_KEYS} of {len(x)}"
                    continue
                if len(x) > MAX_K and all(kk.isdigit() for kk in x) and any(int(kk) > MAX_K for kk in x):
                    out[k] = {kk: _round(y) for kk, y in x.items() if int(kk) <= MAX_K}
                    out[k + "_kept"] = f"K <= {MAX_K} of {len(x)}"
                    continue
            if isinstance(x, list) and k not in keep:
                cap = MAX_RECORDS if _nested(x) else MAX_LIST
                if len(x) > cap:
                    out[k] = [summarize(y, keep, path + (k,)) for y in x[:cap]]
                    out[k + "_kept"] = f"first {cap} of {len(x)}"
                    continue
            y = summarize(x, keep, path + (k,))
            if y == {} and x != {} and k not in keep:
                continue  # everything in it was dropped: it goes too, as it would on a second pass
            out[k] = y
        for k in [k for k in out if k not in keep and _redundant(out, k)]:
            out[k] = 3  # the count: the median and the range beside it hold the three values
        return out
    if isinstance(v, list):
        return [summarize(x, keep, path) for x in v]
    return _round(v)


def dedupe(v, path="", seen=None):
    """Each dict or list of DEDUPE_MIN bytes or more that repeats an earlier one becomes "same as PATH"."""
    seen = {} if seen is None else seen
    if not isinstance(v, (dict, list)):
        return v
    flat = json.dumps(v, sort_keys=True)
    if len(flat) >= DEDUPE_MIN:
        if flat in seen and len(seen[flat]) + 10 < len(flat):
            return f"same as {seen[flat]}"
        seen.setdefault(flat, path or "/")
    if isinstance(v, dict):
        return {k: dedupe(x, f"{path}/{k}", seen) for k, x in v.items()}
    return [dedupe(x, f"{path}/{i}", seen) for i, x in enumerate(v)]


def dumps(v, indent=0, row=False):
    """JSON with one key a line; on one line a dict or list that holds no dict or list, or fits in 140
    characters, or is one record (up to 320 characters) of a list of records, so that such a list reads as rows."""
    flat = json.dumps(v, separators=(",", ":"), ensure_ascii=False)
    if not isinstance(v, (dict, list)) or not _nested(v) or len(flat) + indent <= (320 if row else 140):
        return flat
    pad = " " * (indent + 1)
    if isinstance(v, dict):
        body = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {dumps(x, indent + 1)}" for k, x in v.items()]
        return "{\n" + ",\n".join(body) + "\n" + " " * indent + "}"
    return "[\n" + ",\n".join(pad + dumps(x, indent + 1, True) for x in v) + "\n" + " " * indent + "]"


def summary_json(text, keep=()):
    record = json.loads(text)
    if not isinstance(record, dict):
        return dumps(dedupe(summarize(record, frozenset(keep)))) + "\n"
    keep = sorted(set(keep) | set(record.get("summary_keeps", [])))
    body = summarize({k: x for k, x in record.items() if k not in ("summary_of", "summary_keeps")}, frozenset(keep))
    head = {"summary_of": SUMMARY_OF, **({"summary_keeps": keep} if keep else {})}
    return dumps({**head, **dedupe(body)}) + "\n"


def summary_jsonl(text, keep=()):
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    note = {}
    if lines and isinstance(lines[0], dict) and "summary_of" in lines[0]:
        note, lines = lines[0], lines[1:]
    shape = lambda d: tuple(sorted(d)) if isinstance(d, dict) else type(d).__name__
    common = Counter(map(shape, lines)).most_common(1)[0][0] if lines else None
    steps = [i for i, d in enumerate(lines) if shape(d) == common]
    if len(steps) > MAX_LIST:
        stride = (len(steps) - 1) / (MAX_LIST - 1)
        chosen = {steps[round(j * stride)] for j in range(MAX_LIST)}
        lines = [d for i, d in enumerate(lines) if shape(d) != common or i in chosen]
        note = {"lines_kept": f"all but the commonest kind ({len(steps)} lines), of which {MAX_LIST} evenly spaced"}
    note = {"summary_of": SUMMARY_OF, **{k: x for k, x in note.items() if k != "summary_of"}}
    out = [note] + [summarize(d, frozenset(keep)) for d in lines]
    return "".join(json.dumps(d, separators=(", ", ": "), ensure_ascii=False) + "\n" for d in out)


def summary_text(path, text, keep=()):
    return (summary_jsonl if str(path).endswith(".jsonl") else summary_json)(text, keep)


def main(argv):
    check = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    out, keep = None, []
    while "--out" in argv or "--keep" in argv:
        i = argv.index("--out") if "--out" in argv else argv.index("--keep")
        if argv[i] == "--out":
            out = pathlib.Path(argv[i + 1])
        else:
            keep += [k for k in argv[i + 1].split(",") if k]
        del argv[i:i + 2]
    if not argv:
        print(__doc__)
        return 2
    bad = 0
    for name in argv:
        p = pathlib.Path(name)
        old = p.read_text(encoding="utf-8")
        new = summary_text(p, old, keep)
        size = len(new.encode())
        if size > BUDGET:
            print(f"OVER {size} bytes (budget {BUDGET}): {p}")
            bad += 1
        if check:
            if new != old:
                print(f"NOT A SUMMARY: {p}")
                bad += 1
            continue
        dest = (out / (p.relative_to(p.anchor) if p.is_absolute() else p)) if out else p  # never the source
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists() or dest.read_text(encoding="utf-8") != new:
            dest.write_text(new, encoding="utf-8")
        print(f"{len(old.encode()):>8} -> {size:>6} bytes  {p}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
