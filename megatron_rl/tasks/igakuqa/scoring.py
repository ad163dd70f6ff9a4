"""The IgakuQA scoring rules, and reading predictions to score.

Two rules; `official` is the default and the report names the one used:

- `official`: exactly the benchmark's own `scripts/evaluate_main.py` (jungokasai/IgakuQA): the
  prediction string is split on "," *without stripping*, sorted, and compared with the sorted
  gold list as written in the data file; 116A71 is correct for every answer; 112B30 is correct
  for the predictions "a" or "d" (its gold is written "a or d"). So "d, e" is wrong for gold
  ["d", "e"] (the second token is " e"), "A" is wrong for gold ["a"], "" is wrong. This is the
  rule the published baseline numbers were computed with.
- `letter-set`: the lenient reading of the benchmark README ("the sorted set of predicted letters
  equals the sorted gold set"): the prediction is parsed into its set of letters with the reward's
  parser (`tasks.mcq.answer.parse_choice_set`), so "d, e", "E,D" and "ｄ、ｅ" all equal {"d", "e"}. On the
  published baselines it counts a few dozen spaced multi-answer predictions correct that the
  official script marks wrong.

A correct question earns its `points` (1, 3 for required clinical questions, 0 for questions
excluded from official scoring). The script pairs prediction and gold lines by position and stops
on a missing line; here predictions are matched by problem_id and a missing one counts as wrong
(reported as `missing`), which gives the script's result whenever the script runs at all.

Predictions are JSONL lines of either form:
  {"problem_id": "112A1", "prediction": "a,c"}         (IgakuQA baseline files)
  {"problem_id": "112A1", "output": "...[ans]a,c[/ans]"}  (raw model outputs)
When a line has both, `prediction` is used. A raw output is first turned into a prediction string
the way a benchmark submission would be written: its last `[ans]` tag parsed with the reward's
parser and written canonically ("a,c"); both rules then agree on it. Prohibited-choice (kinki)
selections and format failures use the parsed letter set under either rule (the official script
scores neither). A directory is searched recursively for `<exam>-<block>_<system>.jsonl` files;
`system` selects one system when several are present.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...data.schema import DataError, Location, read_jsonl, require
from ..mcq.answer import extract_answer, parse_choice_set
from .data import ALL_CORRECT_IDS, IgakuQAQuestion

_PREDICTION_FILE = re.compile(r"(\d{2,3})-([A-Z])_(.+)\.jsonl")
OFFICIAL = "official"
LETTER_SET = "letter-set"
RULES: tuple[str, ...] = (OFFICIAL, LETTER_SET)
DEFAULT_RULE = OFFICIAL
RULE_DESCRIPTIONS: dict[str, str] = {
    OFFICIAL: "official: the benchmark's scripts/evaluate_main.py (split on ',', no stripping)",
    LETTER_SET: "letter-set: predicted letter set equals the gold set (spaces, case, "
                "full width and separators ignored)",
}


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown scoring rule {rule!r}; allowed: {', '.join(RULES)}")
    return rule


def official_correct(question: IgakuQAQuestion, prediction: str | None) -> bool:
    """`evaluate_main.py`'s verdict for one prediction string (None: no prediction line)."""
    if question.problem_id in ALL_CORRECT_IDS:
        return True
    if prediction is None:
        return False
    tokens = sorted(prediction.split(","))
    accepted = [sorted(question.answer_as_written)]
    if question.alternatives:  # 112B30: gold written "a or d"; the script accepts "a" or "d"
        accepted += [sorted(s) for s in question.accepted_sets]
    return tokens in accepted


def letter_set_correct(question: IgakuQAQuestion, predicted: frozenset[str] | None) -> bool:
    if question.problem_id in ALL_CORRECT_IDS:
        return True
    return predicted is not None and predicted in question.accepted_sets


def is_correct(question: IgakuQAQuestion, prediction: Prediction | None,
               rule: str = DEFAULT_RULE) -> bool:
    if check_rule(rule) == OFFICIAL:
        return official_correct(question, None if prediction is None else prediction.text)
    return letter_set_correct(question, None if prediction is None else prediction.answer)


def selects_prohibited(question: IgakuQAQuestion, predicted: frozenset[str] | None) -> bool:
    return predicted is not None and bool(predicted & frozenset(question.kinki))


@dataclass(frozen=True)
class Prediction:
    problem_id: str
    answer: frozenset[str] | None  # None: nothing parseable (a format failure)
    path: str
    line: int | None
    text: str | None = None  # the prediction string the official rule compares (None: no tag)


@dataclass
class PredictionSet:
    system: str
    predictions: dict[str, Prediction] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def _parse_prediction(obj: dict[str, Any], loc: Location) -> Prediction:
    problem_id = require(obj, "problem_id", str, loc)
    if "prediction" in obj:
        text: str | None = require(obj, "prediction", str, loc)
        answer = parse_choice_set(text)  # type: ignore[arg-type]
    elif "output" in obj:
        answer = extract_answer(require(obj, "output", str, loc))
        text = None if answer is None else ",".join(sorted(answer))
    else:
        raise loc.error("missing key 'prediction' (or 'output' for raw model outputs)")
    return Prediction(problem_id, answer, loc.path, loc.line, text)


def files_by_system(root: Path) -> dict[str, list[Path]]:
    """The `<exam>-<block>_<system>.jsonl` files under a directory, by system name."""
    by_system: dict[str, list[Path]] = {}
    for file in sorted(root.rglob("*.jsonl")):
        match = _PREDICTION_FILE.fullmatch(file.name)
        if match:
            by_system.setdefault(match.group(3), []).append(file)
    return by_system


def prediction_files(path: str | os.PathLike[str], system: str | None) -> tuple[str, list[Path]]:
    """(system name, files) for a prediction file or a directory of IgakuQA-named files."""
    root = Path(path)
    if root.is_file():
        match = _PREDICTION_FILE.fullmatch(root.name)
        name = match.group(3) if match else root.stem
        if system is not None and system != name:
            raise DataError(f"file is for system {name!r}, not {system!r}", root)
        return name, [root]
    if not root.is_dir():
        raise DataError("prediction file or directory does not exist", root)
    by_system = files_by_system(root)
    if not by_system:
        raise DataError("no prediction files named <exam>-<block>_<system>.jsonl", root)
    if system is None:
        if len(by_system) > 1:
            raise DataError(f"several systems found ({', '.join(sorted(by_system))}); "
                            f"choose one with --system", root)
        system = next(iter(by_system))
    if system not in by_system:
        raise DataError(f"no files for system {system!r}; found: "
                        f"{', '.join(sorted(by_system))}", root)
    return system, by_system[system]


def load_predictions(path: str | os.PathLike[str], system: str | None = None) -> PredictionSet:
    """Read predictions; a problem_id may appear only once across all files."""
    name, files = prediction_files(path, system)
    result = PredictionSet(system=name, files=[str(f) for f in files])
    for file in files:
        for prediction in read_jsonl(file, _parse_prediction):
            previous = result.predictions.get(prediction.problem_id)
            if previous is not None:
                raise DataError(f"duplicate prediction for {prediction.problem_id!r} "
                                f"(first at {previous.path}:{previous.line})", file,
                                prediction.line)
            result.predictions[prediction.problem_id] = prediction
    return result
