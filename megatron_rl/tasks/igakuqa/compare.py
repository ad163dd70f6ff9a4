"""Compare two prediction sets on the same IgakuQA questions: exact McNemar tests and delta tables.

Both sets are scored with the official rule (`evaluate`); the comparison uses the questions both
evaluate (blocks covered by only one side are listed in `excluded_blocks`). For each subset —
overall, each year, text-only vs image-missing, each category — it reports n, the two accuracies,
the delta (B − A, percentage points), the discordant counts b (A right, B wrong) and c (A wrong,
B right) and the exact two-sided McNemar p-value. `render_markdown` gives the usual paper-style
tables; `plot_category_deltas` draws a PNG bar chart (matplotlib, Agg backend, imported only
there so the rest needs no plotting stack).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .report import QuestionResult, group_by, markdown_table, pct
from .scoring import DEFAULT_RULE, RULE_DESCRIPTIONS, check_rule
from .stats import format_p, mcnemar

SIGNIFICANCE_LEVEL = 0.05
CJK_FONT_HINTS: tuple[str, ...] = ("Noto Sans CJK", "IPAGothic", "IPAexGothic", "TakaoGothic")
# English names of the IgakuQA `category` values, for plots on machines without a CJK font.
CATEGORY_EN: dict[str, str] = {
    "公衆衛生": "Public health", "循環器": "Cardiology", "小児科": "Pediatrics",
    "総論": "General principles", "産科": "Obstetrics", "呼吸器": "Respiratory",
    "神経": "Neurology", "感染症": "Infectious disease", "代謝・内分泌": "Metabolic/endocrine",
    "消化器": "Gastroenterology", "救急": "Emergency", "精神科": "Psychiatry",
    "血液": "Hematology", "免疫": "Immunology", "肝・胆・膵": "Hepatobiliary/pancreas",
    "腎臓": "Nephrology", "整形外科": "Orthopedics", "泌尿器": "Urology",
    "耳鼻科": "Otolaryngology", "婦人科": "Gynecology", "眼科": "Ophthalmology",
    "皮膚科": "Dermatology", "老年医学": "Geriatrics", "放射線": "Radiology",
    "中毒": "Toxicology", "乳腺外科": "Breast surgery", "麻酔": "Anesthesiology",
    "リハビリ": "Rehabilitation",
}


def _row(label: str, pairs: list[tuple[QuestionResult, QuestionResult]]) -> dict[str, Any]:
    a_correct = [a.correct for a, _ in pairs]
    b_correct = [b.correct for _, b in pairs]
    test = mcnemar(a_correct, b_correct)
    n = len(pairs)
    acc_a = sum(a_correct) / n if n else 0.0
    acc_b = sum(b_correct) / n if n else 0.0
    return {"subset": label, "n": n, "acc_a": acc_a, "acc_b": acc_b, "delta": acc_b - acc_a,
            "b": test.b, "c": test.c, "p_value": test.p_value}


def _rows(pairs: list[tuple[QuestionResult, QuestionResult]],
          key: Callable[[QuestionResult], Any], label: Callable[[Any], str],
          order: Callable[[tuple[Any, list[Any]]], Any]) -> list[dict[str, Any]]:
    groups = group_by(pairs, lambda pair: key(pair[0]))
    return [_row(label(k), v) for k, v in sorted(groups.items(), key=order)]


def _by_key(item: tuple[Any, list[Any]]) -> Any:
    return item[0]


def _by_size(item: tuple[Any, list[Any]]) -> tuple[int, Any]:
    return -len(item[1]), item[0]


def _text_only_first(item: tuple[Any, list[Any]]) -> bool:
    return not item[0]


def compare_results(results_a: list[QuestionResult], results_b: list[QuestionResult],
                    name_a: str, name_b: str, rule: str = DEFAULT_RULE) -> dict[str, Any]:
    """The comparison as plain data (what `--json` prints); `rule` is the one both were scored
    with."""
    by_id_b = {r.question.problem_id: r for r in results_b}
    pairs = [(a, by_id_b[a.question.problem_id]) for a in results_a
             if a.question.problem_id in by_id_b]
    blocks_a = {r.question.exam_block for r in results_a}
    blocks_b = {r.question.exam_block for r in results_b}
    return {
        "a": name_a, "b": name_b, "rule": check_rule(rule),
        "excluded_blocks": sorted(blocks_a ^ blocks_b),
        "overall": _row("overall", pairs),
        "by_year": _rows(pairs, lambda r: r.question.year, str, _by_key),
        "text_only": _rows(pairs, lambda r: r.question.text_only,
                           lambda t: "text only" if t else "image missing", _text_only_first),
        "by_category": _rows(pairs, lambda r: r.question.category or "(none)", str, _by_size),
    }


def _p_cell(p: float) -> str:
    return format_p(p)


def _delta_table(rows: list[Mapping[str, Any]], first: str, name_a: str, name_b: str) -> str:
    header = [first, "n", name_a, name_b, "Δ (B−A)", "b", "c", "McNemar p"]
    body = [[r["subset"], str(r["n"]), pct(r["acc_a"]), pct(r["acc_b"]),
             f"{100 * r['delta']:+.1f}", str(r["b"]), str(r["c"]), _p_cell(r["p_value"])]
            for r in rows]
    return markdown_table(header, body)


def render_markdown(comparison: Mapping[str, Any]) -> str:
    a, b = comparison["a"], comparison["b"]
    parts = [f"## IgakuQA: {b} (B) vs {a} (A)", "",
             f"b = questions only A answers correctly, c = only B; exact two-sided McNemar test, "
             f"* p < 0.05, ** p < 0.01 (exact p in the JSON). Scoring rule: "
             f"{RULE_DESCRIPTIONS[comparison.get('rule', DEFAULT_RULE)]}.", ""]
    if comparison["excluded_blocks"]:
        parts += [f"Blocks scored on one side only (left out): "
                  f"{', '.join(comparison['excluded_blocks'])}", ""]
    parts += [_delta_table([comparison["overall"], *comparison["by_year"],
                            *comparison["text_only"]], "Subset", a, b), "",
              "### By category", "",
              _delta_table(comparison["by_category"], "Category", a, b)]
    return "\n".join(parts) + "\n"


def cjk_font() -> str | None:
    """An installed CJK font, or None. Category names are Japanese; without such a font they
    would render as boxes, so the plots fall back to English names for the IgakuQA specialties."""
    from matplotlib import font_manager

    return next((f.name for f in font_manager.fontManager.ttflist
                 if any(k in f.name for k in CJK_FONT_HINTS)), None)


def plot_category_deltas(comparison: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Horizontal bar chart of per-category accuracy deltas (B − A), significant bars darker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(comparison["by_category"], key=lambda r: r["delta"])
    font = cjk_font()
    names = [r["subset"] if font else CATEGORY_EN.get(r["subset"], r["subset"]) for r in rows]
    labels = [f"{name} (n={r['n']})" for name, r in zip(names, rows, strict=True)]
    deltas = [100 * r["delta"] for r in rows]
    colors = ["#1f5fa8" if r["p_value"] < SIGNIFICANCE_LEVEL else "#9bbbe0" for r in rows]
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.3 * len(rows) + 1.5)))
    try:
        if font:
            ax.set_yticks(range(len(rows)), labels, fontfamily=font)
        else:
            ax.set_yticks(range(len(rows)), labels)
        ax.barh(range(len(rows)), deltas, color=colors)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_xlabel(f"accuracy delta, {comparison['b']} − {comparison['a']} (points)")
        ax.set_title("IgakuQA per-category delta (dark: McNemar p < 0.05)")
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Glyph .* missing from")
            fig.tight_layout()
            fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out
