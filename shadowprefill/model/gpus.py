"""GPU catalog for the latency model (paper appendix B: "grounded in measurements on H100 GPUs").

Peak numbers are the vendors' data-sheet values for the SXM parts (dense, no sparsity):

- H100 SXM5 80GB: 989.4 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s bidirectional (450 GB/s each way),
  700 W TDP, PCIe Gen5 x16.
- H200 SXM 141GB: same compute die as H100, 4.8 TB/s HBM3e, same NVLink, 700 W TDP.
- A100 SXM4 80GB: 312 TFLOP/s bf16, 2.039 TB/s HBM2e, NVLink 3 600 GB/s bidirectional (300 each way),
  400 W TDP, PCIe Gen4 x16.

`hbm_bytes` is the decimal capacity the paper's TP rule uses ("weights take at most half the HBM":
80 GB → 40e9 bytes per GPU). `pcie_bw` is a practical host↔device rate (about 80% of the link's nominal
per-direction rate), used for the host spill tier. Power numbers are assumptions for the energy proxy:
`busy_w` ≈ 80% of TDP (inference rarely sits at TDP), `idle_w` ≈ an idle SXM module under nvidia-smi.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: peaks (FLOP/s, bytes/s), memory (bytes) and power (W)."""

    name: str
    peak_flops: float      # dense bf16 FLOP/s
    hbm_bw: float          # HBM bytes/s
    nvlink_bw: float       # NVLink bytes/s per GPU, one direction
    hbm_bytes: float       # HBM capacity, bytes
    pcie_bw: float         # practical host<->device bytes/s, one direction
    tdp_w: float
    busy_w: float          # average draw while running iterations (energy proxy)
    idle_w: float          # draw while idle

    def __post_init__(self) -> None:
        for field in ("peak_flops", "hbm_bw", "nvlink_bw", "hbm_bytes", "pcie_bw", "tdp_w", "busy_w", "idle_w"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"GPUSpec.{field} must be a positive number, got {value!r}")


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("h100", peak_flops=989.4e12, hbm_bw=3.35e12, nvlink_bw=450e9, hbm_bytes=80e9,
                    pcie_bw=50e9, tdp_w=700.0, busy_w=560.0, idle_w=75.0),
    "h200": GPUSpec("h200", peak_flops=989.4e12, hbm_bw=4.8e12, nvlink_bw=450e9, hbm_bytes=141e9,
                    pcie_bw=50e9, tdp_w=700.0, busy_w=560.0, idle_w=75.0),
    "a100": GPUSpec("a100", peak_flops=312e12, hbm_bw=2.039e12, nvlink_bw=300e9, hbm_bytes=80e9,
                    pcie_bw=25e9, tdp_w=400.0, busy_w=320.0, idle_w=55.0),
}


def get_gpu(gpu: "str | GPUSpec") -> GPUSpec:
    """A `GPUSpec` from a catalog name ("h100", "h200", "a100", case-insensitive) or a spec itself."""
    if isinstance(gpu, GPUSpec):
        return gpu
    if not isinstance(gpu, str):
        raise TypeError(f"gpu must be a name or a GPUSpec, got {type(gpu).__name__}")
    key = gpu.lower()
    if key not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; known: {sorted(GPUS)}")
    return GPUS[key]
