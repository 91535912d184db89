"""The `draftsmith` command: each verb maps to one plain function of the package that owns it.

    .venv/bin/draftsmith models list
    .venv/bin/draftsmith models pull smollm2-135m-instruct
    .venv/bin/draftsmith decode --target T --draft D|prune:D:vocab=kept.json|head:PATH --prompt "..." [--k 4] [--json]
    .venv/bin/draftsmith bench --target T --draft D [--prompts code] [--k 3,5] --out bench.json
    .venv/bin/draftsmith grid --target T --draft head:RUN/distill/head/best --k 1,2,3 --confidence 0,0.6 \
        --siblings 0,3 [--sibling-depth 1,2] [--quant int8,none] --out grid.json
    .venv/bin/draftsmith pair --target T --candidates D1,D2,derive:T:keep=8,prune:D1:vocab=kept.json --validate 1 \
        --out DIR
    .venv/bin/draftsmith derive --from T --keep 8 --out DIR
    .venv/bin/draftsmith vocab --target T --data DIR|--prompts code,chat [--coverage 0.99 | --size N] --out kept.json
    .venv/bin/draftsmith distill --target T --draft derive:T:keep=4 --loss fkl --steps 150 --out DIR
    .venv/bin/draftsmith gen-prompts --target T --n 2000 --domains code,json,summarize,chat --out DIR
    .venv/bin/draftsmith gen-data --target T --draft D --data mixed --mix 0.5 [--plain-data] --out DIR
    .venv/bin/draftsmith export --draft DIR/best --target T --format all --out DIR [--check-llama-cpp]
    .venv/bin/draftsmith export-head --head RUN/head/best --target T --k 3 --out DIR
    .venv/bin/draftsmith run recipes/quickstart.yaml [distill.train.steps=200 ...] [--out runs/NAME]
    .venv/bin/draftsmith leaderboard runs/* --out leaderboard

Every problem the user can fix (unknown model, corrupt file, no space...) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from draftsmith.decode.runtime.allocator import keep_freed_memory
from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.settings import RuntimeSettings, configure


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


# --- verbs ------------------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    from draftsmith.decode.runtime import zoo

    if args.action == "llama-cpp":  # the real engine of the llama.cpp checks: built once, cached
        from draftsmith.distill.export.llama_cpp import converter_dir, find_llama_server

        print(find_llama_server())
        print(converter_dir())
        return 0
    if args.action == "list":
        for name in zoo.known_models():
            info = zoo.describe(name)
            state = "pulled" if zoo.is_pulled(name) else "not pulled"
            print(f"{name:30s} {state:11s} {info['summary']}")
        return 0
    if not args.name:
        raise DraftsmithError(f"`draftsmith models {args.action}` needs a model name")
    if args.action == "pull":
        print(zoo.pull(args.name))
    else:
        print(zoo.model_path(args.name))
    return 0


def _sampling(args: argparse.Namespace):
    from draftsmith.decode.sampling import SamplingParams

    try:
        return SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise DraftsmithError(str(e)) from None


def _policy(args: argparse.Namespace):
    from draftsmith.decode.speculative import DEFAULT_K, KPolicy

    k = DEFAULT_K if args.k is None else args.k
    try:
        return KPolicy.fixed(k, dynamic=args.dynamic_k, confidence=args.confidence, siblings=args.siblings,
                             sibling_depth=args.sibling_depth, lookup=args.lookup)
    except ValueError as e:
        raise DraftsmithError(str(e)) from None


def cmd_decode(args: argparse.Namespace) -> int:
    from draftsmith.decode.textgen import decode_text

    sampling, policy = _sampling(args), _policy(args)
    pair = _decode_pair(args, policy)
    out = decode_text(pair, args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, policy=policy,
                      seed=args.seed, chat=not args.no_chat)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    st = out["stats"]
    print(out["text"])
    alpha = "-" if st["acceptance_rate"] is None else f"{st['acceptance_rate']:.3f}"
    print(f"\n[{st['new_tokens']} tokens in {st['seconds']:.2f} s = {st['tokens_per_s']:.2f} tok/s; "
          f"mean tau {st['mean_tau']:.2f} (tokens per target forward, bonus included); "
          f"acceptance {alpha}; tau histogram {st['tau_hist']}]", file=sys.stderr)
    return 0


def _decode_pair(args: argparse.Namespace, policy):
    """`decode`'s target and draft runners, the draft any spec (`pairing.drafts`: a model, int4, vocabulary-pruned,
    derived, or a head on the target's embedding); a one-line error, before any decoding, for what the decoder
    cannot run."""
    from draftsmith.decode.runtime.pair import load_pair
    from draftsmith.decode.spec import DraftSpec

    draft = None if args.no_draft else args.draft
    if draft is not None and not DraftSpec.parse(draft).is_head and policy.sibling_depth == 2:
        raise DraftsmithError("--sibling-depth 2 needs a draft head (--draft head:PATH): a standalone draft cannot "
                              "draft after several candidates at once")
    pair = load_pair(args.target, None, max_seq_len=args.max_seq_len)
    _check_positions(pair.target, args)
    if draft is None:
        return pair
    if policy.siblings and not hasattr(pair.target_runner, "forward_tree"):
        raise DraftsmithError(f"--siblings needs a target the lean runner can run (it verifies the siblings as a "
                              f"tree); {pair.target.name} runs in transformers")
    return _with_draft(pair, draft, args.max_seq_len, None if args.draft_quant == "none" else args.draft_quant)


def _with_draft(pair, spec: str, max_seq_len: int, quant: str | None):
    """`pair` (target loaded, no draft) with the draft `spec` opened (`pairing.drafts`); `pair.draft` is the whole
    model (what transformers' assisted generation runs), None for a head."""
    from dataclasses import replace

    from draftsmith.decode.runtime.pair import check_vocab
    from draftsmith.pairing.drafts import load_draft, run_draft

    d = load_draft(spec, pair.target)
    if d.loaded is not None:
        check_vocab(pair.target, d.loaded)  # token-level speculation: one tokenizer
    return replace(pair, draft=d.loaded, draft_runner=run_draft(d, max_seq_len, quant).runner)


def _check_positions(target, args: argparse.Namespace) -> None:
    """The prompt and every new token must fit the caches (--max-seq-len positions)."""
    from draftsmith.decode.textgen import prompt_ids

    n = len(prompt_ids(target.tokenizer, args.prompt, chat=not args.no_chat))
    if n < 1:
        raise DraftsmithError("--prompt gives no tokens: the decoder needs at least one")
    if n + args.max_new_tokens > args.max_seq_len:
        raise DraftsmithError(f"the prompt ({n} tokens) plus --max-new-tokens {args.max_new_tokens} needs "
                              f"{n + args.max_new_tokens} positions; --max-seq-len is {args.max_seq_len}")


def cmd_bench(args: argparse.Namespace) -> int:
    from draftsmith.decode.bench import BenchConfig, run_bench
    from draftsmith.decode.runtime.pair import load_pair
    from draftsmith.decode.spec import DraftSpec

    cfg = _config(BenchConfig, args)
    pair = None
    if args.draft and DraftSpec.parse(args.draft, sniff=False).decoder_only:  # pruned or int4: opened as the
        # decoder runs it (a pruned one proposes the kept ids; HF assisted runs it whole)
        pair = _with_draft(load_pair(args.target, None), args.draft, 2048, cfg.draft_quant)
    report = run_bench(args.target, args.draft, cfg, out=args.out, pair=pair)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"
    for mode in report["modes"]:
        m = report["modes"][mode]
        print(f"{mode:18s} {m['tokens']:5d} tokens {m['seconds']:8.2f} s {m['tok_per_s']:7.2f} tok/s")
    print(f"greedy_equal {report['greedy_equal']}  K {report['k']}  mean tau {fmt(report['mean_tau'])}  "
          f"alpha {fmt(report['alpha'])}")
    span = lambda key: (f" ({fmt(report[key + '_range'][0])}-{fmt(report[key + '_range'][1])})"  # noqa: E731
                        if key + "_range" in report else "")
    print(f"speedup vs target-only {fmt(report['speedup_vs_target_only'])}{span('speedup_vs_target_only')}  "
          f"vs HF generate {fmt(report['speedup_vs_hf_generate'])}{span('speedup_vs_hf_generate')}  "
          f"vs HF assisted {fmt(report['speedup_vs_hf_assisted'])}{span('speedup_vs_hf_assisted')}"
          + (f"  (median of {report['repeats']} repeats)" if report.get("repeats", 1) > 1 else ""))
    for mode, ratios in report["per_mode"].items():  # each mode, not only the fastest on these prompts
        print(f"{mode}: " + "  ".join(f"{k.replace('_', ' ')} {fmt(v['median'])} ({fmt(v['range'][0])}-"
                                      f"{fmt(v['range'][1])})" for k, v in ratios.items()))
    if args.out:
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def cmd_floor(args: argparse.Namespace) -> int:
    from draftsmith.decode.floor import floor_plot, floor_report, format_floor
    from draftsmith.decode.runtime.io import atomic_write_bytes, atomic_write_json, read_json

    if args.from_record:
        report = read_json(args.from_record, what="floor record")
        needed = {"target", "rows", "weight_bytes", "bandwidth_gbs", "peak_gflops", "goals"}
        if not isinstance(report, dict) or not needed <= set(report):
            raise DraftsmithError(f"{args.from_record}: not a floor record (`draftsmith floor --out` writes one)")
    else:
        report = floor_report(args.target, rows=args.rows, repeats=args.repeats)
    print(format_floor(report))
    print(json.dumps(report["goals"]))
    if args.out:
        atomic_write_json(args.out, report)
        print(f"wrote {args.out}")
    where = args.out or args.from_record
    if where:
        png = Path(where).with_suffix(".png")
        atomic_write_bytes(png, floor_plot(report))
        print(f"wrote {png}")
    return 0


def cmd_grid(args: argparse.Namespace) -> int:
    from draftsmith.pairing.grid import GridConfig, run_grid

    result = run_grid(args.target, args.draft, _config(GridConfig, args), out=args.out)
    base = result["tok_per_s"]["target_only"]
    print(f"{'target alone':34s} {base:7.2f} tok/s")
    for name in result["policies"]:
        st = result["stats"][name]
        print(f"{name:34s} {result['tok_per_s'][name]:7.2f} tok/s  {result['speedup_vs_target_only'][name]:.2f}x  "
              f"tau {st['mean_tau']:.2f}  greedy-equal {result['greedy_equal'][name]}")
    if args.out:
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def _config(cls: type, args: argparse.Namespace, extra: dict | None = None):
    from draftsmith.recipes.options import options_to_config

    return options_to_config(cls, args, extra)


def _common(args: argparse.Namespace) -> dict:
    """target, prompts, limit_per_domain, device: the settings a recipe keeps at its top level."""
    from dataclasses import fields

    from draftsmith.recipes.config import DEVICES, Recipe, check_prompts
    from draftsmith.recipes.options import given

    defaults = {f.name: f.default for f in fields(Recipe)}
    common = {k: v for k, v in given(args).items() if k in ("prompts", "limit_per_domain", "device")}
    out = {k: common.get(k, defaults[k]) for k in ("prompts", "limit_per_domain", "device")}
    if out["device"] not in DEVICES:
        raise DraftsmithError(f"--device must be one of {', '.join(DEVICES)}, got {out['device']!r}")
    if out["limit_per_domain"] is not None and (not isinstance(out["limit_per_domain"], int)
                                                or out["limit_per_domain"] < 1):
        raise DraftsmithError(f"--limit-per-domain must be an integer >= 1, got {out['limit_per_domain']!r}")
    out["prompts"] = str(out["prompts"])
    check_prompts(out["prompts"], "--prompts")
    return out


def cmd_pair(args: argparse.Namespace) -> int:
    from draftsmith.decode.spec import split_specs
    from draftsmith.pairing.leaderboard import PairConfig, markdown, run_pair

    cfg = _config(PairConfig, args, {"candidates": split_specs(args.candidates)})
    c = _common(args)
    board = run_pair(args.target, args.out, cfg, prompts=c["prompts"], limit_per_domain=c["limit_per_domain"],
                     device=c["device"])
    print(markdown(board))
    print(f"wrote {args.out}/leaderboard.{{json,md,csv,html}} in {board['seconds']:.0f} s")
    return 0


def cmd_derive(args: argparse.Namespace) -> int:
    from draftsmith.pairing.derive import derive

    from draftsmith.decode.spec import parse_layers

    layers = parse_layers(args.layers) if args.layers else None
    print(derive(args.source, args.out, layers=layers, keep=args.keep))
    return 0


def cmd_vocab(args: argparse.Namespace) -> int:
    from draftsmith.distill.vocab import make_vocab

    kept = make_vocab(args.target, args.out, data=args.data, prompts=args.prompts, coverage=args.coverage,
                      size=args.size, max_new_tokens=args.max_new_tokens, limit_per_domain=args.limit_per_domain,
                      device=args.device, context_ids=not args.no_context_ids)
    print(f"kept {kept.n} of {kept.vocab_size} target ids: {100 * kept.covered:.2f}% of {kept.counted_tokens} "
          f"target-written tokens counted")
    print(f"wrote {args.out}; use it as prune:DRAFT:vocab={args.out}")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from draftsmith.distill.pipeline import DistillConfig, run_distill

    cfg = _config(DistillConfig, args)
    c = _common(args)
    r = run_distill(args.target, cfg.draft, args.out, cfg, prompts=c["prompts"], limit_per_domain=c["limit_per_domain"],
                    resume=not args.restart, device=c["device"])
    print(f"alpha on {r['held_out_prompts']} held-out prompts: before {r['alpha_before']:.3f}, "
          f"after {r['alpha_after']:.3f} (gain {r['alpha_gain']:+.3f})")
    if r.get("skipped_note"):
        print(f"warning: {r['skipped_note']}")
    if "speed" in r:
        from draftsmith.decode.bench import Validation

        v = Validation.from_dict(r["speed"])
        tps = v.tok_per_s
        print(f"tokens/s at K={v.k} on {len(v.prompts)} held-out prompts: target-only {tps['target_only']:.2f}, "
              f"draft before {tps['draft_before']:.2f} ({v.speedup('draft_before'):.2f}x), "
              f"after {tps['draft_after']:.2f} ({v.speedup('draft_after'):.2f}x)")
    print(f"wrote {args.out}/distill.json; tuned draft in {args.out}/best")
    return 0


def cmd_gen_prompts(args: argparse.Namespace) -> int:
    from draftsmith.decode.runtime.io import read_json
    from draftsmith.decode.runtime.loading import load
    from draftsmith.distill.prompt_gen import generate_prompts

    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    generate_prompts(load(args.target, device=args.device), args.n, domains, args.out, temperature=args.temperature,
                     seed=args.seed, batch_size=args.batch_size, max_prompt_tokens=args.max_prompt_tokens,
                     dedup_threshold=args.dedup_threshold, dtype=args.dtype)
    stats = read_json(args.out / "stats.json", what="prompt statistics")
    print(f"{stats['kept']} prompts ({', '.join(f'{d} {n}' for d, n in stats['kept_by_domain'].items())}) in "
          f"{args.out}; unique fraction {stats['unique_fraction']:.3f}; rejected {stats['rejected']}; "
          f"{stats['tokens_per_s']:.1f} tokens/s")
    return 0


def cmd_gen_data(args: argparse.Namespace) -> int:
    from draftsmith.distill.pipeline import DistillConfig, gen_data

    c = _common(args)
    got = gen_data(args.target, Path(args.out), _config(DistillConfig, args), prompts=c["prompts"],
                   limit_per_domain=c["limit_per_domain"], device=c["device"])
    if not got["main"]:
        return 0  # the main process reports
    print(f"{len(got['dataset'])} rows in {args.out}/dataset")
    stats = got["stats"]
    if stats:
        procs = f" on {stats['processes']} processes" if stats.get("processes") else ""
        print(f"generated {stats['new_tokens']} tokens in {stats['seconds']:.0f} s: {stats['tokens_per_s']:.1f} "
              f"tokens/s at batch {stats['batch_size']}{procs}")
    if got["cache"] is not None:
        print(f"teacher top-{got['cache'].k} cache ({got['how']}) in {got['cache'].folder}")
    return 0


# --- parser -----------------------------------------------------------------------------------


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"  # the built-in default pair: a real same-family pair
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def _add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"zoo name, HF folder or .gguf file (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help="zoo name, HF folder or .gguf, same tokenizer; prune:MODEL:vocab=FILE (its LM head cut to the "
                        "kept ids); or a draft head on the target: head:PATH or the head's folder, e.g. RUN/head/best "
                        f"(default {DEFAULT_DRAFT})")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-quant", choices=["int8", "none"], default="int8",
                   help="draft (or head) weights on CPU (the target always runs as loaded; exactness is unaffected)")


def _add_plain_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plain-data", dest="cfg:speculative_data", action="store_const", const=False,
                   default=argparse.SUPPRESS, help="the same as --no-speculative-data (the default)")


def _add_common(p: argparse.ArgumentParser, taken: set[str], *, target_required: bool = True) -> None:
    """--target (plain) and --prompts / --limit-per-domain / --device from the recipe's top-level fields."""
    from draftsmith.recipes.config import Recipe
    from draftsmith.recipes.options import add_options

    p.add_argument("--target", required=target_required, default=None if target_required else DEFAULT_TARGET,
                   help="the target: zoo name, HF folder or .gguf file")
    taken.add("target")
    add_options(p, Recipe, only={"prompts", "limit_per_domain", "device"}, taken=taken,
                title="shared settings (a recipe's top level)")


def cmd_export(args: argparse.Namespace) -> int:
    from draftsmith.distill.export import ExportConfig, export
    from draftsmith.distill.export.model_card import llama_cpp_result
    from draftsmith.recipes.options import given

    formats = given(args).get("formats")
    extra = {"formats": ["hf", "gguf"]} if formats in ("all", ["all"]) else {}
    if extra:
        del args.__dict__["cfg:formats"]
    summary = export(args.draft, args.target, args.out, _config(ExportConfig, args, extra), before=args.before)
    for name, line in (summary.get("serving") or {}).items():
        print(f"{name}: {line}")
    for t, lc in (summary.get("llama_cpp") or {}).items():
        print(f"llama.cpp ({t} draft): {llama_cpp_result(lc, summary.get('llama_cpp_target_only'))}")
    if summary.get("llama_cpp_before"):
        print(f"llama.cpp (un-distilled {args.before}): "
              f"{llama_cpp_result(summary['llama_cpp_before'], summary.get('llama_cpp_target_only'))}")
    search = summary.get("llama_cpp_search")
    if search:
        alone = {t: sum(v) / len(v) for t, v in search["target_alone_tokens_per_s"].items() if all(v)}
        print("llama.cpp search, target alone: " + ", ".join(f"-t {t}: {x:.2f} tok/s" for t, x in alone.items()))
        for name, b in search["best"].items():
            print(f"llama.cpp search, fastest with {name}: K={b['k']} p-min={b['p_min']:g} -t {b['threads']}: "
                  f"{b['tokens_per_s']:.2f} tok/s, {b['speedup_vs_fastest_target_alone']:.2f}x the fastest target "
                  f"alone, {b['accepted']}/{b['drafted']} accepted, greedy equal on {b['greedy_equal']['equal']}/"
                  f"{b['greedy_equal']['prompts']}")
    _print_prediction(summary.get("llama_cpp_prediction"))
    for w in summary.get("warnings") or []:
        print(f"warning: {w}")
    print(f"wrote {args.out}")
    return 0


def _print_prediction(pred: dict | None) -> None:
    """llama-server's predicted and measured speedup per K, and acceptance in both engines (export's check)."""
    if not pred:
        return
    from draftsmith.distill.export.model_card import PREDICTION_HEADERS, prediction_rows

    print(f"llama.cpp: {pred['verdict']}")
    print("  " + " | ".join(PREDICTION_HEADERS))
    for row in prediction_rows(pred):
        print("  " + " | ".join(row))


def cmd_export_head(args: argparse.Namespace) -> int:
    from draftsmith.decode.speculative import DEFAULT_K
    from draftsmith.distill.export.heads import export_head

    ks = [int(x) for x in args.llama_cpp_ks.split(",") if x.strip()] if args.llama_cpp_ks else None
    k = DEFAULT_K if args.k is None else args.k
    result = export_head(args.head, args.target, args.out, k=k, gguf=args.gguf, check_llama_cpp=args.check_llama_cpp,
                         target_gguf=args.target_gguf, ks=ks)
    for name, line in result["serving"].items():
        print(f"{name}: {line}")
    print(f"wrote {args.out}/vllm (speculators format) and {args.out}/sglang, both checked against their contract")
    if "gguf" in result:
        print(f"wrote {result['gguf']['path']} with llama.cpp's own converter (EAGLE-3)")
    lc = result.get("llama_cpp")
    if lc:
        print(f"llama.cpp, target alone: {lc['target_alone_mean_tokens_per_s']:.2f} tok/s (mean of before and after)")
        for k, r in lc["runs"].items():
            speed = f"{r['speedup_vs_target_only']:.2f}x" if r["speedup_vs_target_only"] else "-"
            print(f"llama.cpp, head at K={k}: {r['accepted']}/{r['drafted']} accepted, {r['tokens_per_s'] or 0:.2f} "
                  f"tok/s ({speed}), greedy equal on {r['greedy_equal']['equal']}/{r['greedy_equal']['prompts']}")
    _print_prediction(result.get("llama_cpp_prediction"))
    for w in result.get("warnings") or []:
        print(f"warning: {w}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from draftsmith.recipes.config import STAGES, load_recipe
    from draftsmith.recipes.runner import run_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    stages = None
    if args.stages:
        stages = [s.strip() for s in args.stages.split(",") if s.strip()]
        bad = [s for s in stages if s not in STAGES]
        if bad:
            raise DraftsmithError(f"--stages: unknown stage {bad[0]!r} (stages: {', '.join(STAGES)})")
    if args.restart and args.restart not in STAGES:
        raise DraftsmithError(f"--restart: unknown stage {args.restart!r} (stages: {', '.join(STAGES)})")
    try:
        run_recipe(recipe, args.out, stages=stages, restart=args.restart)
    except KeyboardInterrupt:
        out = args.out or Path("runs") / recipe.name
        print(f"draftsmith: interrupted; rerun the same command to resume from {out}", file=sys.stderr)
        return 130
    return 0


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from draftsmith.recipes.compare import merge_runs, write_merged

    merged = merge_runs(args.runs)
    doc = write_merged(merged, args.out)
    print(doc.markdown("leaderboard"))
    print(f"wrote {args.out / 'leaderboard.md'}, .html and .json")
    return 0


# the DistillConfig settings `gen-data` takes (the rest are training settings)
GEN_DATA_SETTINGS = {"draft", "data", "mix", "max_new_tokens", "data_temperature", "speculative_data", "gen_batch_size", "engine",
                     "seed", "teacher", "teacher_topk", "teacher_cache_dtype", "onpolicy_quant", "onpolicy_calib"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description="Make speculative decoding pay off.")
    sub = parser.add_subparsers(dest="verb", required=True)
    for add_verb in (_models_parser, _decode_parser, _bench_parser, _floor_parser, _grid_parser, _pair_parser,
                     _derive_parser, _vocab_parser, _distill_parser, _gen_prompts_parser, _gen_data_parser,
                     _export_parser, _export_head_parser, _run_parser, _leaderboard_parser):
        add_verb(sub)
    return parser


def _models_parser(sub) -> None:
    p = sub.add_parser("models", help="the offline model zoo: list | pull NAME | path NAME; llama-cpp: build "
                                      "llama.cpp once (about 25 min) for the engine checks")
    p.add_argument("action", choices=["list", "pull", "path", "llama-cpp"])
    p.add_argument("name", nargs="?")
    p.set_defaults(func=cmd_models)


def _decode_parser(sub) -> None:
    p = sub.add_parser("decode", help="decode one prompt, speculative when --draft is given")
    _add_pair_args(p)
    p.add_argument("--no-draft", action="store_true", help="target only (the baseline)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: DEFAULT_K, 3)")
    p.add_argument("--dynamic-k", action="store_true", help="grow K on full acceptance, shrink on rejection")
    p.add_argument("--confidence", type=float, default=None, help="stop drafting below this draft probability")
    p.add_argument("--siblings", type=int, default=0,
                   help="with --confidence: below it, propose the draft's N most probable first tokens side by side")
    p.add_argument("--sibling-depth", type=int, default=1, choices=[1, 2],
                   help="2: each of those first tokens also gets the draft's next token (a draft head only)")
    p.add_argument("--lookup", type=int, default=0,
                   help="append up to N tokens copied from earlier in the text after each chain (prompt lookup)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="feed the prompt raw, without the chat template")
    p.add_argument("--max-seq-len", type=int, default=4096,
                   help="positions the caches hold: the prompt plus --max-new-tokens must fit")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_decode)


def _bench_parser(sub) -> None:
    from draftsmith.decode.bench import BenchConfig
    from draftsmith.recipes.options import add_options

    p = sub.add_parser("bench", help="time target-only, speculative, HF generate and HF assisted side by side")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"zoo name, HF folder or .gguf file (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"zoo name, HF folder or .gguf, same tokenizer (default {DEFAULT_DRAFT})")
    add_options(p, BenchConfig, taken={"target", "draft"})
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=cmd_bench)


def _floor_parser(sub) -> None:
    p = sub.add_parser("floor", help="time a target's forward at 1..N rows beside the memory floor and compute roof "
                                     "of this machine (JSON and a plot with --out)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"zoo name or HF folder (default {DEFAULT_TARGET})")
    p.add_argument("--rows", type=int, default=16, help="time forwards over 1..ROWS rows (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median counts (default 5)")
    p.add_argument("--from", dest="from_record", type=Path, default=None,
                   help="a record --out wrote: print its table and draw its plot again, timing nothing")
    p.add_argument("--out", type=Path, default=None, help="the record (JSON); its plot goes beside it (.png)")
    p.set_defaults(func=cmd_floor)


def _grid_parser(sub) -> None:
    from draftsmith.pairing.grid import GridConfig
    from draftsmith.recipes.options import add_options

    p = sub.add_parser("grid", help="time one draft at a grid of K, stop thresholds and siblings beside the target "
                                    "alone, in one interleaved run (choose on dev prompts)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"zoo name, HF folder or .gguf file (default {DEFAULT_TARGET})")
    p.add_argument("--draft", required=True,
                   help="zoo name, HF folder, .gguf, derive:MODEL:keep=N, prune:MODEL:vocab=FILE or head:FOLDER")
    add_options(p, GridConfig, taken={"target", "draft"})
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=cmd_grid)


def _pair_parser(sub) -> None:
    from draftsmith.pairing.leaderboard import PairConfig
    from draftsmith.recipes.options import add_options

    p = sub.add_parser("pair", help="rank candidate drafts for a target: alpha, cost, predicted/measured speedup")
    taken: set[str] = set()
    _add_common(p, taken, target_required=False)
    p.add_argument("--candidates", required=True,
                   help="comma-separated: zoo names, HF folders, .gguf files, derive:MODEL:keep=N, "
                        "derive:MODEL:layers=0,1,2, prune:MODEL:vocab=FILE (from draftsmith vocab) or head:FOLDER")
    add_options(p, PairConfig, skip={"candidates"}, taken=taken)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_pair)


def _derive_parser(sub) -> None:
    p = sub.add_parser("derive", help="make a draft from a subset of a model's layers (HF folder)")
    p.add_argument("--from", dest="source", required=True, help="zoo name or HF folder")
    p.add_argument("--layers", default=None, help="layer indices, e.g. 0,1,2,3 or 0-3")
    p.add_argument("--keep", type=int, default=None, help="keep the first N layers")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: in the cache)")
    p.set_defaults(func=cmd_derive)


def _vocab_parser(sub) -> None:
    p = sub.add_parser("vocab", help="the target ids a vocabulary-pruned draft keeps (prune:DRAFT:vocab=FILE), "
                                     "counted on text the target wrote")
    p.add_argument("--target", required=True, help="zoo name, HF folder or .gguf file")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--data", type=Path, help="a folder of target-written text: gen-data's, a reference cache, or "
                                                "a head's data folder")
    text.add_argument("--prompts", help="suite names or a prompt file: the target writes a continuation of each")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--coverage", type=float, default=0.99,
                   help="keep the fewest ids that hold this share of the counted tokens (default 0.99)")
    n.add_argument("--size", type=int, default=None, help="keep this many ids (the most frequent)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="with --prompts: tokens the target writes each")
    p.add_argument("--limit-per-domain", type=int, default=None, help="with --prompts: the first N of each domain")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--no-context-ids", action="store_true",
                   help="propose the kept ids only (by default the draft also proposes any id it has read)")
    p.add_argument("--out", type=Path, required=True, help="the kept-ids file (JSON)")
    p.set_defaults(func=cmd_vocab)


def _distill_parser(sub) -> None:
    from draftsmith.distill.pipeline import DistillConfig
    from draftsmith.recipes.options import add_options

    p = sub.add_parser("distill", help="distill a draft toward the target; alpha (and tokens/s) before and after")
    taken: set[str] = set()
    _add_common(p, taken)
    add_options(p, DistillConfig, required={"draft"}, taken=taken,
                aliases={"lora_r": ["--lora"], "early_stop_patience": ["--early-stop"]})
    _add_plain_data(p)
    p.add_argument("--restart", action="store_true", help="ignore checkpoints in --out (default: resume)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_distill)


def _gen_prompts_parser(sub) -> None:
    p = sub.add_parser("gen-prompts", help="prompts the target writes itself (pre-query template), deduplicated")
    p.add_argument("--target", required=True, help="an instruct model with a chat template: zoo name, HF folder, .gguf")
    p.add_argument("--n", type=int, required=True, help="prompts to keep, shared evenly across the domains")
    p.add_argument("--domains", default="code,json,summarize,chat", help="comma-separated: code, json, summarize, chat")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="requests decoded together")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="a request longer than this is dropped")
    p.add_argument("--dedup-threshold", type=float, default=0.7,
                   help="word 3-gram Jaccard similarity at or above which a request is a near-duplicate")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],  # GEN_DTYPES; no torch here
                   help="the target writes in a copy of this dtype (bfloat16: 2-3x faster on CPUs with AMX)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", type=Path, required=True, help="a datasets folder; a rerun resumes it")
    p.set_defaults(func=cmd_gen_prompts)


def _gen_data_parser(sub) -> None:
    from draftsmith.distill.pipeline import DistillConfig
    from draftsmith.recipes.options import add_options

    p = sub.add_parser("gen-data", help="generate distillation data (resumable) without training")
    taken: set[str] = set()
    _add_common(p, taken)
    add_options(p, DistillConfig, only=GEN_DATA_SETTINGS, required={"draft"}, taken=taken,
                aliases={"gen_batch_size": ["--batch-size"]})
    _add_plain_data(p)
    p.add_argument("--out", type=Path, required=True, help="folder; a rerun resumes it (other settings are refused)")
    p.set_defaults(func=cmd_gen_data)


def _export_parser(sub) -> None:
    from draftsmith.distill.export import ExportConfig
    from draftsmith.recipes.options import add_options

    p = sub.add_parser("export", help="export a (distilled) draft: HF folder, GGUF for llama.cpp, vLLM/SGLang lines")
    p.add_argument("--draft", required=True, help="HF folder (e.g. a distill run's best/), zoo name or derive spec")
    p.add_argument("--target", required=True, help="the target the draft serves (its GGUF gives the tokenizer)")
    p.add_argument("--before", help="with --check-llama-cpp: also serve this draft (the one before distillation: zoo "
                                    "name, folder, .gguf or derive spec) at the same K, side by side")
    add_options(p, ExportConfig, taken={"draft", "target", "before"},
                aliases={"formats": ["--format"], "gguf_types": ["--gguf-type"]})
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_export)


def _export_head_parser(sub) -> None:
    p = sub.add_parser("export-head", help="export a trained EAGLE-3 head: vLLM speculators and SGLang folders, checked")
    p.add_argument("--head", required=True, help="a head folder (config.json + model.safetensors), e.g. RUN/head/best")
    p.add_argument("--target", required=True, help="the target the head reads (zoo name, HF folder or .gguf)")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step in the serving lines (default 3)")
    p.add_argument("--gguf", action="store_true", help="also a GGUF for llama.cpp (EAGLE-3), by llama.cpp's converter")
    p.add_argument("--check-llama-cpp", action="store_true",
                   help="serve the target's GGUF with the head in llama-server (--spec-type draft-eagle3); implies --gguf")
    p.add_argument("--llama-cpp-ks", default=None, help="K values for the llama.cpp check, e.g. 1,2,3 (default --k)")
    p.add_argument("--target-gguf", default=None, help="the target's GGUF (default: the zoo's)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_export_head)


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="run a recipe: pair -> distill -> validate -> export, resumable, with a report")
    p.add_argument("recipe", type=Path, help="a recipe YAML, or a built-in recipe's name (quickstart, qwen-draft, ...)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. distill.train.steps=200")
    p.add_argument("--out", type=Path, default=None, help="run folder (default runs/<recipe name>)")
    p.add_argument("--stages", default=None, help="a subset, e.g. pair,validate (default: the recipe's)")
    p.add_argument("--restart", default=None, metavar="STAGE", help="redo STAGE and every stage after it")
    p.set_defaults(func=cmd_run)


def _leaderboard_parser(sub) -> None:
    p = sub.add_parser("leaderboard", help="merge run folders into one acceptance-rate leaderboard (md/html/json)")
    p.add_argument("runs", nargs="+", type=Path, help="run folders, e.g. runs/*")
    p.add_argument("--out", type=Path, default=Path("leaderboard"))
    p.set_defaults(func=cmd_leaderboard)


def _one_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


ENVIRONMENT = {  # variable -> the runtime setting it maps onto (`settings_from_env`)
    "DRAFTSMITH_LINEAR": "linear", "DRAFTSMITH_NATIVE": "native", "DRAFTSMITH_Q4_AHEAD": "q4_ahead",
    "DRAFTSMITH_ROWS": "rows", "DRAFTSMITH_MALLOC": "malloc", "DRAFTSMITH_THREADS": "threads", "CXX": "compiler",
}
_SWITCH = {"on": True, "auto": True, "off": False}


def settings_from_env(environ) -> RuntimeSettings:
    """The runtime settings a `draftsmith` command runs under: the defaults, changed by the variables of
    `ENVIRONMENT` that are set (DRAFTSMITH_NATIVE and DRAFTSMITH_ROWS take on|auto|off; DRAFTSMITH_Q4_AHEAD and
    DRAFTSMITH_THREADS a count). The only place the runtime's environment is read."""
    values: dict = {}
    for var, name in ENVIRONMENT.items():
        raw = environ.get(var)
        if raw is None or raw == "":
            continue
        if name in ("native", "rows"):
            if raw not in _SWITCH:
                raise DraftsmithError(f"{var} must be on, auto or off, got {raw!r}")
            values[name] = _SWITCH[raw]
        elif name in ("q4_ahead", "threads"):
            if not raw.isdigit():
                raise DraftsmithError(f"{var} must be a whole number, got {raw!r}")
            values[name] = int(raw)
        else:
            values[name] = raw
        try:
            RuntimeSettings(**{name: values[name]})
        except DraftsmithError as e:
            raise DraftsmithError(f"{var}: {e}") from None
    return RuntimeSettings(**values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        configure(settings_from_env(os.environ))
        keep_freed_memory()  # large tensors reuse freed memory instead of page-faulting it in again
        return func(args)
    except DraftsmithError as e:
        print(f"draftsmith: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno == errno.ENOSPC:
            print(f"draftsmith: error: no space left on device ({_one_line(e)})", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
