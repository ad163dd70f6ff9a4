"""`megatron-rl eval igakuqa|mcq|compare|table|specialist|generate ...`: generate, score and compare predictions.

`eval igakuqa --pred FILE_OR_DIR --gold DIR [--system NAME] [--rule R] [--json]` prints the report
as markdown tables (or JSON). `eval mcq --pred FILE --gold PROMPTS [--by KEYS] [--json]` scores
single-answer MCQ predictions (MedXpertQA, MedMCQA: `megatron_rl.tasks.mcq.scoring`).
`eval table LABEL=PATH... --gold DIR [--baseline LABEL] [--out DIR]`
renders several systems in the published layouts (`megatron_rl.tasks.igakuqa.table`).
`eval specialist LABEL=PATH... --gold PROMPTS [--baseline LABEL] [--out DIR]` does the same for a
specialist exam (`megatron_rl.tasks.specialist`). `eval igakuqa`, `table` and `specialist` take
`--include` / `--exclude` id lists (`megatron_rl.data.idlist`) and print the count they leave.
`eval compare A B --gold DIR [--system-a X] [--system-b Y] [--out DIR] [--json]` prints McNemar
tables and, with --out, writes compare.md, compare.json and category_delta.png there. Bad input
exits 1 with one `error: <file>:<line>: <problem>` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rl.tasks.igakuqa.table import SystemSpec


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
    _add_id_lists(igaku)
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
    _add_id_lists(table)
    table.set_defaults(func=run_table)

    spec = verbs.add_parser("specialist", help="several systems on a specialist exam (article 001's layouts)",
                            description="All and All (text only) with Δ and exact McNemar vs the baseline, McNemar "
                                        "between methods, per-specialty Δ with the best method and the best-method "
                                        "counts (megatron_rl/tasks/specialist/table.py).")
    spec.add_argument("systems", nargs="+", metavar="LABEL=PATH",
                      help="predictions per system: JSONL of {problem_id, output} (`eval generate`) or "
                           "{problem_id, prediction}")
    spec.add_argument("--gold", required=True, help="the prompt JSONL from `data prepare specialist`")
    spec.add_argument("--baseline", default=None, help="label the others are compared with (default: the first)")
    spec.add_argument("--out", default=None, help="directory for table.md, table.json, table.png, specialty.png")
    spec.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    _add_id_lists(spec)
    spec.set_defaults(func=run_specialist)

    mcq = verbs.add_parser("mcq", help="accuracy of single-answer MCQ predictions (MedXpertQA, MedMCQA)",
                           description="Score `eval generate` output against the prompt file it was generated "
                                       "from: the [ans] tag or an explicit answer statement, with the question's "
                                       "own option letters (megatron_rl/tasks/mcq/scoring.py).")
    mcq.add_argument("--pred", required=True, help="predictions JSONL ({problem_id, output}, from `eval generate`)")
    mcq.add_argument("--gold", required=True, help="the prompt JSONL (from `data prepare medxpertqa|medmcqa`)")
    mcq.add_argument("--by", default="", help="comma-separated metadata keys to break accuracy down by "
                                              "(MedXpertQA: medical_task,body_system,question_type)")
    mcq.add_argument("--parse", choices=("strict", "flexible"), default="flexible",
                     help="answer statements read: strict = explicit ones only; flexible (default) adds "
                          "'answer is X', 'option X' and a letter alone on the last line")
    mcq.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    mcq.set_defaults(func=run_mcq)

    gen = verbs.add_parser("generate", help="raw-output predictions from a model via a rollout server",
                           description="Start one vLLM server on this node (TP × DP GPUs, as the recipe's "
                                       "rollout servers are, or --tp/--dp), generate one answer per prompt and "
                                       "write {problem_id, output} lines; OUT.meta.json records the decoding "
                                       "settings and the server shape.")
    gen.add_argument("--model", required=True, help="HF model directory (with tokenizer): e.g. a run's HF export")
    gen.add_argument("--prompts", required=True, help="prompt JSONL (e.g. from `data prepare`)")
    gen.add_argument("--out", required=True, help="output JSONL of {problem_id, output}")
    gen.add_argument("--recipe", default=None,
                     help="take the server shape (rollout.tensor_parallel_size, data_parallel_size, "
                          "enable_expert_parallel, dtype, gpu_memory_utilization) and the chat-template "
                          "variables from this recipe")
    gen.add_argument("--tp", type=int, default=None, help="vLLM tensor-parallel size (overrides the recipe)")
    gen.add_argument("--dp", type=int, default=None, help="vLLM data-parallel size (overrides the recipe)")
    gen.add_argument("--expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                     help="vLLM expert parallelism over TP × DP (default: the recipe's, else off)")
    gen.add_argument("--max-tokens", type=int, default=None,
                     help="generated tokens per answer (default: the recipe's rollout.max_response_length, else 512)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    gen.add_argument("--top-k", type=int, default=-1, help="top-k sampling when --temperature > 0 (-1 = off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed when --temperature > 0")
    gen.add_argument("--thinking", choices=("on", "off"), default=None,
                     help="set the chat template's enable_thinking (Qwen3 hybrid checkpoints)")
    gen.add_argument("--chat-template-kwargs", type=json.loads, default=None, metavar="JSON",
                     help="chat-template variables, e.g. '{\"enable_thinking\": false}' (over the recipe's)")
    gen.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    gen.add_argument("--run-dir", default="runs/eval-generate", help="server log, address and token")
    gen.set_defaults(func=run_generate)


def _add_rule(parser: argparse.ArgumentParser) -> None:
    from megatron_rl.tasks.igakuqa.scoring import DEFAULT_RULE, RULES

    parser.add_argument("--rule", choices=RULES, default=DEFAULT_RULE,
                        help="scoring rule: 'official' = the benchmark's evaluate_main.py "
                             "(default); 'letter-set' = lenient letter-set parsing")


def _add_id_lists(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--include", default=None, metavar="IDS_FILE",
                        help="count only the questions listed (one id per line, # comments; "
                             "megatron_rl/data/idlist.py)")
    parser.add_argument("--exclude", default=None, metavar="IDS_FILE",
                        help="leave the questions listed out (applied after --include)")


def _id_filter(args: argparse.Namespace) -> Any:
    from megatron_rl.data.idlist import IdFilter

    return IdFilter(args.include, args.exclude)


def _filtered_gold(gold: dict[str, Any], id_filter: Any) -> dict[str, Any]:
    """The gold questions the id lists keep; prints how many (to stderr: --json stays parseable)."""
    if not id_filter.active:
        return gold
    kept = id_filter.apply(gold)
    print(id_filter.describe(), file=sys.stderr)
    return {pid: gold[pid] for pid in kept}


def _without_dropped(predictions: Any, gold: dict[str, Any], id_filter: Any) -> Any:
    """Predictions of the questions the id lists dropped are left out, not errors."""
    if id_filter.active:
        predictions.predictions = {k: v for k, v in predictions.predictions.items()
                                   if k in gold or k not in id_filter.dropped}
    return predictions


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, ensure_ascii=False, indent=2)
    sys.stdout.write("\n")


def _emit(report: Any, as_json: bool, render_markdown: Any) -> int:
    """A scoring command's output: the report as JSON, or its Markdown rendering."""
    if as_json:
        _print_json(report)
    else:
        sys.stdout.write(render_markdown(report))
    return 0


def run_igakuqa(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError
    from megatron_rl.tasks.igakuqa.data import load_igakuqa
    from megatron_rl.tasks.igakuqa.report import build_report, evaluate, render_markdown
    from megatron_rl.tasks.igakuqa.scoring import load_predictions

    try:
        id_filter = _id_filter(args)
        gold = _filtered_gold(load_igakuqa(args.gold).by_id(), id_filter)
        predictions = _without_dropped(load_predictions(args.pred, args.system), gold, id_filter)
        report = build_report(evaluate(gold, predictions, args.rule), predictions.system,
                              args.rule)
    except (DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _emit(report, args.json, render_markdown)


def generate_settings(args: argparse.Namespace) -> tuple[Any, Any] | None:
    """(RolloutConfig, Decoding) from the recipe and the flags; None after printing why not."""
    import dataclasses

    from megatron_rl.config.check import load
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.predict import Decoding

    rollout, kwargs, max_tokens = RolloutConfig(enforce_eager=True), {}, 512
    if args.recipe:
        cfg = load(args.recipe)
        if cfg is None:
            return None
        rollout, kwargs = cfg.rollout, dict(cfg.rollout.chat_template_kwargs)
        max_tokens = cfg.rollout.max_response_length
    shape = {k: v for k, v in (("tensor_parallel_size", args.tp), ("data_parallel_size", args.dp),
                               ("enable_expert_parallel", args.expert_parallel)) if v is not None}
    for key, value in shape.items():
        if key != "enable_expert_parallel" and value < 1:
            print(f"error: --{'tp' if key.startswith('tensor') else 'dp'} must be >= 1, got {value}", file=sys.stderr)
            return None
    rollout = dataclasses.replace(rollout, **shape, port=0)
    if args.chat_template_kwargs is not None:
        if not isinstance(args.chat_template_kwargs, dict):
            print("error: --chat-template-kwargs must be a JSON object", file=sys.stderr)
            return None
        kwargs.update(args.chat_template_kwargs)
    if args.thinking is not None:
        kwargs["enable_thinking"] = args.thinking == "on"
    decoding = Decoding(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens or max_tokens, seed=args.seed, chat_template_kwargs=kwargs)
    return rollout, decoding


def run_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_rl.data.schema import DataError
    from megatron_rl.rollout.predict import meta_path, predict
    from megatron_rl.rollout.server import ServerError

    settings = generate_settings(args)
    if settings is None:
        return 1
    rollout, decoding = settings
    try:
        n = predict(args.model, args.prompts, Path(args.out), Path(args.run_dir), decoding, args.limit, rollout,
                    recipe=args.recipe)
    except (DataError, ServerError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    greedy = "greedy" if decoding.temperature == 0 else \
        f"T {decoding.temperature:g}, top_p {decoding.top_p:g}, top_k {decoding.top_k}"
    print(f"wrote {n} predictions to {args.out} ({greedy}, {decoding.max_tokens} tokens, server TP "
          f"{rollout.tensor_parallel_size} × DP {rollout.data_parallel_size}; settings in {meta_path(Path(args.out))})")
    return 0


def run_mcq(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError, read_prompts
    from megatron_rl.tasks.mcq.scoring import read_outputs, render_markdown, score_mcq

    try:
        prompts = read_prompts(args.gold)
        report = score_mcq(prompts, read_outputs(args.pred), [k for k in args.by.split(",") if k.strip()],
                           args.parse)
    except (DataError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _emit(report, args.json, render_markdown)


def run_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_rl.data.schema import DataError
    from megatron_rl.tasks.igakuqa.compare import compare_results, plot_category_deltas, render_markdown
    from megatron_rl.tasks.igakuqa.data import load_igakuqa
    from megatron_rl.tasks.igakuqa.report import evaluate
    from megatron_rl.tasks.igakuqa.scoring import load_predictions

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


def _load_system(spec: Any, gold: Any, rule: str, id_filter: Any) -> list[Any]:
    from pathlib import Path

    from megatron_rl.tasks.igakuqa.report import evaluate
    from megatron_rl.tasks.igakuqa.scoring import files_by_system, load_predictions

    path = Path(spec.path)
    # A directory of several systems (e.g. the benchmark's baseline_results): the label names one.
    system = spec.label if path.is_dir() and spec.label in files_by_system(path) else None
    return evaluate(gold, _without_dropped(load_predictions(path, system), gold, id_filter), rule)


def _system_specs(texts: list[str]) -> list[SystemSpec]:
    """`label=path` system arguments of `eval table` and `eval specialist`, each label once."""
    from megatron_rl.tasks.igakuqa.table import parse_system_spec

    specs = [parse_system_spec(text) for text in texts]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"system labels must be unique, got {', '.join(labels)}")
    return specs


def run_table(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError
    from megatron_rl.tasks.igakuqa.data import load_igakuqa
    from megatron_rl.tasks.igakuqa.table import build_table

    try:
        specs = _system_specs(args.systems)
        labels = [s.label for s in specs]
        id_filter = _id_filter(args)
        gold = _filtered_gold(load_igakuqa(args.gold).by_id(), id_filter)
        results = {s.label: _load_system(s, gold, args.rule, id_filter) for s in specs}
        table = build_table(results, args.baseline or labels[0], args.rule)
    except (DataError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if id_filter.active:
        table["questions"] = id_filter.to_dict()
    return _write_table(table, args)


def _write_table(table: dict[str, Any], args: argparse.Namespace) -> int:
    """table.md, table.json (exact p-values), table.png and specialty.png under --out; the
    Markdown (or --json) on stdout."""
    from pathlib import Path

    from megatron_rl.tasks.igakuqa.table import plot_table, render_markdown

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


def run_specialist(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError
    from megatron_rl.tasks.specialist.table import build_specialist_table, load_gold

    try:
        specs = _system_specs(args.systems)
        labels = [s.label for s in specs]
        id_filter = _id_filter(args)
        table = build_specialist_table(load_gold(args.gold), specs, args.baseline or labels[0], id_filter)
    except (DataError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(id_filter.describe(), file=sys.stderr)
    return _write_table(table, args)
