"""Exact McNemar test for paired correct/incorrect outcomes, standard library only.

Given the discordant pairs b (A right, B wrong) and c (A wrong, B right), under H0 each discordant
pair goes either way with probability 1/2, so min(b, c) ~ Binomial(b + c, 1/2) and the two-sided
exact p-value is

    p = min(1, 2 * P[X <= min(b, c)]),  X ~ Binomial(b + c, 1/2)

computed here exactly in integers (sum of binomial coefficients over 2**n) and rounded once, so it
matches `scipy.stats.binomtest(min(b, c), b + c, 0.5).pvalue` to floating-point precision. With
no discordant pairs there is no evidence either way and p = 1. The cost is O(min(b, c)) big-integer
additions of n-bit numbers: well under a millisecond for the few thousand questions of a medical
benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

# The published tables' marks: ** for p < 0.01, * for p < 0.05 (strict: p = 0.05 is unmarked).
SIGNIFICANCE_MARKS: tuple[tuple[float, str], ...] = ((0.01, "**"), (0.05, "*"))


@dataclass(frozen=True)
class McNemarResult:
    b: int
    c: int
    p_value: float

    @property
    def discordant(self) -> int:
        return self.b + self.c


def binomial_half_cdf_numerator(k: int, n: int) -> int:
    """sum_{i=0..k} C(n, i) — i.e. P[X <= k] * 2**n for X ~ Binomial(n, 1/2)."""
    total = 0
    term = 1  # C(n, 0)
    for i in range(min(k, n) + 1):
        total += term
        term = term * (n - i) // (i + 1)  # exact: C(n, i+1) = C(n, i) * (n - i) / (i + 1)
    return total


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for discordant counts b and c."""
    for name, value in (("b", b), ("c", c)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    n = b + c
    if n == 0:
        return 1.0
    numerator = 2 * binomial_half_cdf_numerator(min(b, c), n)
    denominator = 1 << n
    if numerator >= denominator:
        return 1.0
    # int / int is correctly rounded in CPython, however large the operands.
    return numerator / denominator


def mcnemar(a_correct: list[bool], b_correct: list[bool]) -> McNemarResult:
    """McNemar on two aligned per-question correctness vectors."""
    if len(a_correct) != len(b_correct):
        raise ValueError(f"length mismatch: {len(a_correct)} vs {len(b_correct)}")
    b = sum(1 for x, y in zip(a_correct, b_correct, strict=True) if x and not y)
    c = sum(1 for x, y in zip(a_correct, b_correct, strict=True) if y and not x)
    return McNemarResult(b=b, c=c, p_value=mcnemar_exact(b, c))


def significance_mark(p_value: float) -> str:
    """"**" below 0.01, "*" below 0.05, "" otherwise."""
    for threshold, mark in SIGNIFICANCE_MARKS:
        if p_value < threshold:
            return mark
    return ""


def format_p(p_value: float) -> str:
    """Three significant digits, as the published tables print them (0.0013, 0.349, 0.775),
    followed by the mark; the exact value belongs in the JSON."""
    mark = significance_mark(p_value)
    return f"{p_value:.3g}" + (f" {mark}" if mark else "")
