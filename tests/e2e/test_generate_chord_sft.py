"""`data generate chord-sft` on the tiny model through the shared rollout server, as a user runs it: a
first run killed (SIGKILL) after some rows, the same command run again (in the test's process: one
interpreter start less), then `data prepare chord-sft
--parts 5` on the output. Every prompt ends up once: the rows the killed run wrote are kept byte for
byte, none is written twice, none is lost. The prompts are an edited copy of the shipped ones, short
enough for the shared server's 128-token context."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.rollout.server import RolloutServer
from tests.helpers.rollout import REPO, demo_assets

PROMPTS = 5


def _edited_prompts(root: Path) -> Path:
    root.mkdir()
    (root / "question.txt").write_text("Rewrite as one question: {mcq} ({answer})", encoding="utf-8")
    (root / "answer.txt").write_text("{question} {title}: {instruction}\n{previous}", encoding="utf-8")
    (root / "parts.txt").write_text("".join(f"P{k}\tpart {k}.\n" for k in range(1, 6)), encoding="utf-8")
    return root


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_generate_killed_then_resumed_gives_every_row_once(tmp_path: Path, demo_server: RolloutServer,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out, prompts = tmp_path / "expert_texts.jsonl", _edited_prompts(tmp_path / "prompts")
    argv = [sys.executable, "-m", "megatron_rl.cli", "data", "generate", "chord-sft", "--src",
            str(demo_assets()["train"]), "--out", str(out), "--server", str(demo_server.run_dir), "--prompts",
            str(prompts), "--limit", str(PROMPTS), "--max-tokens", "6", "--batch-size", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    started = time.monotonic()
    first = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        while not (out.exists() and len(out.read_bytes().splitlines()) >= 2) and first.poll() is None:
            assert time.monotonic() - started < 300, "no row written in 300 s"
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)
    finally:
        first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL, first.stdout.read() if first.stdout else ""
    kept = out.read_bytes()
    kept = kept[:kept.rfind(b"\n") + 1]                     # a row the kill cut in half is not kept
    before = [json.loads(line)["id"] for line in kept.splitlines()]
    assert 2 <= len(before) < PROMPTS, before

    assert main(argv[3:]) == 0                              # the same command again (in this process)
    captured = capsys.readouterr()
    assert f"{PROMPTS - len(before)} expert texts written, {len(before)} there before" in captured.out
    assert "expert texts [" in captured.err and f"] {PROMPTS}/{PROMPTS} " in captured.err   # the progress bar
    assert out.read_bytes().startswith(kept)                # the killed run's rows, as written
    ids = _ids(out)
    wanted = [json.loads(line)["id"] for line in demo_assets()["train"].read_text().splitlines()[:PROMPTS]]
    assert sorted(ids) == sorted(wanted) and len(set(ids)) == len(ids), ids
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert all([s["title"] for s in r["sections"]] == [f"P{k}" for k in range(1, 6)] for r in rows)

    sft = tmp_path / "sft"
    assert main(["data", "prepare", "chord-sft", "--src", str(out), "--out", str(sft), "--parts", "5"]) == 0
    assert f"chord_sft.jsonl: {PROMPTS} records" in capsys.readouterr().out
