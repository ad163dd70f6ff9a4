"""`megatron-rl data prepare igakuqa|medmcqa|medxpertqa|specialist|chord-sft ...`: write prompt and SFT JSONL
files; `megatron-rl data generate chord-sft ...`: CHORD's expert texts by a model (`rollout/expert_texts.py`).

Only argparse is imported at module level; the data modules load when the command runs, and none
of them imports torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.data.prepare import PrepareResult
    from megatron_rl.data.schema import PromptRecord
    from megatron_rl.rollout.expert_texts import ExpertPrompts, GenerateResult


def year_list(text: str) -> list[int]:
    """"2018,2019" → [2018, 2019]; "" → [] (e.g. no evaluation years)."""
    years = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or len(part) != 4:
            raise argparse.ArgumentTypeError(f"not a year: {part!r}")
        years.append(int(part))
    return years


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="prepare training and evaluation data")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    prepare = verbs.add_parser("prepare", help="convert a source dataset to prompt/SFT JSONL")
    sources = prepare.add_subparsers(dest="source", metavar="SOURCE", required=True)

    igaku = sources.add_parser("igakuqa", help="IgakuQA (Japanese medical licensing exam)")
    igaku.add_argument("--src", required=True, help="IgakuQA directory (checkout or its data/)")
    igaku.add_argument("--out", required=True, help="output directory")
    igaku.add_argument("--years", type=year_list, default=None,
                       help="training years, e.g. 2018,2019 (default: all but --eval-years)")
    igaku.add_argument("--eval-years", type=year_list, default=[2022],
                       help="evaluation years (default: 2022)")
    igaku.add_argument("--train-text-only", action="store_true",
                       help="leave questions whose image is missing out of training")
    igaku.add_argument("--system-prompt", default=None,
                       help="system message of every prompt (default: the project's Japanese one; '' = none, "
                            "as ms-swift's Qwen3 templates add none)")
    _add_on_malformed(igaku)
    igaku.set_defaults(func=run_igakuqa)

    med = sources.add_parser("medmcqa", help="MedMCQA (English medical MCQ, options a-d)")
    med.add_argument("--src", required=True, help="MedMCQA JSONL file")
    med.add_argument("--out", required=True, help="output directory")
    med.add_argument("--split", default="train", help="name used in the output file names")
    med.add_argument("--cop-base", choices=("auto", "0", "1"), default="auto",
                     help="auto (default): read it from the file's cop values (a 0 = the HF copy's 0-3, a 4 = "
                          "the original 1-4; a file with neither is refused); or 1 / 0 to say it")
    med.add_argument("--limit", type=_positive, default=None,
                     help="only the first N questions, in file order (article 000: train[:1000] = --limit 1000)")
    med.add_argument("--style", choices=("project", "article000"), default="project",
                     help="prompt wording: the project's [ans] format (default), or article 000's system "
                          "prompt verbatim with options A-D")
    _add_on_malformed(med)
    med.set_defaults(func=run_medmcqa)

    mx = sources.add_parser("medxpertqa", help="MedXpertQA (English expert-level MCQ, options A-J): eval prompts")
    mx.add_argument("--src", required=True, help="MedXpertQA JSONL file (e.g. Text/test.jsonl)")
    mx.add_argument("--out", required=True, help="output directory")
    mx.add_argument("--split", default="test", help="name used in the output file names")
    mx.add_argument("--limit", type=_positive, default=None, help="only the first N questions")
    _add_on_malformed(mx)
    mx.set_defaults(func=run_medxpertqa)

    spec = sources.add_parser("specialist", help="a specialist exam (article 001's specialist_exam_test_v2): "
                                                 "eval prompts",
                              description="Check a specialist-exam JSONL ({id, specialty, question, choices, "
                                          "answer, has_image}; the format is in megatron_rl/tasks/specialist/"
                                          "data.py) and write specialist_<split>.jsonl prompts for `eval generate` "
                                          "and `eval specialist`.")
    spec.add_argument("--src", required=True, help="specialist-exam JSONL file")
    spec.add_argument("--out", required=True, help="output directory")
    spec.add_argument("--split", default="test", help="name used in the output file names")
    spec.add_argument("--system-prompt", default=None,
                      help="system message of every prompt (default: the project's Japanese one; '' = none)")
    _add_on_malformed(spec)
    spec.set_defaults(func=run_specialist)

    chord = sources.add_parser("chord-sft", help="CHORD expert rows from expert texts (question + parts)",
                               description="Build data.sft_path rows from a JSONL of expert texts "
                                           "({id, question, sections: [{title, text}, ...]} or {id, question, "
                                           "response}; the format is in megatron_rl/data/chord_sft.py).")
    chord.add_argument("--src", required=True, help="expert-text JSONL file")
    chord.add_argument("--out", required=True, help="output directory (writes chord_sft.jsonl)")
    chord.add_argument("--parts", type=_positive, default=None,
                       help="require exactly N sections per text (article 001's texts: 5)")
    chord.add_argument("--system-prompt", default="", help="system message of every row (default: none)")
    chord.add_argument("--exclude", action="append", default=[], metavar="PROMPTS_JSONL",
                       help="leave out texts whose question is a prompt of this file (e.g. the eval set); repeatable")
    chord.add_argument("--limit", type=_positive, default=None, help="only the first N rows")
    _add_on_malformed(chord)
    chord.set_defaults(func=run_chord_sft)


    _register_generate(verbs)


def _register_generate(verbs: argparse._SubParsersAction) -> None:
    generate = verbs.add_parser("generate", help="write training texts with a model on a rollout server")
    kinds = generate.add_subparsers(dest="kind", metavar="KIND", required=True)
    chord = kinds.add_parser(
        "chord-sft", help="CHORD's expert texts from MCQ prompts (article 001's two stages)",
        description="Stage 1 rewrites each multiple-choice prompt as a natural-language question; stage 2 writes "
                    "its expert answer part by part (the prompts: megatron_rl/data/chord_prompts/, --prompts DIR). "
                    "Writes the CHORD expert-text format, row by row: a killed run keeps its rows and the same "
                    "command continues it (megatron_rl/rollout/expert_texts.py). Then `data prepare chord-sft "
                    "--parts 5`.")
    chord.add_argument("--src", required=True, help="prompt JSONL of MCQs (e.g. `data prepare igakuqa`'s train file)")
    chord.add_argument("--out", required=True, help="expert-text JSONL to write or continue")
    where = chord.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="HF model directory: a rollout server is started on this node for the run")
    where.add_argument("--server", help="directory of a running rollout server (holding rollout/server.json)")
    chord.add_argument("--prompts", default=None, help="folder of question.txt, answer.txt, parts.txt "
                                                       "(default: the shipped ones)")
    chord.add_argument("--recipe", default=None, help="with --model: the server shape and chat-template "
                                                      "variables of this recipe")
    chord.add_argument("--max-tokens", type=_positive, default=256, help="tokens per generated text (default 256)")
    chord.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chord.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    chord.add_argument("--batch-size", type=_positive, default=64,
                       help="prompts in flight at once; rows are written as each batch ends (default 64)")
    chord.add_argument("--limit", type=_positive, default=None, help="only the first N prompts")
    chord.add_argument("--max-model-len", type=_positive, default=4096,
                       help="with --model: the server's context (default 4096, at most the model's)")
    chord.add_argument("--run-dir", default="runs/generate-chord-sft", help="with --model: server log and token")
    chord.set_defaults(func=run_generate_chord_sft)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def _add_on_malformed(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--on-malformed", choices=("error", "skip"), default="error",
                        help="stop at the first malformed line (default) or skip and count")


def _report(result: PrepareResult) -> int:
    if "cop_base_from" in result.notes:
        print(f"cop base {result.notes['cop_base']} ({result.notes['cop_base_from']})")
    for name, count in result.counts.items():
        print(f"{result.files[name]}: {count} records")
    for reason, count in sorted(result.excluded.items()):
        print(f"excluded from training: {count} ({reason})")
    if result.skipped_lines:
        print(f"skipped {result.skipped_lines} malformed lines (see {result.files['summary']})")
    return 0


def run_igakuqa(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError
    from megatron_rl.tasks.igakuqa.prepare import prepare_igakuqa

    try:
        result = prepare_igakuqa(args.src, args.out, train_years=args.years,
                                 eval_years=args.eval_years, on_malformed=args.on_malformed,
                                 train_text_only=args.train_text_only, system_prompt=args.system_prompt)
    except (DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _report(result)


def run_medmcqa(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError
    from megatron_rl.tasks.medmcqa.data import prepare_medmcqa

    try:
        cop_base = args.cop_base if args.cop_base == "auto" else int(args.cop_base)
        result = prepare_medmcqa(args.src, args.out, split=args.split, cop_base=cop_base, limit=args.limit,
                                 style=args.style, on_malformed=args.on_malformed)
    except (DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _report(result)


def run_medxpertqa(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError
    from megatron_rl.tasks.medxpertqa.data import prepare_medxpertqa

    try:
        result = prepare_medxpertqa(args.src, args.out, split=args.split, limit=args.limit,
                                    on_malformed=args.on_malformed)
    except (DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _report(result)


def run_specialist(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError
    from megatron_rl.tasks.specialist.data import prepare_specialist

    try:
        result = prepare_specialist(args.src, args.out, split=args.split, system_prompt=args.system_prompt,
                                    on_malformed=args.on_malformed)
    except (DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    counts = ", ".join(f"{k} {v}" for k, v in result.notes["specialties"].items())
    print(f"{len(result.notes['specialties'])} specialties ({counts}); {result.notes['with_image']} with an image")
    return _report(result)


def run_chord_sft(args: argparse.Namespace) -> int:
    from megatron_rl.data.prepare import prepare_chord_sft
    from megatron_rl.data.schema import DataError

    try:
        result = prepare_chord_sft(args.src, args.out, parts=args.parts, system_prompt=args.system_prompt,
                                   exclude=args.exclude, limit=args.limit, on_malformed=args.on_malformed)
    except (DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _report(result)


def run_generate_chord_sft(args: argparse.Namespace) -> int:
    from megatron_rl.data.schema import DataError, read_prompts
    from megatron_rl.rollout.client import RolloutError
    from megatron_rl.rollout.expert_texts import load_prompts
    from megatron_rl.rollout.server import ServerError

    try:
        prompts = load_prompts(args.prompts)
        records = read_prompts(args.src)[:args.limit]
        result = _generate_on_a_server(args, records, prompts)
    except (DataError, ServerError, RolloutError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if result is None:
        return 1
    torn = f"; cut a half-written last row ({result.torn_bytes} bytes)" if result.torn_bytes else ""
    print(f"{args.out}: {result.written} expert texts written, {result.already_done} there before{torn}")
    if result.empty:
        print(f"{len(result.empty)} prompts gave an empty text and were not written (first: {result.empty[:3]}); "
              "running the command again tries them again")
    return 0


def _generate_on_a_server(args: argparse.Namespace, records: list[PromptRecord],
                          prompts: ExpertPrompts) -> GenerateResult | None:
    """Start (--model) or attach to (--server) a rollout server and generate the texts."""
    import dataclasses
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from megatron_rl.config.check import load
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.expert_texts import client_generate, generate_expert_texts
    from megatron_rl.rollout.server import RolloutServer

    rollout, kwargs = RolloutConfig(enforce_eager=True), {}
    if args.recipe:
        cfg = load(args.recipe)
        if cfg is None:
            return None
        rollout, kwargs = cfg.rollout, dict(cfg.rollout.chat_template_kwargs)
    if args.model:
        context = json.loads((Path(args.model) / "config.json").read_text()).get("max_position_embeddings", 4096)
        server = RolloutServer(args.model, Path(args.run_dir), dataclasses.replace(rollout, port=0),
                               max_model_len=min(args.max_model_len, int(context)))
        server.start()
    else:
        server = RolloutServer.attach(Path(args.server), rollout)
    try:
        greedy = args.temperature == 0
        settings = dataclasses.replace(rollout, n=1, temperature=args.temperature if not greedy else 1.0,
                                       top_p=args.top_p, top_k=-1, max_response_length=args.max_tokens)
        tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
        generate = client_generate(RolloutClient.for_server(server, settings), tokenizer, settings, greedy, kwargs)
        return generate_expert_texts(records, args.out, prompts, generate, model=str(server.model_dir),
                                     batch_size=args.batch_size, progress=sys.stderr)
    finally:
        if not server.external:
            server.stop()
