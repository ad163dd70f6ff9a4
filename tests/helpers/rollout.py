"""Shared set-up for tests that need real rollout servers: demo assets and tiny models on disk."""

from __future__ import annotations

import os
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import torch

from megatron_rl.commands.demo import cache_root
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.demo.prepare import TOKENIZER_FILES, prepare_demo_assets
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.server import RolloutServer, ServerExited
from megatron_rl.sync.shm import SharedSegmentTransport
from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.helpers.models import TINY_MOE

REPO = Path(__file__).resolve().parents[2]


def demo_assets() -> dict[str, Path]:
    """The demo's cached assets (task data, tokenizer, warmed-up tiny MoE), where `megatron-rl demo`
    keeps them (the checkout's .cache, or $MEGATRON_RL_CACHE)."""
    return prepare_demo_assets(cache_root() / "demo", TINY_MOE)


def unit_assets() -> dict[str, Path]:
    """The same task data, tokenizer and tiny MoE without the warm-up (seconds to build): for unit
    tests that read the files but train nothing. In their own folder, so they never replace the
    demo's warmed-up model."""
    return prepare_demo_assets(cache_root() / "unit", TINY_MOE, warmup_steps=0)


def unit_paths(recipe: str | Path) -> list[str]:
    """Overrides that point a tiny recipe at `unit_assets()` (CHORD's SFT rows too)."""
    a = unit_assets()
    paths = [f"model.init_checkpoint={a['model']}", f"data.train_path={a['train']}", f"data.eval_path={a['eval']}"]
    return paths + ([f"data.sft_path={a['sft']}"] if "chord" in Path(recipe).name else [])


def tiny_model_with_tokenizer(fields: dict, out: Path, seed: int = 0) -> Path:
    """A random tiny checkpoint with the demo's tokenizer, taken from `unit_assets()`: the demo's
    200-step warm-up of the tiny MoE would cost a fresh image a minute before any GPU test (audit 3 #15)."""
    model = build_tiny_hf_checkpoint(fields, out, seed=seed)
    tok = unit_assets()["model"]
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copy2(tok / name, model / name)
    return model


def start_server(model: Path, run_dir: Path, server_cls: type[RolloutServer] = RolloutServer,
                 **overrides: object) -> RolloutServer:
    defaults: dict[str, Any] = dict(enforce_eager=True, dtype="float32", max_concurrency=16, startup_timeout_s=600,
                                    max_retries=6)
    cfg = RolloutConfig(**{**defaults, **overrides})    # type: ignore[arg-type]
    server = server_cls(str(model), run_dir, cfg, max_model_len=128)
    try:
        server.start()
    except ServerExited as e:
        # Once seen in CI (a TP1 start beside another worker's TP2 server, exit code 1, log lost
        # with the runner): a second failure fails the test, and the first one's log is reported.
        # Not a start-up timeout: a hung start (a GPU test's) would be waited for twice.
        warnings.warn(f"a rollout server failed to start; starting it once more. {e}", stacklevel=2)
        server.start()
    return server


def prompts(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from megatron_rl.data.schema import read_prompts

    tok = AutoTokenizer.from_pretrained(demo_assets()["model"])
    recs = read_prompts(demo_assets()["eval"])[:n]
    return [list(tok.apply_chat_template(r.messages, add_generation_prompt=True, return_dict=True)["input_ids"])
            for r in recs]


def _hf_logprobs(state: dict[str, torch.Tensor], sequences: list[list[int]], work: Path,
                 model_dir: str | None = None) -> list[torch.Tensor]:
    """float64 log-probs of every token after the first, from HF transformers on `state` (written
    as a checkpoint: transformers 5 fuses MoE experts at load time, so state-dict names differ)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.weights.hf_io import HFCheckpointWriter

    writer = HFCheckpointWriter(work)
    writer.add_many(list(state.items()))
    writer.finish(side_files_from=model_dir or str(demo_assets()["model"]))
    model = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            out.append(logp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1))
    return out


def _server_diff(server: RolloutServer, expected: list[torch.Tensor], sequences: list[list[int]]) -> float:
    got = RolloutClient.for_server(server).prompt_logprobs(sequences)
    return max((torch.tensor(g, dtype=torch.float64) - ref).abs().max().item() for g, ref in zip(got, expected))


def _send(transport: SharedSegmentTransport, version: int, state: dict[str, torch.Tensor]) -> dict:
    transport.begin(version)
    names = sorted(state)
    for start in range(0, len(names), 7):             # a few tensors per hand-over, like layers
        transport.send_bucket({n: state[n] for n in names[start:start + 7]})
    return transport.finish(names)


class KillingServer(RolloutServer):
    """Kills its own process group right before the `nth` call matching `target` (a path or an
    rpc method) goes out, so that call meets a dead server."""

    target: str | None = None
    nth: int = 1
    seen: int = 0
    kills: int = 0

    def arm(self, target: str, nth: int = 1) -> None:
        self.target, self.nth, self.seen = target, nth, 0

    def _maybe_kill(self, name: str) -> None:
        if name == self.target:
            self.seen += 1
            if self.seen == self.nth:
                self.target = None
                self.kills += 1
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def post(self, path: str, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
             timeout: float = 600.0) -> Any:
        self._maybe_kill(body["method"] if path == "/collective_rpc" and body else path)
        return super().post(path, body, params, timeout)
