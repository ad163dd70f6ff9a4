"""Every patch megatron-core 0.19 needs to run on a machine without CUDA — and nothing else.

Applied once, only when CUDA is absent (`apply()` is a no-op on GPU machines). Each patch names the
symbol it replaces in `PATCHED_SYMBOLS`; `tests/unit/test_cpu_compat.py` fails loudly when one of them
disappears after a megatron-core upgrade, because a silently skipped patch would surface as a
CUDA error deep inside a training step. The measured list is in ../shared/notes/megatron-core-on-cpu.md.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# (module, attribute) pairs that the patches below replace or rely on.
PATCHED_SYMBOLS: tuple[tuple[str, str], ...] = (
    ("megatron.core.transformer.moe.paged_stash", "paged_stash_copy_kernel"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu"),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),
    ("megatron.core.transformer.torch_norm", "WrappedTorchNorm"),
    ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "_set_main_param_and_optimizer_states"),
    # Gated DeltaNet (Qwen3-Next) without FLA: see _patch_gated_delta_net.
    ("megatron.core.ssm.gated_delta_net.common", "HAVE_FLA"),
    ("megatron.core.ssm.gated_delta_net.common", "l2norm"),
    ("megatron.core.ssm.gated_delta_net.gdn", "chunk_gated_delta_rule"),
    ("megatron.core.ssm.gated_delta_net.gdn", "causal_conv1d"),
)
# Methods megatron decorates with `jit_fuser` (`torch.compile`); on CPU they must stay plain Python
# (`_import_megatron_uncompiled`): a first compiled call builds inductor C++ kernels and needs a
# compiler on the machine, measured 15 s of a tiny Qwen3-Next's first forward+backward (0.1 s without).
UNCOMPILED_METHODS: tuple[tuple[str, str], ...] = (
    ("megatron.core.transformer.attention.Attention", "_apply_output_gate"),
    ("megatron.core.ssm.gated_delta_net.GatedDeltaNet", "_prepare_input_for_gated_delta_rule"),
    ("megatron.core.ssm.gated_delta_net.GatedDeltaNet", "_compute_g_and_beta"),
    ("megatron.core.ssm.gated_delta_net.GatedDeltaNet", "_apply_gated_norm"),
)
PATCHED_SYMBOLS += UNCOMPILED_METHODS + (("megatron.core.jit", "disable_jit_fuser"),)
PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"

REQUIRE_CUDA_ENV = "MEGATRON_RL_REQUIRE_CUDA"
"""CUDA devices a process must see; the sbatch script of a GPU job sets it to the GPUs per node.
With it set, `apply()` refuses instead of switching a GPU job silently to the CPU."""

_applied = False


class CudaRequiredError(RuntimeError):
    """GPUs are expected but CUDA does not see them."""


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def cuda_problem(expected: int) -> str | None:
    """Why this process cannot run a job that expects `expected` GPUs (None = it can, or 0 expected)."""
    if expected <= 0:
        return None
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen >= expected:
        return None
    return (f"{expected} GPU(s) per node expected (slurm.gpus_per_node, else parallelism.gpus_per_node) but "
            f"CUDA sees {seen} in this process (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}); refusing to fall "
            "back to the CPU. Give the container the GPUs (apptainer exec --nv, a driver for the image's "
            "CUDA), or for a CPU run set slurm.gpus_per_node=0")


def required_cuda_devices() -> int:
    """$MEGATRON_RL_REQUIRE_CUDA as a count (0 when unset)."""
    text = os.environ.get(REQUIRE_CUDA_ENV, "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise CudaRequiredError(f"${REQUIRE_CUDA_ENV}={text!r}: expected a number of GPUs (0 = none required)")
    return int(text)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements to CPU inside megatron-core's hard-coded factories.

    megatron-core allocates flags and buffers with `device='cuda'`, calls `.cuda()` and asserts
    `grad.type() == 'torch.cuda.FloatTensor'`; one mode covers all of those without editing
    megatron's source. Only calls that mention CUDA are touched.
    """

    def __torch_function__(self, func: Callable, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to,) and args and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if getattr(func, "__self__", None) is torch.Tensor.grad and args and not args[0].is_leaf:
            # The distributed optimizer's zero_grad reads `.grad` of its fp32 shard views (non-leaf);
            # torch answers None and warns, and inside this mode the warning names this file.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _NoStream:
    """Stand-in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # record_event() must return something with synchronize(), so every call chains.
        return lambda *a, **k: _NoStream()

    def __enter__(self) -> _NoStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _stub_triton_kernels() -> None:
    """The paged-stash ops import triton at module level; they are GPU kernels never used on CPU."""
    if PAGED_STASH_OPS in sys.modules:
        return
    stub: Any = types.ModuleType(PAGED_STASH_OPS)   # Any: the kernels' names are set below
    stub.GLOBAL_BLOCK_SIZE = 0

    def _unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("paged-stash triton kernels are not available on CPU")

    stub.paged_stash_copy_kernel = _unavailable
    stub.paged_stash_pop_kernel = _unavailable
    sys.modules[PAGED_STASH_OPS] = stub


def _patch_torch_cuda() -> None:
    cuda: Any = torch.cuda   # Any: the stubs type the real CUDA API that this replaces on purpose
    cuda.current_device = lambda: "cpu"
    cuda.Stream = _NoStream
    cuda.Event = _NoStream
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NoStream()
    cuda.default_stream = lambda *a, **k: _NoStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # The "CUDA" RNG of megatron's tracker becomes the CPU default generator. Not torch.manual_seed:
    # that calls torch.cuda.manual_seed_all, which would recurse into this patch.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state


def _pass_through(model: Any = None, **options: Any) -> Any:
    """`torch.compile` as megatron-core's import meets it on CPU: `@torch.compile` and
    `torch.compile(**options)(fn)` both leave the function as it is."""
    return (lambda fn: fn) if model is None else model


def _import_megatron_uncompiled() -> None:
    """Import megatron-core with its `jit_fuser` (`torch.compile`) a pass-through. Applying
    torch.compile, even before any call, imports dynamo and inductor: 1.6 s of CPU in every process
    that imports megatron-core (trainer, test worker, conversion rank; 2.5 s wall on two busy cores).
    Its package __init__ imports most fused helpers before `megatron.core.jit` could be switched,
    so torch.compile itself is swapped for the import, and megatron-core's own switch covers the
    modules imported later (Gated DeltaNet). The real torch.compile is put back for everyone else."""
    real = torch.compile
    torch.compile = _pass_through
    try:
        jit: Any = importlib.import_module("megatron.core.jit")
        jit.disable_jit_fuser()
    finally:
        torch.compile = real


def _patch_megatron() -> None:
    _import_megatron_uncompiled()
    rnd: Any = importlib.import_module("megatron.core.tensor_parallel.random")
    rnd._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    rnd._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    # With one generator for "CPU" and "CUDA", the tracker's "CPU RNG changed" warning is always true.
    logging.getLogger(rnd.__name__).setLevel(logging.ERROR)

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # The original converts only CUDA tensors, so on CPU split sizes stay tensors and
        # all_to_all_single rejects them.
        if torch.is_tensor(tensor):
            return tensor.numpy() if as_numpy else tensor
        return tensor

    for module in ("megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.token_dispatcher"):
        patched: Any = importlib.import_module(module)
        patched.maybe_move_tensor_to_cpu = move_to_cpu
    _patch_optimizer_state_loading()
    # WrappedTorchNorm asserts against sequence parallelism and zero-centred gamma.
    norm = importlib.import_module("megatron.core.transformer.torch_norm")
    norm.WrappedTorchNorm.__new__ = _wrapped_norm_new
    _patch_gated_delta_net()


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm in torch, as transformers' Qwen3-Next computes it: x · rsqrt(Σx² + ε)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _fla_kernel_unavailable(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("FLA's Triton kernels need CUDA; on CPU build GatedDeltaNet with "
                       "config.deterministic_mode=True (torch delta rule and F.conv1d)")


def _patch_gated_delta_net() -> None:
    """GatedDeltaNet refuses to construct without FLA, although with `deterministic_mode` its
    forward uses only torch (the chunked delta rule and F.conv1d) plus FLA's l2norm, given here in
    torch. The FLA kernels it would otherwise call raise a clear error instead of calling None."""
    common: Any = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
    gdn: Any = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    common.HAVE_FLA = True
    common.l2norm = l2norm
    gdn.chunk_gated_delta_rule = _fla_kernel_unavailable
    gdn.causal_conv1d = _fla_kernel_unavailable


class LocalRMSNorm(torch.nn.Module):
    """RMSNorm for the local (non-TE) spec, with what WrappedTorchNorm refuses on CPU.

    Sequence parallelism: the weight is tagged `sequence_parallel` so that megatron all-reduces
    its gradient over TP (each rank only saw its slice of the sequence). Zero-centred gamma
    (Qwen3-Next): y = x̂ · (1 + w), w initialised to 0.
    """

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, zero_centered: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
        weight: Any = self.weight   # Any: the tag is megatron-core's, not in torch's Parameter type
        weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        gamma = (1.0 + self.weight.float()) if self.zero_centered else self.weight.float()
        return (normed * gamma).to(dtype)


def _wrapped_norm_new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any,
                      **kwargs: Any) -> torch.nn.Module:
    if config.normalization != "RMSNorm":
        raise NotImplementedError(f"CPU local spec supports RMSNorm only, not {config.normalization}")
    return LocalRMSNorm(hidden_size, eps, bool(config.sequence_parallel),
                        bool(config.layernorm_zero_centered_gamma), config.params_dtype)


class _MissingIsNone(dict):
    def __missing__(self, key: str) -> None:
        return None


def _patch_optimizer_state_loading() -> None:
    """torch.optim.Adam (used without TE/apex) keeps a per-parameter `step` tensor that the
    fully-reshardable loader does not ship (it restores `step` separately) and then looks up;
    a missing entry must mean "skip", as it does for non-tensor entries."""
    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    cls = module.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict) -> Any:
        return original(self, model_param, _MissingIsNone(tensors))

    cls._set_main_param_and_optimizer_states = set_states


def check_patched_symbols() -> list[str]:
    """Names in PATCHED_SYMBOLS that no longer exist upstream (empty = all present).

    Entries are (module, attribute) or ("package.module.Class", attribute).
    """
    missing = []
    for target, attr in PATCHED_SYMBOLS:
        module, owner_name = target, None
        if target.rsplit(".", 1)[-1][:1].isupper():
            module, owner_name = target.rsplit(".", 1)
        try:
            owner = importlib.import_module(module)
            if owner_name is not None:
                owner = getattr(owner, owner_name)
            if not hasattr(owner, attr):
                missing.append(f"{target}.{attr}")
        except (ImportError, AttributeError) as exc:
            missing.append(f"{target} ({exc})")
    return missing


def require_applied() -> None:
    """Called by the modules that import megatron-core: without CUDA, megatron-core cannot even be
    imported unpatched (its MoE ops import triton), and patching torch.cuda is process-wide, so it
    is the entry point's explicit decision, never a side effect of importing a provider."""
    if cuda_absent() and not _applied:
        raise ImportError("megatron-core on a machine without CUDA needs the CPU patches: call "
                          "megatron_rl.megatron.cpu_compat.apply() at the entry point, before importing "
                          "megatron_rl.megatron / megatron_rl.weights modules that use megatron-core")


def apply() -> bool:
    """Patch torch.cuda and megatron-core for CPU (a no-op with CUDA); the entry points (CLI
    commands, conversion and test workers) call it before importing megatron-core.
    Returns True when patches were applied.

    Raises CudaRequiredError instead when $MEGATRON_RL_REQUIRE_CUDA asks for more devices than
    CUDA sees (a GPU job whose container cannot see the GPUs must not train on the CPU)."""
    global _applied
    if _applied:
        return True
    problem = cuda_problem(required_cuda_devices())
    if problem:
        raise CudaRequiredError(problem)
    if not cuda_absent():
        return False
    _stub_triton_kernels()
    _patch_torch_cuda()
    _patch_megatron()
    _CudaToCpu().__enter__()   # process-wide: megatron allocates on "cuda" everywhere
    _applied = True
    return True
