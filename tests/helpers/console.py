"""What counts as a third-party line on our console (the demo's and the CLI's)."""

from __future__ import annotations

import os
import re

THIRD_PARTY = {
    "a warning": re.compile(r"\b\w*Warning\b|DEPRECATED|deprecated"),
    "a library that failed to load": re.compile(r"Failed to load"),
    "a glog / torch-logging line (W1201 12:00:00.000 ...)": re.compile(r"^[WEIF]\d{4} \d\d:\d\d:\d\d"),
    "a tqdm bar": re.compile(r"\d+%\|.*\|.*(it/s|s/it|\?it)"),
}


def console_lines(out: str) -> list[str]:
    """Lines as a person sees them; a tqdm bar redraws itself with carriage returns."""
    return [part for line in out.splitlines() for part in line.split("\r")]


def third_party_lines(lines: list[str]) -> dict[str, list[str]]:
    """{kind: the lines of that kind}, for the kinds that occur."""
    found = {what: [line for line in lines if pattern.search(line)] for what, pattern in THIRD_PARTY.items()}
    return {what: hits for what, hits in found.items() if hits}


def user_env(**extra: str) -> dict[str, str]:
    """A person's environment for a CLI subprocess: without what pytest's own quieting put into
    ours (HF_HUB_DISABLE_PROGRESS_BARS), so the CLI has to quiet things itself."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}
