"""Periodic evaluation in a real tiny run: `eval/*` metrics from greedy answers on `data.eval_path`."""

from __future__ import annotations

import pytest

from megatron_rl.types import RolloutGroup, Sample


def _group(record: dict, text: str) -> RolloutGroup:
    return RolloutGroup(0, record, [Sample(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[0.0, 0.0],
                                           text=text)])

def test_igakuqa_eval_prompts_are_scored_with_the_benchmark_rule() -> None:
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()          # what `megatron-rl train` does before importing the trainer
    from megatron_rl.tasks import resolve_task
    from megatron_rl.train.batch import Scores
    from megatron_rl.train.fleet import eval_metrics

    def q(pid: str, answer: list[str], points: int, kinki: list[str] = (), alternatives: list = ()) -> dict:
        return {"id": pid, "source": "igakuqa", "choices": list("abcde"), "answer": answer,
                "alternatives": list(alternatives), "metadata": {"points": points, "kinki": list(kinki)}}

    groups = [_group(q("117A1", ["a"], 1), "...[ans]a[/ans]"),                      # right: 1 point
              _group(q("117B2", ["b", "c"], 3), "[ans]c, b[/ans]"),                 # right (a set): 3 points
              _group(q("117C3", ["d"], 1, kinki=["e"]), "[ans]e[/ans]"),            # wrong, prohibited
              _group(q("112B30", ["a"], 1, alternatives=[["d"]]), "[ans]d[/ans]"),  # the accepted alternative
              _group({"id": "x", "source": "synthetic_mcq", "choices": ["1", "2"], "answer": ["a"],
                      "metadata": {}}, "[ans]a[/ans]")]                              # not IgakuQA: not counted
    task = resolve_task("igakuqa", {"mcq_answer": 1.0})
    texts = [s.text for g in groups for s in g.samples]
    scores = Scores(texts, [1.0] * 5, [{"mcq_answer": 1.0}] * 5,
                    task.batch_metrics(texts, [g.record for g in groups]))
    m = eval_metrics(groups, scores, task)
    assert m["eval/igakuqa/questions"] == 4
    assert m["eval/igakuqa/accuracy"] == pytest.approx(3 / 4)
    assert m["eval/igakuqa/score"] == pytest.approx(5 / 6)
    assert m["eval/igakuqa/prohibited_rate"] == pytest.approx(1 / 4)
    assert m["eval/prompts"] == 5
