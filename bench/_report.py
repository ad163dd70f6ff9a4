"""The end of every benchmark that reports JSON: load and wall time added, printed, optionally saved."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def emit(out: dict[str, Any], started: float, json_out: Path | None) -> None:
    """`started`: the benchmark's `time.perf_counter()` at its start."""
    out["loadavg_end"] = os.getloadavg()
    out["wall_s"] = time.perf_counter() - started
    text = json.dumps(out, indent=1)
    print(text)
    if json_out is not None:
        json_out.write_text(text + "\n")
