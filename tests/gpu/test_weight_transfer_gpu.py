"""vLLM's GPU weight-transfer engines driven by the trainer's transports (`rollout.weight_transfer`
nccl and ipc; sync/gpu.py): new weights sent from `cuda:0` reach a real vLLM server on
the GPU, and its log-probs then equal transformers' float64 log-probs of those weights (fp32 on
both sides, TF32 off for the run and the server as tests/gpu/conftest.py sets it; 2e-3 of margin). `nccl` needs a
second GPU (NCCL refuses two ranks on one device; one GPU skips it): the server runs on GPU 1.
`ipc` shares the trainer's GPU 0 with the server.

Run inside the container image on a GPU node (README, "Weight sync"):
    apptainer exec --nv --pwd /opt/megatron-rl megatron-rl.sif \
        python -m pytest -m gpu tests/gpu/test_weight_transfer_gpu.py -v
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.sync import gpu, make_transport
from megatron_rl.sync.gpu import NcclTransport
from megatron_rl.weights.hf_io import HFCheckpointReader
from tests.helpers.gpu import require
from tests.helpers.models import TINY_MOE
from tests.helpers.rollout import start_server, tiny_model_with_tokenizer

pytestmark = pytest.mark.gpu
TOLERANCE = 2e-3


def _hf_logprobs(model_dir: Path, state: dict[str, torch.Tensor], sequences: list[list[int]]) -> list[torch.Tensor]:
    from tests.helpers.rollout import _hf_logprobs as hf_logprobs

    return hf_logprobs(state, sequences, model_dir.parent / "reference", str(model_dir))


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_gpu_backend_syncs_new_weights_into_a_cuda_server(backend: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    require("vllm", why="a vLLM server on the GPU")
    if backend == "nccl":
        if torch.cuda.device_count() < 2:
            pytest.skip("the nccl test needs 2 GPUs (NCCL refuses two ranks on one device)")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")     # the server's environment only
    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model", seed=4)
    reader = HFCheckpointReader(str(model))
    g = torch.Generator().manual_seed(7)
    new = {n: reader.get(n) + 0.05 * torch.randn(reader.get(n).shape, generator=g) for n in reader.names()}
    sequences = [[5, 9, 17, 33, 65, 3, 7, 11, 13, 19], [2, 4, 8, 16, 32, 64, 128, 200, 100, 50]]
    expected = _hf_logprobs(model, new, sequences)
    server = start_server(model, tmp_path / "run", gpu_memory_utilization=0.3, weight_transfer=backend)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    device = torch.device("cuda", 0)
    transport, links = make_transport(backend, [server], None, 64 << 20, device)   # type: ignore[arg-type]
    try:
        transport.begin(1)
        names = sorted(new)
        for start in range(0, len(names), 7):           # a few tensors per hand-over, like layer parts
            transport.send_bucket({n: new[n].to(device) for n in names[start:start + 7]})
        result = transport.finish(names)
        assert result["version"] == 1 and result["tensors"] == len(names), result
        assert server.rpc("mrl_weight_version") == ["1"]
        got = RolloutClient.for_server(server).prompt_logprobs(sequences)
        worst = max((torch.tensor(a, dtype=torch.float64) - b).abs().max().item() for a, b in zip(got, expected))
        assert worst <= TOLERANCE, worst
    finally:
        for link in links:
            link.close()
        server.stop()


def test_nccl_delta_round_patches_a_cuda_server_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nccl` with delta (`NcclTransport`, the server's `mrl_nccl` engine): a whole round, then one
    whose patches (2 % of each tensor's elements, as `sync._sync_by_owners` makes them with one
    owner) go in vLLM's sparse_nccl format and are applied in place; the server's log-probs are
    then those of the second version. The bucket is small, so each round goes in several updates
    (a sparse round's later ones without the refusal wait); the server runs vLLM's Triton MoE
    kernels, which keep the experts in the layout the patches address."""
    require("vllm", why="a vLLM server on the GPU")
    if torch.cuda.device_count() < 2:
        pytest.skip("the nccl test needs 2 GPUs (NCCL refuses two ranks on one device)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")     # the server's environment only
    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model", seed=4)
    reader = HFCheckpointReader(str(model))
    g = torch.Generator().manual_seed(8)
    v1 = {n: reader.get(n) + 0.05 * torch.randn(reader.get(n).shape, generator=g) for n in reader.names()}
    v2 = {}
    for n, t in v1.items():
        flat = t.clone().reshape(-1)
        hit = torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 50)]
        flat[hit] += 0.2
        v2[n] = flat.reshape(t.shape)
    sequences = [[5, 9, 17, 33, 65, 3, 7, 11, 13, 19], [2, 4, 8, 16, 32, 64, 128, 200, 100, 50]]
    expected = _hf_logprobs(model, v2, sequences)
    server = start_server(model, tmp_path / "run", gpu_memory_utilization=0.3, weight_transfer="nccl")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    device = torch.device("cuda", 0)
    cmd = server.command()
    assert cmd[cmd.index("--moe-backend") + 1] == "triton"
    transport, links = make_transport("nccl", [server], None, 4 << 10, device, delta="on")
    assert isinstance(transport, NcclTransport) and transport.owners is not None
    owners = transport.owners
    rounds: list[int] = []
    broadcast_patches = gpu.broadcast_patches
    monkeypatch.setattr(gpu, "broadcast_patches",
                        lambda comm, patches, dev: (rounds.append(len(patches)), broadcast_patches(comm, patches, dev)))
    names = sorted(v1)
    try:
        for version, state in ((1, v1), (2, v2)):
            delta = transport.wants_delta()
            assert delta == (version == 2)
            owners.begin()
            transport.begin(version, delta=delta)
            for start in range(0, len(names), 7):
                part = {n: state[n].to(device) for n in names[start:start + 7]}
                if delta:
                    transport.send_patches(owners.patches(part, torch.float32))
                else:
                    transport.send_bucket(owners.keep(part, torch.float32))
            result = transport.finish(None if delta else names)
            assert result["version"] == version, result
        assert transport.stats.report()["dense"] == 0
        assert len(rounds) > 1 and sum(rounds) == len(names), rounds
        got = RolloutClient.for_server(server).prompt_logprobs(sequences)
        worst = max((torch.tensor(a, dtype=torch.float64) - b).abs().max().item() for a, b in zip(got, expected))
        assert worst <= TOLERANCE, worst
    finally:
        for link in links:
            link.close()
        server.stop()
