"""The GPUs the performance model prices for: datasheet figures only, no fitted constant.

Sources: NVIDIA H100 Tensor Core GPU datasheet and the Hopper architecture whitepaper (SXM5: 132 SMs,
989.4 dense bf16 TFLOP/s, 66.9 fp32 TFLOP/s, 3.35 TB/s HBM3, 50 MB L2, 228 KB shared memory and 64K
32-bit registers per SM, 64 warps and 32 blocks per SM); H200 datasheet (the same GH100 die and clocks,
4.8 TB/s HBM3e). Per-SM issue rates per clock are the CUDA C++ Programming Guide's arithmetic-instruction
throughput table for compute capability 9.0 (32-bit FP add/mul/FMA: 128 lanes; exp2, reciprocal and
other MUFU work: 16; conversions to narrower types: 16; 32-bit integer add: 64) and 32 lanes of
load/store units per SM.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU's datasheet: counts, rates and capacities. Rates are per SM per clock unless named."""

    name: str
    capability: int  # compute capability, as triton's GPUTarget takes it
    sms: int
    clock_hz: float  # the clock at which the dense tensor peak is quoted
    tensor_flops_per_clock: int  # dense bf16 FLOPs per SM per clock (wgmma)
    lanes: dict[str, int]  # per SM per clock, by unit: fp32, sfu, cvt, int, lsu
    hbm_bytes_per_s: float
    l2_bytes: int
    smem_per_sm: int
    regs_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    memory_bytes: int

    @property
    def bf16_peak(self) -> float:
        """Dense bf16 tensor FLOP/s."""
        return self.sms * self.tensor_flops_per_clock * self.clock_hz

    @property
    def fp32_peak(self) -> float:
        """fp32 FMA FLOP/s on the CUDA cores."""
        return self.sms * self.lanes["fp32"] * 2 * self.clock_hz


_LANES_SM90 = {"fp32": 128, "sfu": 16, "cvt": 16, "int": 64, "lsu": 32}

H100 = Gpu("h100", 90, 132, 1.83e9, 4096, _LANES_SM90, 3.35e12, 50 * 2**20, 228 * 1024, 65_536, 64, 32, 80 * 2**30)
H200 = dataclasses.replace(H100, name="h200", hbm_bytes_per_s=4.8e12, memory_bytes=141 * 10**9)
GPUS = {g.name: g for g in (H100, H200)}


def gpu(name: str) -> Gpu:
    """The GPU called ``name`` (h100, h200)."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; expected one of {sorted(GPUS)}")
    return GPUS[name]
