"""Wall time of every registered reward on 1 MB and pathological responses.

The reward tests check correctness on these inputs (a catastrophically backtracking regex would
hang them); the timing lives here, not in a timed test. Each input's time is the best of
`--repeats` runs; the JSON gives per reward the max and mean of those over the inputs and the
slowest input. Usage:

    python bench/rewards_bench.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.rewards import available_rewards, get_reward  # noqa: E402
from megatron_rl.tasks import load_builtin_tasks  # noqa: E402

MEGABYTE = 1_000_000
SAMPLE = {"answer": ["a", "c"], "metadata": {"kinki": ["b"]}}


def inputs() -> dict[str, str]:
    rng = random.Random(0)
    pieces = ("[ans]", "[/ans]", "a", ",", "、", " ", "。", "あ", "Answer: ", "option ", "\n")
    noise = "".join(rng.choice(pieces) for _ in range(400_000))[:MEGABYTE]
    return {
        "1MB prose + answer": ("診断は急性心筋梗塞である。" * 80_000)[:MEGABYTE] + "[ans]a,c[/ans]",
        "1MB random pieces": noise,
        "[ans] x 200000": "[ans]" * 200_000,
        "a, x 500000": "a," * 500_000,
        "[ans]a,a,...[/ans]": "[ans]" + "a," * 500_000 + "[/ans]",
        "1MB kana, no 。": "あ" * MEGABYTE,
        "1MB 。": "。" * MEGABYTE,
        "answer + 1MB spaces": "answer" + " " * MEGABYTE + "B",
        "Answer: x 125000": "Answer: " * 125_000,
        "1MB [ then ]": "[" * 500_000 + "]" * 500_000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cases = inputs()
    load_builtin_tasks()                   # the built-in tasks' rewards register on import
    result: dict[str, dict[str, object]] = {}
    for name in available_rewards():
        fn = get_reward(name)
        times: dict[str, float] = {}
        for label, text in cases.items():
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn(text, SAMPLE)
                best = min(best, time.perf_counter() - start)
            times[label] = best * 1e3
        slowest = max(times, key=times.__getitem__)
        result[name] = {"max_ms": round(times[slowest], 4),
                        "mean_ms": round(sum(times.values()) / len(times), 4),
                        "slowest_input": slowest}
    print(json.dumps({"inputs": len(cases), "repeats": args.repeats, "rewards": result},
                     ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
