"""A training session: the actor, reference, rollout server and weight sync of one run.

`loop.py` reads as the algorithm; this module holds the plumbing it calls.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import RecipeConfig
from ..megatron.actor import Actor, Training, init_parallel
from ..megatron.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    prune_checkpoints,
    remove_partial_checkpoints,
    save_checkpoint,
)
from ..megatron.devices import wait_for_rank0
from ..megatron.providers import build_model_recipe
from ..model_config import init_checkpoint, is_megatron_checkpoint, read_hf_config
from ..rollout.client import MultiClient, RolloutClient, SamplingSettings
from ..rollout.server import RolloutServer
from ..rollout.shm import remove_stale as remove_stale_shm
from ..rollout.supervisor import ProbeExpectation, ServerSupervisor
from ..tasks import LoadedTask
from ..types import TrainBatch
from ..weights.adapters import adapter_for
from ..weights.loading import load_hf_into_model
from ..weights.sync import FanoutTransport
from ..weights.transport_file import FileTransport
from . import lora_run, verification
from .data_order import DataOrder
from .setup import load_prompts, load_sft_tokens, require_eos

EXTERNAL_SERVERS_ENV = "MEGATRON_RL_ROLLOUT_SERVERS"


class Stop(Exception):
    """The run must stop (reason in the message)."""


class Session:
    def __init__(self, cfg: RecipeConfig, run_dir: Path, task: LoadedTask) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.run_dir = cfg, run_dir
        self.rank0 = dist.get_rank() == 0
        _require(cfg.model.init_checkpoint, "model.init_checkpoint (an HF directory or a Megatron dist-checkpoint)")
        self.init = init_checkpoint(cfg.model)
        self.hf_dir = self.init.hf_dir                       # HF config and tokenizer files
        self.hf = read_hf_config(self.hf_dir)
        self.adapter = adapter_for(self.hf)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or self.hf_dir)
        require_eos(self.tokenizer, cfg.model.tokenizer or self.hf_dir)
        self.dtype = torch.bfloat16 if (cfg.model.params_dtype == "bf16" or
                                        (cfg.model.params_dtype == "auto" and torch.cuda.is_available())) \
            else torch.float32
        t, a = cfg.trainer, cfg.algorithm
        self.prompts = load_prompts(_require(cfg.data.train_path, "data.train_path"), self.tokenizer,
                                    cfg.rollout.max_prompt_length, cfg.data.on_malformed, task.task.prompt)
        self.prompts_per_step = t.global_batch_size * a.steps_per_generation // cfg.rollout.n
        self.total_steps = t.max_steps or t.epochs * math.ceil(len(self.prompts.records) / self.prompts_per_step)
        updates = self.total_steps * a.steps_per_generation
        init_parallel(cfg.parallelism, t.seed)
        recipe = build_model_recipe(self.hf, cfg.parallelism, self.dtype)
        self.actor = Actor(recipe, t.micro_batch_size, Training(t, cfg.parallelism, updates),
                           t.max_tokens_per_microbatch, lora=cfg.lora)
        _load_init(self.actor, self.init.path)
        self.reference: Any = None if a.kl_beta <= 0 else \
            lora_run.BaseReference(self.actor) if lora_run.uses_base_reference(cfg) else self._reference(recipe)
        self.sft = load_sft_tokens(_require(cfg.data.sft_path, "data.sft_path"), self.tokenizer,
                                   cfg.data.on_malformed) if cfg.algorithm.name == "chord" else None
        self.order = DataOrder(len(self.prompts.records), t.seed, cfg.data.shuffle)
        self.sft_order = DataOrder(len(self.sft), t.seed + 1) if self.sft else None
        self.version = 0
        self.servers: list[RolloutServer] = []
        self.transports: list[FileTransport] = []
        self.clients: list[RolloutClient] = []
        self.supervisors: list[ServerSupervisor] = []
        self.resync_restored = False
        """The first sync after a resume re-sends the checkpointed weights under their own version."""
        self.transport: FileTransport | FanoutTransport | None = None
        self.client: RolloutClient | MultiClient | None = None
        self.stop_signal: str | None = None

    def _reference(self, recipe: Any) -> Actor:
        ref = Actor(recipe, self.cfg.trainer.micro_batch_size, None, self.cfg.trainer.max_tokens_per_microbatch)
        path = _require(self.cfg.model.reference_path, "model.reference_path") if self.cfg.model.reference == "path" \
            else self.init.path
        _load_init(ref, path)
        return ref

    # ------------------------------------------------------------------ rollout server
    def start_server(self) -> None:
        """Our own server on this node, or — when the sbatch script started servers on rollout
        nodes — every server listed under $MEGATRON_RL_ROLLOUT_SERVERS (`*/rollout/server.json`)."""
        if not self.rank0:
            return
        freed = remove_stale_shm()
        if freed:
            print(f"[rollout] removed {freed / 2**20:.0f} MiB of /dev/shm left by dead runs", flush=True)
        r = self.cfg.rollout
        external = os.environ.get(EXTERNAL_SERVERS_ENV)
        sync_root = None
        if external:
            found = sorted(Path(external).glob("*/rollout/server.json"))
            if not found:
                raise Stop(f"${EXTERNAL_SERVERS_ENV}={external}: no */rollout/server.json there")
            self.servers = [RolloutServer.attach(p.parent.parent, r) for p in found]
            sync_root = self.run_dir / "rollout" / "sync"       # shared with the rollout nodes
            print(f"[rollout] using {len(self.servers)} external server(s): "
                  + ", ".join(s.base_url for s in self.servers), flush=True)
        else:
            server = RolloutServer(self.hf_dir, self.run_dir, r, r.max_prompt_length + r.max_response_length,
                                   extra_args=self.init.server_args)
            server.start()
            self.servers = [server]
        self.transports = [FileTransport(s, sync_root, r.sync_bucket_mb << 20) for s in self.servers]
        self.supervisors = [ServerSupervisor(s, t) for s, t in zip(self.servers, self.transports)]
        for transport, supervisor in zip(self.transports, self.supervisors):
            transport.supervise = supervisor.call
        self.clients = [RolloutClient.for_server(s, max_concurrency=r.max_concurrency, timeout_s=r.request_timeout_s,
                                                 max_retries=r.max_retries, on_failure=sup)
                        for s, sup in zip(self.servers, self.supervisors)]
        self.transport = self.transports[0] if len(self.transports) == 1 else FanoutTransport(self.transports)
        self.client = self.clients[0] if len(self.clients) == 1 else MultiClient(self.clients)

    def sampling(self) -> SamplingSettings:
        r = self.cfg.rollout
        return SamplingSettings(r.n, r.temperature, r.top_p, r.top_k, r.max_response_length, r.logprobs_mode)

    def sync(self) -> dict[str, float]:
        """Push the actor's weights to the server under a new version (collective)."""
        # Rank 0 may have spent minutes starting the server or generating: wait for it on the CPU,
        # not inside the NCCL collectives of the gather.
        wait_for_rank0()
        self.version += 0 if self.resync_restored else 1
        self.resync_restored = False
        report = lora_run.sync(self.actor, self.adapter, self.transport, self.version, self.dtype)
        if report is None:
            return {}
        return {"sync/seconds": report.seconds, "sync/mb": report.bytes / 2**20, "sync/parts": report.parts}

    def verify(self, probe: TrainBatch) -> dict[str, float]:
        """Server log-probs of fixed sequences vs the trainer's own (T = 1): statistics of |Δ| over
        the probe's response tokens, gated by the bounds of the weights' dtype (`verification`)."""
        trainer_lp = self.actor.compute_logprobs(probe, temperature=1.0)      # on the CPU
        stats = torch.zeros(len(verification.STATS), dtype=torch.float64)
        limits = verification.limits_for(self.dtype, self.cfg.rollout.verify_tolerance)
        if self.rank0:
            seqs = verification.probe_sequences(probe)
            # What a restarted server is checked against (max |Δ|: a server restarted with other
            # weights is off by O(1); bf16 has no max bound of its own, so 10× its p90 bound).
            expected = ProbeExpectation(self.version, seqs, [
                [float(trainer_lp[i, j]) if probe.mask[i, j] > 0 else None for j in range(len(seq) - 1)]
                for i, seq in enumerate(seqs)], limits.max if limits.max is not None else 10 * limits.p90)
            clients = []
            for client, supervisor in zip(self.clients, self.supervisors):     # every server must agree
                supervisor.expected = expected
                clients.append(_Supervised(client, supervisor))
            stats = verification.diff_stats(verification.server_diffs(trainer_lp, probe, clients))
        dist.broadcast(stats, src=0)                         # a CPU tensor: gloo, also on GPU runs
        problem = verification.failure(stats, limits)
        if problem:
            raise Stop(f"weight-sync verification failed at version {self.version} ({self.dtype}): {problem} "
                       "(server and trainer disagree)")
        return verification.as_metrics(stats)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        root = self.run_dir / "checkpoints"
        extra = {"step": step, "order": self.order.state(), "version": self.version,
                 "sft_order": self.sft_order.state() if self.sft_order else None,
                 "py_random": _encode_random_state(),
                 **lora_run.checkpoint_extra(self.cfg, self.init.path, self.hf_dir)}
        path = save_checkpoint(self.actor, root / f"step_{step:08d}", extra)
        if self.rank0:
            prune_checkpoints(root, self.cfg.checkpoint.keep_last)
        dist.barrier()
        return path

    def resume(self) -> int:
        """Load the latest complete checkpoint; returns the step it ended (0 = none)."""
        if self.rank0:
            for stale in remove_partial_checkpoints(self.run_dir / "checkpoints"):
                print(f"[resume] removed {stale}: a save that did not finish", flush=True)
        latest = latest_checkpoint(self.run_dir / "checkpoints")
        if latest is None:
            return 0
        lora_run.check_resume(self.cfg, latest, self.init.path)
        extra = load_checkpoint(self.actor, latest)
        self.order.load(extra["order"])
        if self.sft_order and extra.get("sft_order"):
            self.sft_order.load(extra["sft_order"])
        random.setstate(_decode_random_state(extra["py_random"]))
        self.version = int(extra["version"])
        self.resync_restored = True
        if self.rank0:
            print(f"[resume] from {latest} (step {extra['step']})", flush=True)
        return int(extra["step"])

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.stop_signal = signal.Signals(signum).name

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, handler)

    def agree_on_stop(self) -> None:
        """Signals reach ranks at different moments; all ranks must stop (and save) at the same
        step, or the collective checkpoint hangs. MAX-reduce the flag once per step."""
        flag = torch.tensor([1.0 if self.stop_signal else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.stop_signal:
            self.stop_signal = "stop requested on another rank"

    def reseed_servers(self, step: int) -> None:
        seed = (self.cfg.trainer.seed * 1_000_003 + step) % (2**31 - 1)
        for server, supervisor in zip(self.servers, self.supervisors):
            supervisor.call("the per-step reseed", server.rpc, "mrl_reseed", str(seed))

    def close(self) -> None:
        for transport in self.transports:
            transport.close()
        for server in self.servers:
            server.stop()                                    # a no-op for external servers


def _load_init(actor: Actor, path: str) -> None:
    """Starting weights from an HF directory or a Megatron dist-checkpoint (any layout)."""
    if is_megatron_checkpoint(path):
        load_weights(actor, path)
        return
    load_hf_into_model(actor.model, path)
    if actor.trainable:
        actor.optimizer.reload_model_params()   # fp32 master weights follow the loaded weights


def _require(value: str | None, what: str) -> str:
    if not value:
        raise Stop(f"the recipe must set {what}")
    return value


def _encode_random_state() -> str:
    return json.dumps(random.getstate(), default=list)


def _decode_random_state(text: str) -> tuple:
    version, internal, gauss = json.loads(text)
    return (version, tuple(internal), gauss)


def timed(timings: dict[str, float], name: str) -> Any:
    class _Timer:
        def __enter__(self) -> None:
            self.t = time.perf_counter()

        def __exit__(self, *exc: Any) -> None:
            timings[f"time/{name}"] = time.perf_counter() - self.t

    return _Timer()


class _Supervised:
    """A client whose verification requests go through its server's supervisor (a crash
    restarts the server, re-sends the weights and redoes the request)."""

    def __init__(self, client: RolloutClient, supervisor: ServerSupervisor) -> None:
        self.client, self.supervisor = client, supervisor

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        return self.supervisor.call("the sync verification", self.client.prompt_logprobs, seqs)
