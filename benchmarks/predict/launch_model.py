"""The price of one Triton launch on a GPU, from what it compiled to.

Per launch (`LaunchCost`, constants aside): the programs, warps and occupancy (programs resident per SM
from registers, shared memory, warps and the block limit), the work of one program by unit
(benchmarks.predict.sass.Program) and the bytes it moves: HBM (each tensor argument the kernel touches,
once: re-reads hit the 50 MB L2; but no more than its loads and stores request in all, when the SASS counts
them all, for a launch that covers a part of its tensors, as one phase of a long sequence does) and L2
(every byte its load and store instructions request).

With the fitted constants (`Constants`), a full SM of c resident programs takes the longest of:
- each unit's work over its rate (tensor FLOPs at the bf16 rate, HMMA at `hmma_efficiency` of it, TF32
  at half; FP32, SFU, conversion, integer and load/store warp instructions at the datasheet lanes per
  clock; shared bytes at 128 B per clock; every instruction through the 4 issue slots);
- one warp's dependent path: `cycles_per_instruction` per instruction it issues, plus
  `load_latency_cycles` per iteration of an outermost loop that waits on its own loads (synchronous
  loads, not prefetched by the compiler's software pipelining: benchmarks.predict.sass).
The launch takes its waves of programs over the SMs (the last wave partly filled), but no less than
its HBM bytes at `hbm_efficiency` of the peak, or its L2 bytes at the L2 rate, plus `launch_seconds`.
A sequence of launches takes the longer of the device's time and the host's time to issue them
(`host_seconds_per_launch` per Triton launch, through triton's Python launcher and the caller's code;
benchmarks.predict.price.ATEN_HOST_SECONDS per aten op): the GPU idles when the host falls behind.
"""

from __future__ import annotations

import dataclasses
import math

from benchmarks.predict.capture import Launch
from benchmarks.predict.gpu import Gpu
from benchmarks.predict.sass import BULK_COPIES, Binary, Program, compile_launch, loop_trips, program_work

L2_BYTES_PER_CLOCK_PER_SM = 64  # H100 L2 read bandwidth, ~5.5 TB/s measured by Chips and Cheese (2023)
SHARED_BYTES_PER_CLOCK = 128  # per SM: 32 banks x 4 bytes
ISSUE_SLOTS = 4  # warp schedulers per SM, one instruction per clock each
_RATE = {"fp32": "fp32", "sfu": "sfu", "cvt": "cvt", "int": "int", "global": "lsu", "shared": "lsu", "local": "lsu"}


@dataclasses.dataclass(frozen=True)
class Constants:
    """The model's constants as fitted on fla's published H100 times (`python -m
    benchmarks.predict.calibrate --fit`, 2026-12-06; docs/kernels.md, "Predicted GPU times"). Two sit at
    the bounds of benchmarks.predict.calibrate.BOUNDS: the dependent-path terms, which only the
    latency-bound case (B2 T16384) constrains, want to be longer still."""

    hmma_efficiency: float = 1.0  # mma.sync's share of the dense tensor peak (wgmma runs at the peak)
    cycles_per_instruction: float = 16.0  # a lone warp's cycles per issued instruction (dependencies)
    load_latency_cycles: float = 1500.0  # global-load latency a sequential loop waits each iteration
    hbm_efficiency: float = 0.8205  # achievable share of the HBM peak
    launch_seconds: float = 1.387e-05  # per launch (triton or aten): the device's gap between kernels
    host_seconds_per_launch: float = 6.85e-05  # the host's Python and driver time to issue one Triton launch

    def vector(self) -> list[float]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_vector(cls, values: list[float]) -> Constants:
        return cls(*values)


@dataclasses.dataclass(frozen=True)
class LaunchCost:
    """What a launch's price depends on, before the constants."""

    name: str
    config: str
    programs: int
    warps: int
    resident: int  # programs per SM
    registers: int
    shared: int
    work: Program
    hbm_bytes: float
    l2_bytes: float
    wgmma: bool  # its products run as wgmma (else mma.sync)

    def seconds(self, gpu: Gpu, c: Constants) -> float:
        """The launch's predicted time on ``gpu``."""
        per_wave = gpu.sms * self.resident
        full, rest = divmod(self.programs, per_wave)
        cycles = full * self._sm_cycles(self.resident, gpu, c)
        if rest:
            cycles += self._sm_cycles(math.ceil(rest / gpu.sms), gpu, c)
        compute = cycles / gpu.clock_hz
        memory = self.hbm_bytes / (gpu.hbm_bytes_per_s * c.hbm_efficiency)
        l2 = self.l2_bytes / (L2_BYTES_PER_CLOCK_PER_SM * gpu.sms * gpu.clock_hz)
        return max(compute, memory, l2) + c.launch_seconds

    def _sm_cycles(self, resident: int, gpu: Gpu, c: Constants) -> float:
        """Cycles of one SM running ``resident`` programs side by side."""
        w, work = resident * self.warps, self.work
        bf16 = work.tensor_flops - work.tf32_flops
        hmma_share = 1.0 if self.wgmma else c.hmma_efficiency
        tensor = resident * (bf16 + 2 * work.tf32_flops) / (gpu.tensor_flops_per_clock * hmma_share)
        units = [w * work.per_warp.get(u, 0.0) * 32 / gpu.lanes[r] for u, r in _RATE.items()]
        shared = resident * work.shared_bytes / SHARED_BYTES_PER_CLOCK
        issue = w * sum(work.per_warp.values()) / ISSUE_SLOTS
        path = sum(work.per_warp.values()) * c.cycles_per_instruction + work.waiting_iterations * c.load_latency_cycles
        return max(tensor, shared, issue, path, *units)


def occupancy(binary: Binary, gpu: Gpu) -> int:
    """Programs of ``binary`` resident per SM: registers (allocated per warp in units of 256), shared
    memory (1 KB reserved per block), warps and the block limit."""
    regs_per_warp = math.ceil(max(binary.registers, 1) * 32 / 256) * 256
    by_regs = gpu.regs_per_sm // (regs_per_warp * binary.warps)
    by_shared = gpu.smem_per_sm // (binary.shared + 1024)
    by_warps = gpu.max_warps_per_sm // binary.warps
    return max(1, min(by_regs, by_shared, by_warps, gpu.max_blocks_per_sm))


def launch_cost(launch: Launch, gpu: Gpu) -> LaunchCost:
    """The constant-free description of ``launch`` on ``gpu``: compile, count, size."""
    binary = compile_launch(launch, gpu.capability)
    work = program_work(binary, loop_trips(binary, launch))
    tensors = sum(t.numel() * t.element_size() for n, t in launch.args.items() if n in binary.used_args)
    l2 = work.global_bytes * launch.programs
    counted = not any(i.opcode in BULK_COPIES for i in binary.instructions)
    hbm = min(tensors, l2) if counted else tensors
    wgmma = any(i.opcode == "HGMMA" for i in binary.instructions)
    return LaunchCost(launch.name, launch.config(), launch.programs, launch.num_warps, occupancy(binary, gpu),
                      binary.registers, binary.shared, work, float(hbm), float(max(l2, hbm)), wgmma)
