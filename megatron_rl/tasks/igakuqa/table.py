"""Several systems on the same IgakuQA questions, in the layouts of the published comparison
(Base/GRPO/GSPO/CHORD): one call, Markdown + PNG + JSON.

1. Accuracy table: one row per system, columns = each exam year, All, All (text only). Rows other
   than the baseline show Δ vs the baseline in points with a McNemar mark (* p < 0.05,
   ** p < 0.01); the p-values follow in their own table, to three significant digits (0.0013),
   and exactly in the JSON.
2. McNemar between every pair of non-baseline systems (All and All (text only)).
3. Per specialty (IgakuQA `category`): n, the baseline's accuracy, each method's Δ with its mark,
   the best method (highest accuracy among the non-baseline systems; ties name every tied one), and
   the count of specialties each method is best in.

All systems are scored with one rule (`scoring.RULES`) and compared on the questions every system
answers (exam blocks missing from any system are left out and listed). The McNemar test is the
exact two-sided binomial one (`stats.mcnemar`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ...data.schema import DataError
from .report import QuestionResult, markdown_table, pct
from .scoring import RULE_DESCRIPTIONS, check_rule
from .stats import format_p, mcnemar, significance_mark

ALL = "All"
TEXT_ONLY = "All (text only)"


@dataclass(frozen=True)
class SystemSpec:
    label: str
    path: str


def parse_system_spec(text: str) -> SystemSpec:
    """`LABEL=PATH` (PATH: a prediction file or directory; in a directory holding several
    systems, the files of system LABEL are read)."""
    label, sep, path = text.partition("=")
    if not sep or not label.strip() or not path.strip():
        raise ValueError(f"system {text!r} must be LABEL=PATH (e.g. grpo=runs/grpo/pred)")
    return SystemSpec(label.strip(), path.strip())


class Outcome(Protocol):
    """One system's verdict on one question: all the paired layouts read."""

    @property
    def correct(self) -> bool: ...


def _cell(ids: list[str], results: Mapping[str, Outcome],
          base: Mapping[str, Outcome] | None) -> dict[str, Any]:
    correct = [results[i].correct for i in ids]
    n = len(ids)
    cell: dict[str, Any] = {"n": n, "correct": sum(correct),
                            "accuracy": sum(correct) / n if n else 0.0}
    if base is not None:
        base_correct = [base[i].correct for i in ids]
        test = mcnemar(base_correct, correct)
        cell.update(delta=cell["accuracy"] - (sum(base_correct) / n if n else 0.0), b=test.b,
                    c=test.c, p_value=test.p_value, mark=significance_mark(test.p_value))
    return cell


def _subsets(ids: list[str], key: Callable[[str], Any]) -> dict[Any, list[str]]:
    groups: dict[Any, list[str]] = {}
    for pid in ids:
        groups.setdefault(key(pid), []).append(pid)
    return groups


def _columns(ids: list[str], first: Mapping[str, QuestionResult]) -> dict[str, list[str]]:
    years = _subsets(ids, lambda pid: first[pid].question.year)
    columns = {str(year): years[year] for year in sorted(years)}
    columns[ALL] = ids
    columns[TEXT_ONLY] = [pid for pid in ids if first[pid].question.text_only]
    return columns


def _pairwise(labels: list[str], by_id: Mapping[str, Mapping[str, Outcome]],
              columns: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    rows = []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            for column in (ALL, TEXT_ONLY):
                cell = _cell(columns[column], by_id[b], by_id[a])
                rows.append({"system_a": a, "system_b": b, "subset": column, **cell})
    return rows


def _specialties(labels: list[str], baseline: str, by_id: Mapping[str, Mapping[str, Outcome]],
                 ids: list[str], specialty: Callable[[str], str]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    groups = _subsets(ids, specialty)
    methods = [label for label in labels if label != baseline] or [baseline]
    counts = dict.fromkeys(methods, 0)
    rows = []
    for name, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        cells = {label: _cell(members, by_id[label], None if label == baseline
                              else by_id[baseline]) for label in labels}
        top = max(cells[m]["correct"] for m in methods)
        best = [m for m in methods if cells[m]["correct"] == top]
        for m in best:
            counts[m] += 1
        rows.append({"specialty": name, "n": len(members), "systems": cells, "best": best})
    return rows, counts


def paired_layouts(by_id: Mapping[str, Mapping[str, Outcome]], baseline: str,
                   columns: Mapping[str, list[str]], specialty: Callable[[str], str]) -> dict[str, Any]:
    """The three layouts (accuracy with Δ and McNemar vs `baseline`, McNemar between methods, per
    specialty with the best method) of systems scored on the same questions. `columns` maps each
    column name to its question ids and holds `ALL` and `TEXT_ONLY`; `specialty` names a question's
    specialty. Shared by IgakuQA (`build_table`) and the specialist exam (`tasks/specialist`)."""
    labels = list(by_id)
    if baseline not in by_id:
        raise DataError(f"baseline {baseline!r} is not one of the systems ({', '.join(labels)})")
    rows = [{"system": label, "baseline": label == baseline,
             "cells": {column: _cell(members, by_id[label],
                                     None if label == baseline else by_id[baseline])
                       for column, members in columns.items()}} for label in labels]
    methods = [label for label in labels if label != baseline]
    specialties, best_counts = _specialties(labels, baseline, by_id, columns[ALL], specialty)
    return {"baseline": baseline, "systems": labels, "columns": list(columns), "rows": rows,
            "pairwise": _pairwise(methods, by_id, columns),
            "by_specialty": specialties, "best_counts": best_counts}


def build_table(results: Mapping[str, list[QuestionResult]], baseline: str,
                rule: str) -> dict[str, Any]:
    """The three layouts as plain data (what `--json` prints and the PNGs draw)."""
    labels = list(results)
    if baseline not in results:
        raise DataError(f"baseline {baseline!r} is not one of the systems ({', '.join(labels)})")
    by_id = {label: {r.question.problem_id: r for r in rs} for label, rs in results.items()}
    common = set.intersection(*(set(m) for m in by_id.values()))
    ids = [pid for pid in by_id[baseline] if pid in common]
    if not ids:
        raise DataError("the systems share no IgakuQA exam block")
    blocks = {label: {r.question.exam_block for r in rs} for label, rs in results.items()}
    shared_blocks = set.intersection(*blocks.values())
    first = by_id[baseline]
    layouts = paired_layouts(by_id, baseline, _columns(ids, first),
                             lambda pid: first[pid].question.category or "(none)")
    return {"benchmark": "IgakuQA", "rule": check_rule(rule), "baseline": baseline, "systems": labels,
            "excluded_blocks": sorted(set.union(*blocks.values()) - shared_blocks), **layouts}


def _delta_text(cell: Mapping[str, Any]) -> str:
    return f"{100 * cell['delta']:+.1f}{cell['mark']}"


def _accuracy_table(table: Mapping[str, Any]) -> str:
    columns = table["columns"]
    body = [["n", *[str(table["rows"][0]["cells"][c]["n"]) for c in columns]]]
    for row in table["rows"]:
        cells = row["cells"]
        body.append([row["system"], *[pct(cells[c]["accuracy"]) if row["baseline"] else
                                      f"{pct(cells[c]['accuracy'])} ({_delta_text(cells[c])})"
                                      for c in columns]])
    return markdown_table(["System", *columns], body)


def _p_table(table: Mapping[str, Any]) -> str:
    columns = table["columns"]
    body = [[row["system"], *[f"{format_p(row['cells'][c]['p_value'])} "
                              f"(b {row['cells'][c]['b']}, c {row['cells'][c]['c']})"
                              for c in columns]]
            for row in table["rows"] if not row["baseline"]]
    return markdown_table(["System", *columns], body)


def _pairwise_table(rows: Iterable[Mapping[str, Any]]) -> str:
    body = [[f"{r['system_b']} vs {r['system_a']}", r["subset"], str(r["n"]), _delta_text(r), str(r["b"]),
             str(r["c"]), format_p(r["p_value"])] for r in rows]
    return markdown_table(["Pair (B vs A)", "Subset", "n", "Δ (B−A)", "b", "c", "McNemar p"],
                          body)


def _specialty_table(table: Mapping[str, Any]) -> str:
    baseline = table["baseline"]
    methods = [s for s in table["systems"] if s != baseline]
    body = []
    for row in table["by_specialty"]:
        cells = row["systems"]
        body.append([row["specialty"], str(row["n"]), pct(cells[baseline]["accuracy"]),
                     *[_delta_text(cells[m]) for m in methods], ", ".join(row["best"])])
    return markdown_table(["Specialty", "n", baseline, *[f"{m} Δ" for m in methods], "Best"],
                          body)


def render_markdown(table: Mapping[str, Any]) -> str:
    baseline = table["baseline"]
    counts = ", ".join(f"{m} {n}" for m, n in table["best_counts"].items())
    rule = f"Scoring rule: {RULE_DESCRIPTIONS[table['rule']]}. " if "rule" in table else ""
    parts = [f"## {table['benchmark']}: {', '.join(table['systems'])} (baseline {baseline})", "",
             f"{rule}Δ = points vs {baseline}; "
             f"exact two-sided McNemar vs {baseline}: * p < 0.05, ** p < 0.01 (exact p in the "
             f"JSON).", ""]
    for line in table.get("notes", []):
        parts += [line, ""]
    if table.get("excluded_blocks"):
        parts += [f"Blocks not scored for every system (left out): "
                  f"{', '.join(table['excluded_blocks'])}", ""]
    parts += ["### Accuracy", "", _accuracy_table(table), "",
              f"### McNemar vs {baseline}", "", _p_table(table), ""]
    if table["pairwise"]:
        parts += ["### McNemar between methods", "", _pairwise_table(table["pairwise"]), ""]
    parts += ["### By specialty", "", _specialty_table(table), "",
              f"Best method per specialty (ties counted for each): {counts}"]
    return "\n".join(parts) + "\n"


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        fig.tight_layout()
        fig.savefig(out, dpi=120)
    return out


def plot_table(table: Mapping[str, Any], accuracy_png: str | os.PathLike[str],
               specialty_png: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Grouped bars of the accuracy table (marks above the bars) and of the per-specialty Δ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .compare import CATEGORY_EN, cjk_font

    columns, rows = table["columns"], table["rows"]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(columns)), 4))
    try:
        for k, row in enumerate(rows):
            xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(columns))]
            accs = [100 * row["cells"][c]["accuracy"] for c in columns]
            ax.bar(xs, accs, width, label=row["system"])
            for x, acc, c in zip(xs, accs, columns, strict=True):
                mark = row["cells"][c].get("mark", "")
                if mark:
                    ax.text(x, acc + 0.5, mark, ha="center", fontsize=9)
        ax.set_xticks(range(len(columns)), columns)
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 110)
        ax.set_title(f"{table['benchmark']} accuracy (* p<0.05, ** p<0.01 vs {table['baseline']})")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        first = _save(fig, accuracy_png)
    finally:
        plt.close(fig)

    methods = [s for s in table["systems"] if s != table["baseline"]]
    specs = table["by_specialty"]
    font = cjk_font()
    names = [s["specialty"] if font else CATEGORY_EN.get(s["specialty"], s["specialty"])
             for s in specs]
    height = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.35 * len(specs) * max(1, len(methods)) / 2
                                        + 1.5)))
    try:
        for k, m in enumerate(methods):
            ys = [i + (k - (len(methods) - 1) / 2) * height for i in range(len(specs))]
            ax.barh(ys, [100 * s["systems"][m]["delta"] for s in specs], height, label=m)
        labels = [f"{n} (n={s['n']})" for n, s in zip(names, specs, strict=True)]
        if font:
            ax.set_yticks(range(len(specs)), labels, fontfamily=font)
        else:
            ax.set_yticks(range(len(specs)), labels)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel(f"accuracy Δ vs {table['baseline']} (points)")
        ax.set_title(f"{table['benchmark']} per specialty")
        if methods:
            ax.legend(fontsize=8)
        second = _save(fig, specialty_png)
    finally:
        plt.close(fig)
    return first, second
