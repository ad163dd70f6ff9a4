"""The IgakuQA scoring rule, and reading predictions to score.

Rule (README of the benchmark and its `scripts/evaluate_main.py`): a question is correct when the
sorted set of predicted letters equals the sorted gold set; 116A71 is counted correct for every
answer; 112B30 accepts either a or d (its gold is written "a or d"). A correct question earns its
`points` (1, 3 for required clinical questions, 0 for questions excluded from official scoring).

One deliberate difference from `evaluate_main.py`: that script splits the prediction on "," without
stripping spaces, so "d, e" never equals ["d", "e"]. Here a prediction is parsed into its set of
letters (`rewards.mcq.parse_choice_set`), which is what the README's rule states; on the published
baselines this counts a few dozen spaced multi-answer predictions as correct that the script marks
wrong.

Predictions are JSONL lines of either form:
  {"problem_id": "112A1", "prediction": "a,c"}         (IgakuQA baseline files)
  {"problem_id": "112A1", "output": "...[ans]a,c[/ans]"}  (raw model outputs, parsed with the
                                                        reward's `[ans]` parser)
When a line has both, `prediction` is used. A directory is searched recursively for
`<exam>-<block>_<system>.jsonl` files; `system` selects one system when several are present.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.data.igakuqa import ALL_CORRECT_IDS, IgakuQAQuestion
from megatron_rl.data.schema import DataError, Location, read_jsonl, require
from megatron_rl.rewards.mcq import extract_answer, parse_choice_set

_PREDICTION_FILE = re.compile(r"(\d{3})-([A-Z])_(.+)\.jsonl")


def is_correct(question: IgakuQAQuestion, predicted: frozenset[str] | None) -> bool:
    if question.problem_id in ALL_CORRECT_IDS:
        return True
    return predicted is not None and predicted in question.accepted_sets


def selects_prohibited(question: IgakuQAQuestion, predicted: frozenset[str] | None) -> bool:
    return predicted is not None and bool(predicted & frozenset(question.kinki))


@dataclass(frozen=True)
class Prediction:
    problem_id: str
    answer: frozenset[str] | None  # None: nothing parseable (a format failure)
    path: str
    line: int | None


@dataclass
class PredictionSet:
    system: str
    predictions: dict[str, Prediction] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def _parse_prediction(obj: dict[str, Any], loc: Location) -> Prediction:
    problem_id = require(obj, "problem_id", str, loc)
    if "prediction" in obj:
        answer = parse_choice_set(require(obj, "prediction", str, loc))
    elif "output" in obj:
        answer = extract_answer(require(obj, "output", str, loc))
    else:
        raise loc.error("missing key 'prediction' (or 'output' for raw model outputs)")
    return Prediction(problem_id, answer, loc.path, loc.line)


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
    by_system: dict[str, list[Path]] = {}
    for file in sorted(root.rglob("*.jsonl")):
        match = _PREDICTION_FILE.fullmatch(file.name)
        if match:
            by_system.setdefault(match.group(3), []).append(file)
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
