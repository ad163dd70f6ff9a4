"""Exact McNemar test against scipy's exact binomial test."""

from __future__ import annotations

import math
import random

import pytest
from scipy.stats import binomtest

from megatron_rl.tasks.igakuqa.stats import binomial_half_cdf_numerator, mcnemar, mcnemar_exact

REL_TOL = 1e-12


def scipy_mcnemar(b: int, c: int) -> float:
    return float(binomtest(min(b, c), b + c, 0.5).pvalue)


def assert_close(ours: float, theirs: float, table: tuple[int, int]) -> None:
    assert abs(ours - theirs) <= REL_TOL * abs(theirs), (table, ours, theirs)


def tables() -> list[tuple[int, int]]:
    small = [(b, c) for b in range(0, 41) for c in range(0, 41) if b + c > 0]
    rng = random.Random(1234)
    large = [(rng.randint(0, 1000), rng.randint(0, 1000)) for _ in range(150)]
    skewed = [(rng.randint(0, 60), rng.randint(400, 1100)) for _ in range(50)]
    extremes = [(0, 1), (1, 0), (0, 1000), (1000, 0), (1, 999), (500, 500), (499, 501),
                (480, 520), (450, 550), (1000, 1000), (0, 1020), (113, 563)]
    return small + large + skewed + [(c, b) for b, c in skewed] + extremes


def log_p_lgamma(b: int, c: int) -> float:
    """log p by log-sum-exp over lgamma binomial terms: an independent route to tiny p-values."""
    n, k = b + c, min(b, c)
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(k + 1)]
    top = max(logs)
    return math.log(2) + top + math.log(sum(math.exp(x - top) for x in logs)) - n * math.log(2)


def test_matches_scipy_binomtest_on_many_tables() -> None:
    underflowed = 0
    for b, c in tables():
        theirs = scipy_mcnemar(b, c)
        ours = mcnemar_exact(b, c)
        if theirs == 0.0:
            # scipy's pmf-based sum underflows below ~1e-260 for very skewed tables; the exact
            # integer computation still returns the (tiny, positive) value.
            underflowed += 1
            assert ours > 0.0
            assert math.log(ours) == pytest.approx(log_p_lgamma(b, c), rel=1e-9)
        else:
            assert_close(ours, theirs, (b, c))
    assert underflowed < len(tables()) // 10


def test_no_discordant_pairs_gives_one() -> None:
    # scipy's binomtest rejects n = 0; with no discordant pair there is no evidence: p = 1.
    with pytest.raises(ValueError):
        binomtest(0, 0, 0.5)
    assert mcnemar_exact(0, 0) == 1.0


def test_symmetric_and_bounded() -> None:
    for b, c in [(3, 9), (10, 10), (0, 7), (250, 300)]:
        assert mcnemar_exact(b, c) == mcnemar_exact(c, b)
        assert 0.0 < mcnemar_exact(b, c) <= 1.0
    assert mcnemar_exact(10, 10) == 1.0
    assert mcnemar_exact(10, 11) == 1.0


def test_small_tables_by_hand() -> None:
    # b=0, c=5: 2 * (1/2)^5 = 1/16;  b=1, c=5: 2 * (1 + 6)/64 = 7/32.
    assert mcnemar_exact(0, 5) == 1 / 16
    assert mcnemar_exact(1, 5) == 7 / 32
    assert binomial_half_cdf_numerator(2, 4) == 1 + 4 + 6


def test_rejects_bad_counts() -> None:
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            mcnemar_exact(bad, 3)  # type: ignore[arg-type]


def test_mcnemar_on_correctness_vectors() -> None:
    a = [True, True, False, False, True, False, True]
    b = [True, False, True, True, False, True, True]
    result = mcnemar(a, b)
    assert (result.b, result.c) == (2, 3)
    assert_close(result.p_value, scipy_mcnemar(2, 3), (2, 3))
    with pytest.raises(ValueError, match="length"):
        mcnemar([True], [True, False])
