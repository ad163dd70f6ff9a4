"""A stand-in rollout server for transport tests: it answers the weight-transfer routes as a
server with the `mrl_shm` engine does, decoding each update from the files its manifest names
through the engine's own decoder, and remembers what it loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_rl.rollout.engines.digest import tensor_digest
from megatron_rl.rollout.engines.loaded import views


class Server:
    """One server: `loaded` is what its last update held, `segments` the files it read."""

    def __init__(self, name: str) -> None:
        self.base_url, self.token, self.restarts = f"http://{name}", "t", 0
        self.loaded: dict[str, torch.Tensor] = {}
        self.segments: list[str] = []
        self.version = 0

    def post(self, path: str, body: Any = None, params: Any = None, timeout: float = 600.0) -> None:
        if path == "/update_weights":
            info = body["update_info"]
            self.segments = [p for p, _ in info["segments"]]
            data = [torch.frombuffer(bytearray(Path(p).read_bytes()[:size]), dtype=torch.uint8)
                    for p, size in info["segments"]]
            self.loaded = {name: t.clone() for name, t in views(info["tensors"], data)}
            self.version = info["version"]

    def rpc(self, method: str, *args: str, timeout: float = 600.0) -> list[Any]:
        if method == "mrl_digests":          # the diagnosis: what was loaded, as a worker digests it
            return [{name: list(tensor_digest(t)) for name, t in self.loaded.items()}]
        return [{"version": self.version, "tensors": len(self.loaded)}]
