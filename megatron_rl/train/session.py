"""A training session: the plumbing of one run — tokenizer, prompts and data order, the actor and
the reference, the rollout servers with their clients, supervisors and weight transports.

It holds objects and starts or stops them; what one RL step does with them lives in the phase
modules that `loop.py` calls (`rollout_phase`, `batch`, `update_phase`, `sync_phase`, ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import RecipeConfig
from ..megatron.actor import Actor, Training, init_parallel
from ..megatron.checkpoint import load_weights
from ..megatron.providers import build_model_recipe
from ..model_config import init_checkpoint, is_megatron_checkpoint, read_hf_config
from ..rollout.client import MultiClient, RolloutClient, SamplingSettings
from ..rollout.server import EXTERNAL_SERVERS_ENV, RolloutServer
from ..rollout.shm import remove_stale_and_say
from ..rollout.supervisor import ServerSupervisor
from ..schedule import run_schedule
from ..sync import Transport, make_transport
from ..tasks import LoadedTask
from ..weights.adapters import adapter_for
from ..weights.loading import load_hf_into_model
from . import lora_run
from .data_order import DataOrder
from .placement import start_node_servers
from .run_control import Stop
from .setup import load_prompts, load_sft_tokens, require_eos


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
                                    cfg.rollout.max_prompt_length, cfg.data.on_malformed, task.task.prompt,
                                    cfg.rollout.chat_template_kwargs)
        schedule = run_schedule(cfg, len(self.prompts.records))
        assert schedule is not None
        self.prompts_per_step, self.total_steps = schedule.prompts_per_rollout, schedule.rollout_steps
        updates = schedule.updates
        init_parallel(cfg.parallelism, t.seed, t.collective_timeout_min)
        recipe = build_model_recipe(self.hf, cfg.parallelism, self.dtype)
        self.actor = Actor(recipe, t.micro_batch_size, Training(t, cfg.parallelism, updates),
                           t.max_tokens_per_microbatch, lora=cfg.lora)
        _load_init(self.actor, self.init.path)
        self.reference: Any = None if a.kl_beta <= 0 else \
            lora_run.BaseReference(self.actor) if lora_run.uses_base_reference(cfg) else self._reference(recipe)
        self.sft = load_sft_tokens(_require(cfg.data.sft_path, "data.sft_path"), self.tokenizer,
                                   cfg.data.on_malformed, cfg.rollout.chat_template_kwargs) \
            if cfg.algorithm.name == "chord" else None
        self.order = DataOrder(len(self.prompts.records), t.seed, cfg.data.shuffle)
        self.sft_order = DataOrder(len(self.sft), t.seed + 1) if self.sft else None
        self.servers: list[RolloutServer] = []
        self.own_server: RolloutServer | None = None
        """The server this process started (each node's first rank starts its node's)."""
        self.transports: list[Any] = []
        self.clients: list[RolloutClient] = []
        self.supervisors: list[ServerSupervisor] = []
        self.transport: Transport | None = None
        self.client: RolloutClient | MultiClient | None = None

    def _reference(self, recipe: Any) -> Actor:
        ref = Actor(recipe, self.cfg.trainer.micro_batch_size, None, self.cfg.trainer.max_tokens_per_microbatch)
        path = _require(self.cfg.model.reference_path, "model.reference_path") if self.cfg.model.reference == "path" \
            else self.init.path
        _load_init(ref, path)
        return ref

    # ------------------------------------------------------------------ rollout server
    def start_server(self) -> None:
        """Collective. One server per trainer node, started by that node's first rank (`placement`),
        or — when the sbatch script started servers on rollout nodes — every server listed under
        $MEGATRON_RL_ROLLOUT_SERVERS (`*/rollout/server.json`). Rank 0 drives them all."""
        r = self.cfg.rollout
        external = os.environ.get(EXTERNAL_SERVERS_ENV)
        if not external:
            self.own_server, self.servers = start_node_servers(self.cfg, self.run_dir, self.hf_dir,
                                                               self.init.server_args)
        if not self.rank0:
            return
        if external:
            remove_stale_and_say()
            found = sorted(Path(external).glob("*/rollout/server.json"))
            if not found:
                raise Stop(f"${EXTERNAL_SERVERS_ENV}={external}: no */rollout/server.json there")
            self.servers = [RolloutServer.attach(p.parent.parent, r) for p in found]
            print(f"[rollout] using {len(self.servers)} external server(s): "
                  + ", ".join(s.base_url for s in self.servers), flush=True)
        # One sender for all servers (write once / one broadcast); per server, what its supervisor
        # re-sends. A lone server on this node reads /dev/shm; several (other nodes) read the run dir.
        lone = len(self.servers) == 1 and self.servers[0] is self.own_server
        sync_root = None if lone else self.run_dir / "rollout" / "sync"
        self.transport, self.transports = make_transport(r.weight_transfer, self.servers, sync_root,
                                                         r.sync_bucket_mb << 20)
        self.supervisors = [ServerSupervisor(s, t) for s, t in zip(self.servers, self.transports)]
        for transport, supervisor in zip(self.transports, self.supervisors):
            transport.supervise = supervisor.call
        self.clients = [RolloutClient.for_server(s, max_concurrency=r.max_concurrency, timeout_s=r.request_timeout_s,
                                                 max_retries=r.max_retries, on_failure=sup)
                        for s, sup in zip(self.servers, self.supervisors)]
        self.client = self.clients[0] if len(self.clients) == 1 else MultiClient(self.clients)

    def sleep_servers(self) -> None:
        """After the rollout, when the recipe asks (rollout.sleep_level): the servers give their
        GPU memory back while the trainer computes log-probs and trains."""
        level = self.cfg.rollout.sleep_level
        if level is None or not self.rank0:
            return
        for server, supervisor in zip(self.servers, self.supervisors):
            supervisor.call(f"sleep (level {level})", server.sleep, level)

    def wake_servers(self) -> None:
        """Collective. Before the weight sync: a level-2 sleep dropped the weights, which the sync
        refills. Every rank first returns its cached-but-free GPU memory: the caching allocator may
        have grown into what the sleep freed, and vLLM's wake_up maps its weights and KV cache back
        into the same GPUs (CUDA OOM otherwise); the barrier keeps rank 0 from waking the servers
        before the other ranks on their GPUs have let go."""
        if self.cfg.rollout.sleep_level is None:
            return
        release_cached_gpu_memory()
        dist.barrier()
        if not self.rank0:
            return
        for server, supervisor in zip(self.servers, self.supervisors):
            supervisor.call("wake-up", server.wake_up)

    def sampling(self) -> SamplingSettings:
        r = self.cfg.rollout
        return SamplingSettings(r.n, r.temperature, r.top_p, r.top_k, r.max_response_length, r.logprobs_mode)

    def reseed_servers(self, step: int) -> None:
        """Each step's sampling seed, derived from the recipe's seed and the step."""
        seed = (self.cfg.trainer.seed * 1_000_003 + step) % (2**31 - 1)
        for server, supervisor in zip(self.servers, self.supervisors):
            supervisor.call("the per-step reseed", server.rpc, "mrl_reseed", str(seed))

    def close(self) -> None:
        for transport in self.transports:
            transport.close()
        for server in self.servers:
            server.stop()                                    # a no-op for external servers
        if self.own_server is not None:
            self.own_server.stop()


def release_cached_gpu_memory() -> bool:
    """Return the caching allocator's free blocks to the driver (a no-op without CUDA)."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return True


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
