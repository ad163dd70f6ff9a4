"""The diagnosis of a failed verification gate, its pure parts: every HF name of every weight map
(tiny and production configs of both architectures) has a tensor family; the checksum both sides
compute is exact (a big-integer reference), the same in any chunking, and moves with the bytes;
the comparison names what differs and how; the sender's digests are of the bytes a real `shm`
transport writes; a worker records each tensor before `load_weights` can change it. The whole
diagnosis against a real vLLM server: tests/integration/test_verification_calibration.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.models import weight_map
from megatron_rl.rollout.engines import digest
from megatron_rl.rollout.engines.digest import A, Digest, P, tensor_digest
from megatron_rl.sync.diagnose import Diagnosis, DigestingTransport, compare
from megatron_rl.sync.shm import SharedSegmentTransport
from megatron_rl.weights.families import OTHER, by_family, family
from tests.helpers.models import DENSE_TIED, TINY_DENSE, TINY_MOE, TINY_QWEN3_NEXT
from tests.mp.launch import REPO
from tests.unit.test_sync_shm import EngineRecorder

ATTENTION = {f"attention {p}_proj" for p in "qkvo"} | {"attention q/k norms"}
COMMON = {"embeddings", "final norm", "layer norms"} | ATTENTION
EXPERTS = {"router"} | {f"expert {p}_proj" for p in ("gate", "up", "down")}
MLP = {f"MLP {p}_proj" for p in ("gate", "up", "down")}
GDN = {f"Gated DeltaNet {p}" for p in ("in_proj_qkvz", "in_proj_ba", "out_proj", "conv1d", "A_log", "dt_bias",
                                        "norm")}
SHARED = {f"shared expert {p}_proj" for p in ("gate", "up", "down")} | {"shared expert gate"}
PRODUCTION = {p.parent.name: json.loads(p.read_text()) for p in sorted((REPO / "recipes/models").glob("*/config.json"))}
CONFIGS: dict[str, tuple[dict[str, Any], set[str]]] = {
    "tiny_moe": (TINY_MOE, COMMON | EXPERTS | {"lm_head"}),
    "tiny_dense": (TINY_DENSE, COMMON | MLP | {"lm_head"}),
    "dense_tied": (DENSE_TIED, COMMON | MLP),
    "tiny_qwen3_next": (TINY_QWEN3_NEXT, COMMON | EXPERTS | MLP | GDN | SHARED | {"lm_head"}),
    "qwen3_30b_a3b": (PRODUCTION["qwen3_30b_a3b"], COMMON | EXPERTS | {"lm_head"}),
    "qwen3_235b_a22b": (PRODUCTION["qwen3_235b_a22b"], COMMON | EXPERTS | {"lm_head"}),
    "qwen3_next_80b_a3b": (PRODUCTION["qwen3_next_80b_a3b"], COMMON | EXPERTS | GDN | SHARED | {"lm_head"}),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_name_of_every_weight_map_has_its_family(config: str) -> None:
    hf, expected = CONFIGS[config]
    names = weight_map(hf).hf_names()
    groups = by_family(names)
    assert OTHER not in groups, groups.get(OTHER, [])[:5]
    assert set(groups) == expected
    assert sum(len(v) for v in groups.values()) == len(names)


@pytest.mark.parametrize(("name", "expected"), [
    ("model.layers.1.self_attn.o_proj.weight", "attention o_proj"),
    ("model.layers.7.self_attn.q_proj.weight", "attention q_proj"),
    ("model.layers.0.mlp.experts.1.down_proj.weight", "expert down_proj"),
    ("model.layers.12.mlp.experts.511.gate_proj.weight", "expert gate_proj"),
    ("model.layers.3.mlp.gate.weight", "router"),
    ("model.layers.3.mlp.gate_proj.weight", "MLP gate_proj"),
    ("model.layers.3.mlp.shared_expert_gate.weight", "shared expert gate"),
    ("model.layers.3.mlp.shared_expert.up_proj.weight", "shared expert up_proj"),
    ("model.layers.2.linear_attn.in_proj_qkvz.weight", "Gated DeltaNet in_proj_qkvz"),
    ("model.layers.2.linear_attn.A_log", "Gated DeltaNet A_log"),
    ("model.layers.2.linear_attn.norm.weight", "Gated DeltaNet norm"),
    ("model.layers.2.post_attention_layernorm.weight", "layer norms"),
    ("model.norm.weight", "final norm"),
    ("model.embed_tokens.weight", "embeddings"),
    ("lm_head.weight", "lm_head"),
    ("mtp.layers.0.self_attn.o_proj.weight", OTHER),      # dropped on import, never synced
    ("model.layers.2.mlp.experts.w13_weight", OTHER),       # vLLM's fused name is not an HF name
])
def test_family_of_a_name(name: str, expected: str) -> None:
    assert family(name) == expected


def _reference_checksum(t: torch.Tensor) -> int:
    """Σ bᵢ·((A·i mod P) + 1) mod P over the bytes, in Python's exact integers."""
    data = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    return sum(b * ((A * i) % P + 1) for i, b in enumerate(data)) % P


def test_checksum_matches_exact_integer_reference_in_any_chunking() -> None:
    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(7, 13, generator=g).to(torch.bfloat16), torch.randn(5, 9, generator=g),
              torch.randint(0, 255, (3, 11), generator=g, dtype=torch.uint8), torch.tensor(2.5)):
        whole = tensor_digest(t)
        assert whole.checksum == _reference_checksum(t), t.dtype
        for chunk in (1, 3, 64):                              # chunks of 1 element up to several
            assert tensor_digest(t, chunk_bytes=chunk) == whole, (t.dtype, chunk)
        assert whole.sumsq == pytest.approx(float(t.double().square().sum()), rel=1e-12)


def test_checksum_moves_with_the_bytes_and_sum_of_squares_with_the_values() -> None:
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    d = tensor_digest(t)
    assert tensor_digest(t.t().contiguous().t()) == d          # another stride, the same row-major bytes
    swapped = tensor_digest(torch.cat(t.chunk(2, dim=0)[::-1]))
    assert swapped.checksum != d.checksum and swapped.sumsq == pytest.approx(d.sumsq, rel=1e-12)
    flipped = t.clone()
    flipped.view(torch.int16).view(-1)[100] ^= 1               # one bit of one element
    assert tensor_digest(flipped).checksum != d.checksum
    assert tensor_digest(t.float()).dtype == "float32" != d.dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checksum_on_a_gpu_equals_the_cpu_one() -> None:
    t = torch.randn(3000, 517, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    cpu, gpu = tensor_digest(t, chunk_bytes=1 << 16), tensor_digest(t.cuda())
    assert gpu.checksum == cpu.checksum and gpu.sumsq == pytest.approx(cpu.sumsq, rel=1e-12)
    staged = tensor_digest(t, chunk_bytes=1 << 16, device=torch.device("cuda"))   # host tensor, hashed on the GPU
    assert staged.checksum == cpu.checksum and staged.sumsq == pytest.approx(cpu.sumsq, rel=1e-12)


def test_checksum_on_another_device_than_the_tensor_is_the_same() -> None:
    t = torch.randn(300, 17, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert tensor_digest(t, chunk_bytes=1 << 10, device=torch.device("cpu")) == tensor_digest(t)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    names = ["model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight",
             "model.layers.0.mlp.experts.2.down_proj.weight", "model.norm.weight"]
    return {n: torch.randn(8, 6, generator=g).to(torch.bfloat16) for n in names}


def test_compare_names_families_tensors_and_how_they_differ() -> None:
    tensors = _tensors()
    sent = {n: tensor_digest(t) for n, t in tensors.items()}
    o, e1, e2, norm = tensors
    good = {n: list(d) for n, d in sent.items()}                         # as /collective_rpc returns it
    bad = dict(good)
    bad[o] = list(tensor_digest(torch.cat(tensors[o].chunk(2)[::-1])))  # rows moved
    bad[e1] = list(tensor_digest(tensors[e1] * 2))                       # other values
    del bad[norm]
    result = compare(sent, [("http://a", [good, bad])])                  # two workers, the second wrong
    assert result.workers == ["http://a worker 0", "http://a worker 1"]
    assert result.families() == {"attention o_proj": [o], "expert down_proj": [e1], "final norm": [norm]}
    assert "layout or shard-order" in next(iter(result.differ[o]))
    why = f"other values (sum of squares {sent[e1].sumsq:.6g} sent, {4 * sent[e1].sumsq:.6g} received)"
    assert result.differ[e1] == {why: ["http://a worker 1"]}
    message = result.message()
    for text in ("3 of 4 tensors", "attention o_proj (1 tensor: " + o, "expert down_proj (1 tensor: " + e1,
                 "sent, never received, on http://a worker 1", "final norm"):
        assert text in message, (text, message)
    assert e2 not in message


def test_all_match_says_so_and_a_failed_diagnosis_says_why() -> None:
    sent = {n: tensor_digest(t) for n, t in _tensors().items()}
    same = compare(sent, [("http://a", [{n: list(d) for n, d in sent.items()}]), ("http://b", [])])
    assert not same.differ and same.families() == {}
    assert "all 4 tensors that the 1 vLLM worker received match" in same.message()
    assert "kernels or the load path" in same.message()
    assert "no vLLM worker" in compare(sent, []).message()
    assert "not available (the re-sync failed: boom)" in Diagnosis(error="the re-sync failed: boom").message()
    many = compare(sent, [("s", [{}])])
    assert "and 0 more" not in many.message() and "4 of 4 tensors" in many.message()


def test_sender_digests_are_of_the_bytes_the_shm_transport_writes(tmp_path: Path) -> None:
    tensors = _tensors()
    server = EngineRecorder()                      # decodes each update from the segment files' bytes
    inner = SharedSegmentTransport([server], tmp_path, segment_bytes=200)      # several segments
    recorder = DigestingTransport(inner)
    recorder.begin(3)
    recorder.send_bucket(dict(list(tensors.items())[:2]))
    recorder.send_bucket(dict(list(tensors.items())[2:]))
    assert recorder.finish(list(tensors))["version"] == 3
    assert len(server.manifests[-1]["segments"]) > 1
    assert {n: tensor_digest(t) for n, t in server.loaded.items()} == recorder.digests
    assert list(recorder.digests) == list(tensors)
    inner.close()


def test_a_checksum_that_fails_on_the_trainer_still_hands_the_part_on(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A node sender waits for every part's broadcast: a part held back by a failed checksum (out
    of GPU memory beside vLLM) would hang the re-send; it goes on, and the diagnosis says why not."""
    from megatron_rl.sync import diagnose

    tensors = _tensors()
    server = EngineRecorder()
    inner = SharedSegmentTransport([server], tmp_path, segment_bytes=200)
    recorder = DigestingTransport(inner)

    def out_of_memory(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(diagnose, "tensor_digest", out_of_memory)
    recorder.begin(4)
    recorder.send_bucket(tensors)
    assert recorder.finish(list(tensors))["version"] == 4 and set(server.loaded) == set(tensors)   # all sent
    assert recorder.error is not None and "out of memory" in recorder.error
    assert "not available (checksumming" in diagnose._collect(recorder, [], None).message()
    inner.close()


class _Model(torch.nn.Module):
    """Loads like vLLM's packed consumer: reads each tensor, then reuses its buffer (zeroes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> set[str]:
        for name, t in weights:
            self.loaded[name] = t.clone()
            t.zero_()
        return set(self.loaded)


def test_a_worker_records_each_tensor_before_the_load_and_only_when_armed() -> None:
    tensors = _tensors()
    model = _Model()
    with digest.loads_recorded(model):                                    # not armed: nothing
        model.load_weights([(n, t.clone()) for n, t in tensors.items()])
    assert "load_weights" not in model.__dict__ and digest.take() == {}
    digest.arm()
    with digest.loads_recorded(model):
        assert model.load_weights([(n, t.clone()) for n, t in tensors.items()]) == set(tensors)
    assert "load_weights" not in model.__dict__                           # the class's method again
    recorded = digest.take()
    assert recorded == {n: tensor_digest(t) for n, t in tensors.items()}
    assert all(isinstance(d, Digest) for d in recorded.values())
    assert digest.RECEIVED["armed"] is False and digest.take() == {}      # take disarms
