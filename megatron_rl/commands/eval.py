"""`megatron-rl eval igakuqa|compare|table ...`: score predictions, compare two systems.

`eval igakuqa --pred FILE_OR_DIR --gold DIR [--system NAME] [--rule R] [--json]` prints the report
as markdown tables (or JSON). `eval table LABEL=PATH... --gold DIR [--baseline LABEL] [--out DIR]`
renders several systems in the published layouts (`megatron_rl.eval.table`).
`eval compare A B --gold DIR [--system-a X] [--system-b Y] [--out DIR] [--json]` prints McNemar
tables and, with --out, writes compare.md, compare.json and category_delta.png there. Bad input
exits 1 with one `error: <file>:<line>: <problem>` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("eval", help="score predictions on medical benchmarks")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    igaku = verbs.add_parser("igakuqa", help="IgakuQA report (official scoring rule)")
    igaku.add_argument("--pred", required=True,
                       help="prediction JSONL file, or a directory of "
                            "<exam>-<block>_<system>.jsonl files")
    igaku.add_argument("--gold", required=True, help="IgakuQA directory (checkout or its data/)")
    igaku.add_argument("--system", default=None, help="system to read from a directory")
    igaku.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    _add_rule(igaku)
    igaku.set_defaults(func=run_igakuqa)

    comp = verbs.add_parser("compare", help="compare two prediction sets (exact McNemar)")
    comp.add_argument("a", help="predictions A (file or directory)")
    comp.add_argument("b", help="predictions B (file or directory)")
    comp.add_argument("--gold", required=True, help="IgakuQA directory (checkout or its data/)")
    comp.add_argument("--system-a", default=None, help="system to read from A's directory")
    comp.add_argument("--system-b", default=None, help="system to read from B's directory")
    comp.add_argument("--out", default=None,
                      help="directory for compare.md, compare.json and category_delta.png")
    comp.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    _add_rule(comp)
    comp.set_defaults(func=run_compare)

    table = verbs.add_parser("table", help="several systems in the published layouts "
                                           "(years × All × text only, specialties, McNemar)")
    table.add_argument("systems", nargs="+", metavar="LABEL=PATH",
                       help="predictions per system; in a directory with several systems the "
                            "files of system LABEL are read")
    table.add_argument("--gold", required=True, help="IgakuQA directory (checkout or its data/)")
    table.add_argument("--baseline", default=None,
                       help="label the others are compared with (default: the first)")
    table.add_argument("--out", default=None,
                       help="directory for table.md, table.json, table.png, specialty.png")
    table.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    _add_rule(table)
    table.set_defaults(func=run_table)

    gen = verbs.add_parser("generate", help="raw-output predictions from a model via the rollout server")
    gen.add_argument("--model", required=True, help="HF model directory (with tokenizer)")
    gen.add_argument("--prompts", required=True, help="prompt JSONL (e.g. from `data prepare`)")
    gen.add_argument("--out", required=True, help="output JSONL of {problem_id, output}")
    gen.add_argument("--max-tokens", type=int, default=512, help="generated tokens per answer")
    gen.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    gen.add_argument("--run-dir", default="runs/eval-generate", help="server log, address and token")
    gen.set_defaults(func=run_generate)


def _add_rule(parser: argparse.ArgumentParser) -> None:
    from megatron_rl.eval.scoring import DEFAULT_RULE, RULES

    parser.add_argument("--rule", choices=RULES, default=DEFAULT_RULE,
                        help="scoring rule: 'official' = the benchmark's evaluate_main.py "
                             "(default); 'letter-set' = lenient letter-set parsing")


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, ensure_ascii=False, indent=2)
    sys.stdout.write("\n")


def run_igakuqa(args: argparse.Namespace) -> int:
    from megatron_rl.data.igakuqa import load_igakuqa
    from megatron_rl.data.schema import DataError
    from megatron_rl.eval.igakuqa_report import build_report, evaluate, render_markdown
    from megatron_rl.eval.scoring import load_predictions

    try:
        gold = load_igakuqa(args.gold).by_id()
        predictions = load_predictions(args.pred, args.system)
        report = build_report(evaluate(gold, predictions, args.rule), predictions.system,
                              args.rule)
    except (DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        _print_json(report)
    else:
        sys.stdout.write(render_markdown(report))
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_rl.data.schema import DataError
    from megatron_rl.rollout.predict import predict
    from megatron_rl.rollout.server import ServerError

    try:
        n = predict(args.model, args.prompts, Path(args.out), Path(args.run_dir), args.max_tokens, args.limit)
    except (DataError, ServerError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {n} predictions to {args.out}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_rl.data.igakuqa import load_igakuqa
    from megatron_rl.data.schema import DataError
    from megatron_rl.eval.compare import compare_results, plot_category_deltas, render_markdown
    from megatron_rl.eval.igakuqa_report import evaluate
    from megatron_rl.eval.scoring import load_predictions

    try:
        gold = load_igakuqa(args.gold).by_id()
        pred_a = load_predictions(args.a, args.system_a)
        pred_b = load_predictions(args.b, args.system_b)
        comparison = compare_results(evaluate(gold, pred_a, args.rule),
                                     evaluate(gold, pred_b, args.rule), pred_a.system,
                                     pred_b.system, args.rule)
    except (DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if comparison["overall"]["n"] == 0:
        print("error: the two prediction sets share no IgakuQA exam block", file=sys.stderr)
        return 1
    markdown = render_markdown(comparison)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(markdown, encoding="utf-8")
        (out / "compare.json").write_text(json.dumps(comparison, ensure_ascii=False, indent=2)
                                          + "\n", encoding="utf-8")
        plot_category_deltas(comparison, out / "category_delta.png")
    if args.json:
        _print_json(comparison)
    else:
        sys.stdout.write(markdown)
    return 0


def _load_system(spec: Any, gold: Any, rule: str) -> list[Any]:
    from pathlib import Path

    from megatron_rl.eval.igakuqa_report import evaluate
    from megatron_rl.eval.scoring import files_by_system, load_predictions

    path = Path(spec.path)
    # A directory of several systems (e.g. the benchmark's baseline_results): the label names one.
    system = spec.label if path.is_dir() and spec.label in files_by_system(path) else None
    return evaluate(gold, load_predictions(path, system), rule)


def run_table(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_rl.data.igakuqa import load_igakuqa
    from megatron_rl.data.schema import DataError
    from megatron_rl.eval.table import build_table, parse_system_spec, plot_table, render_markdown

    try:
        specs = [parse_system_spec(text) for text in args.systems]
        labels = [s.label for s in specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"system labels must be unique, got {', '.join(labels)}")
        gold = load_igakuqa(args.gold).by_id()
        results = {s.label: _load_system(s, gold, args.rule) for s in specs}
        table = build_table(results, args.baseline or labels[0], args.rule)
    except (DataError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    markdown = render_markdown(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(markdown, encoding="utf-8")
        (out / "table.json").write_text(json.dumps(table, ensure_ascii=False, indent=2) + "\n",
                                        encoding="utf-8")
        plot_table(table, out / "table.png", out / "specialty.png")
    if args.json:
        _print_json(table)
    else:
        sys.stdout.write(markdown)
    return 0
