"""One table of constants per GPU type, and the node and site constants the time model reads.

Hardware figures are the vendors' data sheets for the SXM parts in DGX/HGX 8-GPU nodes: dense bf16
tensor throughput (no sparsity), HBM bandwidth, NVLink bandwidth per direction per GPU, one
InfiniBand NIC per GPU, PCIe host link per GPU (the achievable ~80 % of the link's 64 GB/s (Gen5) or
32 GB/s (Gen4) per direction), and the host's memory bandwidth per node (two sockets; ~65 % of the
DDR channels' peak, what STREAM reaches).

Two efficiencies are stated, not fitted per run (one value for every GPU type and model):

* `train_mfu` 0.15 — model FLOPs / (peak × time) of Megatron training of these MoE models, with
  their expert all-to-all, TP collectives and kernel overheads inside it. NVIDIA's Megatron-Bridge
  performance summary (docs/performance-summary-archive.md, 25.09–26.06 containers) publishes
  pretraining of Qwen3-235B-A22B at 178–253 and of Qwen3-30B-A3B at 118–241 model TFLOP/s per H100
  (12–26 % of the 989 TFLOP/s bf16 peak), with FP8 GEMMs and routing force-balanced over the
  experts; RL trains in bf16, dropless, with the routing the model chooses (hot experts make the
  all-to-all wait), so below their middle (0.20): 0.15. A100 has no published MoE figure; B200's
  (416–633 TFLOP/s of 2,250: 18–28 %) is the same share.
* `decode_efficiency` 0.40 — the fraction of HBM bandwidth a memory-bound decode step reaches:
  fused-MoE expert GEMMs on a few tokens per expert, paged attention, norms, the sampler and the
  gaps between kernels (a plain copy reaches ~90 % of peak, a dense GEMV 70–80 %).

The same MFU serves prefill and decode compute (the same expert GEMMs). Per-step host overhead and
collective latencies are the last constants: vLLM's scheduler and sampler per decode step with
CUDA graphs (~2 ms), and NCCL small-message all-reduce latencies (~10 µs inside a node over NVLink;
~50 µs across nodes: a reduce over NVLink, one InfiniBand exchange, a broadcast over NVLink).
How these were chosen, and the first choice (0.20 / 0.50 / 30 µs) that predicted the published
runs 26–31 % fast, is in tests/unit/test_planner_time.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .params import PlannerError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gb: float
    """HBM in decimal GB as sold (the memory model's default capacity)."""
    bf16_tflops: float
    hbm_tb_s: float
    nvlink_gb_s: float
    """Per GPU, per direction."""
    ib_gb_s: float
    """One NIC per GPU, per direction."""
    pcie_gb_s: float
    """Achievable host↔device copy rate per GPU, per direction."""
    host_memory_bw_gb_s: float
    """One node's host memory bandwidth (CPU Adam, page copies)."""
    host_memory_gb: float
    """The RAM of this generation's DGX node (`plan --host-memory-gb` default)."""
    vllm_max_num_seqs: int
    """vLLM's default `max_num_seqs` per engine on this card (vllm/engine/arg_utils.py: 1024 on
    >= 70 GiB cards but A100, else 256)."""
    train_mfu: float = 0.15
    decode_efficiency: float = 0.40

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tb_s * 1e12


GPUS: dict[str, GpuSpec] = {
    # DGX H100: 8 × H100 SXM 80 GB, NVLink 4 (900 GB/s bidirectional), 8 × ConnectX-7 400 Gb/s,
    # 2 × Xeon 8480C with 2 TB DDR5-4800 (16 channels: 614 GB/s peak).
    "H100": GpuSpec("H100", 80.0, 989.0, 3.35, 450.0, 50.0, 50.0, 400.0, 2048.0, 1024),
    # DGX H200: the H100's compute and links, 141 GB of HBM3e at 4.8 TB/s.
    "H200": GpuSpec("H200", 141.0, 989.0, 4.8, 450.0, 50.0, 50.0, 400.0, 2048.0, 1024),
    # DGX A100 (80 GB): 312 TFLOP/s bf16, 2.04 TB/s, NVLink 3 (600 GB/s bidirectional), 8 × HDR
    # 200 Gb/s, PCIe Gen4, 2 × EPYC 7742 with 1 TB DDR4-3200 (16 channels: 410 GB/s peak).
    "A100": GpuSpec("A100", 80.0, 312.0, 2.039, 300.0, 25.0, 25.0, 265.0, 1024.0, 256),
    # DGX B200: 2.25 PFLOP/s dense bf16 (4.5 with sparsity), 180 GB HBM3e at 8 TB/s, NVLink 5
    # (1.8 TB/s bidirectional), 8 × ConnectX-7 400 Gb/s, 2 × Xeon 8570
    # with 2 TB DDR5-5600 (16 channels: 717 GB/s peak).
    "B200": GpuSpec("B200", 180.0, 2250.0, 8.0, 900.0, 50.0, 50.0, 465.0, 2048.0, 1024),
}
DEFAULT_GPU = "H100"
"""`plan --gpu`'s default (the literal in commands/plan.py; checked in tests/unit/test_planner_time.py)."""

HOST_STEP_OVERHEAD_S = 2e-3
"""vLLM's per-decode-step scheduling and sampling with CUDA graphs (V1 engine)."""
NVLINK_LATENCY_S = 10e-6
IB_LATENCY_S = 50e-6
SHARED_FS_GB_S = 10.0
"""A parallel file system client's read or write rate on one node (Lustre/GPFS over one 400 Gb/s
link reaches 10–20 GB/s; the lower end): the `shm` transport's route to servers on other nodes.
Assumed, not measured: no production-cluster measurement exists yet, and none can be taken on the
dev VM (no parallel file system). /dev/shm writes are modelled at the PCIe rate; one Python writer
of 1 GiB (256 MiB writes, fresh pages) on the shared 2-core dev VM measured 0.8-1.5 GB/s
(2026-12-03, 3 runs under load; 2.7 GB/s quiet before), not a production node."""


def gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.upper()]
    except KeyError:
        raise PlannerError(f"unknown GPU type {name!r}; the planner knows: {', '.join(GPUS)}") from None
